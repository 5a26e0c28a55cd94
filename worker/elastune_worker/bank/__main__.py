"""Prompt Bank command line: build the per-LLM structure, look up an initial prompt, insert candidates.

    python -m elastune_worker.bank build  --model DIR --candidates FILE [--llm-key KEY] [--out DIR]
                                          [--k 50] [--capacity 3000]
    python -m elastune_worker.bank lookup --model DIR --dataset FILE.jsonl [--bank DIR | --llm-key KEY]
                                          [--max-samples 16] [--layout soft|text] [--virtual-tokens 20]
    python -m elastune_worker.bank insert --model DIR PROMPT… [--file FILE] [--bank DIR | --llm-key KEY]
    python -m elastune_worker.bank info   --model DIR [--bank DIR | --llm-key KEY]

The model is a directory that transformers loads offline (an HF-format causal LM and its tokenizer);
the candidates a file of prompts (one per line, or a JSON list); the dataset a JSONL of
``{"input", "target"}`` records, as a TuningJob's. ``elastune bank`` resolves the project's demo
defaults first (``elastune_demo/bank_cli.py``: the tiny models and the candidates written for their task
suite).

Every command accepts ``--json`` (one JSON document on stdout). A BankError prints ``error: Reason:
message`` on stderr and exits 3, so a caller can fall back to the job's own initial prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

EXIT_BANK_ERROR = 3


def _bank_path(args: argparse.Namespace, model_dir: Path) -> Path:
    from elastune_worker.bank.store import bank_dir, default_llm_key

    if getattr(args, "bank", None):
        return Path(args.bank)
    return bank_dir(args.llm_key or default_llm_key(model_dir))


def read_prompts(path: Path) -> list[str]:
    """One prompt per line (blank lines skipped), or a JSON list of strings."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return [str(x) for x in json.loads(text)]
    return [line.strip() for line in text.splitlines() if line.strip()]


def _emit(args: argparse.Namespace, doc: dict[str, Any], lines: list[str]) -> None:
    if args.json:
        print(json.dumps(doc, ensure_ascii=False, indent=2))
    else:
        print("\n".join(lines))


def read_records(path: Path) -> list[dict[str, Any]]:
    """A JSONL dataset's records (blank lines skipped); records without a target are the lookup's to
    refuse (NoTargets), so they are kept."""
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_model(model_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) from ``model_dir``, strictly from local files, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model.eval()
    return model, AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def cmd_build(args: argparse.Namespace) -> int:
    from elastune_worker.bank.store import build_bank, default_llm_key

    model_dir = args.model
    candidates = read_prompts(args.candidates)
    key = args.llm_key or default_llm_key(model_dir)
    out = Path(args.out) if args.out else None
    bank = build_bank(model_dir, out, candidates, args.k, args.seed, capacity=args.capacity, llm_key=key)
    info = bank.describe() | {"build": bank.meta.build}
    sizes = info["cluster_size"]
    _emit(
        args,
        info,
        [
            f"built the Prompt Bank of {key}: {len(bank)} candidates, K={bank.k} "
            f"(clusters {sizes['min']}–{sizes['max']}, median {sizes['median']:g}), "
            f"{bank.meta.build['seconds']:.1f} s",
            f"saved to {bank.path}",
        ],
    )
    return 0


def cmd_lookup(args: argparse.Namespace) -> int:
    from elastune_worker.bank.lookup import lookup, predict_lookup_seconds
    from elastune_worker.bank.store import PromptBank

    model_dir = args.model
    bank = PromptBank.load(_bank_path(args, model_dir))
    records = read_records(args.dataset)
    predicted = predict_lookup_seconds(bank, min(len(records), args.max_samples))
    model, tokenizer = load_model(model_dir)
    res = lookup(
        bank,
        model,
        tokenizer,
        records,
        args.max_samples,
        args.batch_size,
        layout=args.layout,
        virtual_tokens=args.virtual_tokens,
    )
    doc = res.to_dict() | {"predicted_latency_s": predicted}
    _emit(
        args,
        doc,
        [
            f"prompt: {res.prompt}",
            f"score {res.score:.4f} (cluster {res.cluster} of {res.k}, {res.cluster_size} members, medoid "
            f"{res.medoid!r} scored {res.medoid_score:.4f})",
            f"{res.evaluations} evaluations of {res.candidates} candidates on {res.n_samples} samples, "
            f"{res.latency_s:.2f} s (predicted {predicted:.2f} s)",
        ],
    )
    return 0


