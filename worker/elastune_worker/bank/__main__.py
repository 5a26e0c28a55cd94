"""Prompt Bank command line: build the per-LLM structure, look up an initial prompt, insert candidates.

    python -m elastune_worker.bank build  [--model DIR|tiny|tiny-bank] [--llm-key KEY] [--out DIR]
                                          [--k 50] [--candidates FILE] [--n 3000] [--capacity 3000]
    python -m elastune_worker.bank lookup (--dataset FILE.jsonl | --task FAMILY-NN) [--model …]
                                          [--bank DIR | --llm-key KEY] [--max-samples 16]
                                          [--layout soft|text] [--virtual-tokens 20]
    python -m elastune_worker.bank insert PROMPT… [--file FILE] [--model …] [--bank DIR | --llm-key KEY]
    python -m elastune_worker.bank info   [--model …] [--bank DIR | --llm-key KEY]

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


def _model_dir(spec: str) -> Path:
    """``tiny`` (default) and ``tiny-bank`` name the project's tiny models (built on first use)."""
    if spec == "tiny":
        from elastune_worker.tiny.build import ensure_tiny_model

        return ensure_tiny_model()
    if spec == "tiny-bank":
        from elastune_worker.bank.model import ensure_bank_model

        return ensure_bank_model()
    return Path(spec)


def _bank_path(args: argparse.Namespace, model_dir: Path) -> Path:
    from elastune_worker.bank.store import bank_dir, default_llm_key

    if getattr(args, "bank", None):
        return Path(args.bank)
    return bank_dir(args.llm_key or default_llm_key(model_dir))


def _read_lines(path: Path) -> list[str]:
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


def cmd_build(args: argparse.Namespace) -> int:
    from elastune_worker.bank.candidates import default_candidates
    from elastune_worker.bank.store import build_bank, default_llm_key

    model_dir = _model_dir(args.model)
    candidates = _read_lines(args.candidates) if args.candidates else default_candidates(args.n, args.seed)
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


def _records(args: argparse.Namespace) -> list[dict[str, Any]]:
    from elastune_worker.tiny import tasks as T

    if args.dataset:
        return T.read_jsonl(args.dataset)
    family, _, part = args.task.rpartition("-")
    task = T.make_task(T.TaskSpec(family, int(part)), n_train=0, n_eval=args.max_samples, seed=args.seed)
    return list(task.eval)


def cmd_lookup(args: argparse.Namespace) -> int:
    from elastune_worker.bank.lookup import lookup, predict_lookup_seconds
    from elastune_worker.bank.store import PromptBank
    from elastune_worker.tiny.build import load_tiny_model

    model_dir = _model_dir(args.model)
    bank = PromptBank.load(_bank_path(args, model_dir))
    records = _records(args)
    predicted = predict_lookup_seconds(bank, min(len(records), args.max_samples))
    model, tokenizer = load_tiny_model(model_dir)
    model.eval()
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

    model_dir = _model_dir(args.model)
    path = _bank_path(args, model_dir)
    prompts = list(args.prompts) + (_read_lines(args.file) if args.file else [])
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

    bank = PromptBank.load(_bank_path(args, _model_dir(args.model)))
    info = bank.describe() | {"build": bank.meta.build, "model_dir": bank.meta.model_dir}
    _emit(args, info, [json.dumps(info, indent=2)])
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m elastune_worker.bank", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, bank: bool = True) -> None:
        sp.add_argument("--model", default="tiny", help="model directory, or tiny | tiny-bank (default tiny)")
        sp.add_argument("--llm-key", help="LLM key of the bank (default: the resolved model path)")
        if bank:
            sp.add_argument("--bank", type=Path, help="bank directory (default: bank_dir(llm key))")
        sp.add_argument("--json", action="store_true", help="print one JSON document")
        sp.add_argument("--threads", type=int, default=None, help="torch intra-op threads")

    b = sub.add_parser("build", help="extract features, cluster, save")
    common(b, bank=False)
    b.add_argument("--out", type=Path, help="output directory (default: bank_dir(llm key))")
    b.add_argument("--k", type=int, default=50, help="clusters (default 50; √C minimises evaluations)")
    b.add_argument("--candidates", type=Path, help="prompts file (one per line, or a JSON list)")
    b.add_argument("--n", type=int, default=3000, help="generated candidates when --candidates is absent")
    b.add_argument("--capacity", type=int, default=3000)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=cmd_build)

    lk = sub.add_parser("lookup", help="pick an initial prompt for a dataset")
    common(lk)
    src = lk.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", type=Path, help="JSONL of {input, target} eval samples")
    src.add_argument(
        "--task", help="a task of the tiny suite, e.g. units-01 (eval samples drawn with --seed)"
    )
    lk.add_argument("--seed", type=int, default=0)
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
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see tiny/build.py
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