def cmd_insert(args: argparse.Namespace) -> int:
    from elastune_worker.bank.store import PromptBank
    from elastune_worker.model_cache import build_lock

    model_dir = args.model
    path = _bank_path(args, model_dir)
    prompts = list(args.prompts) + (read_prompts(args.file) if args.file else [])
    if not prompts:
        print("error: nothing to insert (give prompts or --file)", file=sys.stderr)
        return 2
    # Load, insert, save under a lock: two concurrent inserts must not lose each other's prompts.
    path.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(path.resolve()):
        bank = PromptBank.load(path)
        if Path(bank.meta.model_dir).resolve() != model_dir.resolve():
            # The same LLM at another path is fine; another LLM's features would misplace the prompts.
            from elastune_worker.bank.errors import NO_FEATURES, BankError
            from elastune_worker.bank.features import FeatureExtractor, model_fingerprint

            if model_fingerprint(model_dir) != bank.meta.model_fingerprint:
                raise BankError(NO_FEATURES, f"bank {path} belongs to {bank.meta.llm}, not {model_dir}")
            bank.attach_extractor(FeatureExtractor.from_dir(model_dir))
        results = bank.insert_many(prompts)
        bank.save()
    lines = [
        f"{r.reason:9s} cluster {r.cluster:3d} (d={r.distance:.4f})  {r.prompt}"
        + (f"   evicted: {r.evicted!r}" if r.evicted else "")
        for r in results
    ]
    lines.append(f"bank size {len(bank)} / capacity {bank.capacity}, saved to {bank.path}")
    _emit(args, {"results": [r.to_dict() for r in results], "size": len(bank)}, lines)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from elastune_worker.bank.store import PromptBank

    bank = PromptBank.load(_bank_path(args, args.model))
    info = bank.describe() | {"build": bank.meta.build, "model_dir": bank.meta.model_dir}
    _emit(args, info, [json.dumps(info, indent=2)])
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m elastune_worker.bank", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, bank: bool = True) -> None:
        sp.add_argument("--model", type=Path, required=True, help="the LLM's directory (HF format, local)")
        sp.add_argument("--llm-key", help="LLM key of the bank (default: the resolved model path)")
        if bank:
            sp.add_argument("--bank", type=Path, help="bank directory (default: bank_dir(llm key))")
        sp.add_argument("--json", action="store_true", help="print one JSON document")
        sp.add_argument("--threads", type=int, default=None, help="torch intra-op threads")

    b = sub.add_parser("build", help="extract features, cluster, save")
    common(b, bank=False)
    b.add_argument("--out", type=Path, help="output directory (default: bank_dir(llm key))")
    b.add_argument("--k", type=int, default=50, help="clusters (default 50; √C minimises evaluations)")
    b.add_argument(
        "--candidates", type=Path, required=True, help="prompts file (one per line, or a JSON list)"
    )
    b.add_argument("--capacity", type=int, default=3000)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=cmd_build)

    lk = sub.add_parser("lookup", help="pick an initial prompt for a dataset")
    common(lk)
    lk.add_argument("--dataset", type=Path, required=True, help="JSONL of {input, target} eval samples")
    lk.add_argument("--max-samples", type=int, default=16)
    lk.add_argument("--batch-size", type=int, default=256, help="(candidate × sample) rows per forward pass")
    lk.add_argument("--layout", choices=("soft", "text"), default="soft")
    lk.add_argument("--virtual-tokens", type=int, default=20)
    lk.set_defaults(func=cmd_lookup)

    ins = sub.add_parser("insert", help="add candidates (nearest medoid, replacement past capacity)")
    common(ins)
    ins.add_argument("prompts", nargs="*")
    ins.add_argument("--file", type=Path, help="prompts file (one per line, or a JSON list)")
    ins.set_defaults(func=cmd_insert)

    info = sub.add_parser("info", help="describe a saved bank")
    common(info)
    info.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on shared cores
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from elastune_worker.bank.errors import BankError

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return int(args.func(args))
    except BankError as exc:
        if args.json:
            print(json.dumps({"error": {"reason": exc.reason, "message": exc.message}}))
        print(f"error: {exc.reason}: {exc.message}", file=sys.stderr)
        return EXIT_BANK_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
