"""``elastune bank``: the Prompt Bank's command line with the project's demo defaults filled in.

The bank's own command line (``python -m elastune_worker.bank``) takes a model directory, a candidates
file and a JSONL dataset, like the rest of the product. This module resolves what the caller left out
from the tiny fixtures, then runs it in the same process:

- ``--model`` absent or ``tiny``: the tiny GPT-2 (built on first use); ``tiny-bank``: the
  instruction-following variant the bank benchmark uses (``bank_model.py``); anything else: a directory;
- ``build`` without ``--candidates``: ``--n`` (default 3,000) of the candidates written for the tiny
  suite (``bank_candidates.py``, seeded by ``--seed``);
- ``lookup --task FAMILY-NN`` instead of ``--dataset``: that task's eval samples (``--max-samples`` of
  them, drawn with ``--seed``).

    python -m elastune_demo.bank_cli build|lookup|insert|info [the bank's flags] [the above]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

COMMANDS = ("build", "lookup", "insert", "info")


def model_dir(name: str) -> Path:
    """``tiny`` and ``tiny-bank`` name the project's tiny models (built on first use)."""
    if name == "tiny":
        from elastune_demo.build import ensure_tiny_model

        return ensure_tiny_model()
    if name == "tiny-bank":
        from elastune_demo.bank_model import ensure_bank_model

        return ensure_bank_model()
    return Path(name)


def write_task_records(task: str, n: int, seed: int, out: Path) -> Path:
    """``n`` eval samples of a tiny-suite task (``units-01``) as a JSONL dataset at ``out``."""
    from elastune_demo import tasks as T

    family, _, part = task.rpartition("-")
    samples = T.make_task(T.TaskSpec(family, int(part)), n_train=0, n_eval=n, seed=seed).eval
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in samples), encoding="utf-8")
    return out


def write_candidates(n: int, seed: int, out: Path) -> Path:
    from elastune_demo.bank_candidates import default_candidates

    out.write_text(json.dumps(default_candidates(n, seed), ensure_ascii=False), encoding="utf-8")
    return out


def resolve(argv: list[str], scratch: Path) -> list[str]:
    """The bank CLI's arguments with the demo defaults made explicit (files written under ``scratch``)."""
    if not argv or argv[0] not in COMMANDS or "-h" in argv or "--help" in argv:
        return argv  # the bank's own parser answers (usage, --help) without building a model
    command, rest = argv[0], argv[1:]
    demo = argparse.ArgumentParser(prog="elastune bank", add_help=False, allow_abbrev=False)
    demo.add_argument("--model", default="tiny")
    if command == "build":
        from elastune_demo.bank_candidates import DEFAULT_SIZE

        demo.add_argument("--candidates")
        demo.add_argument("--n", type=int, default=DEFAULT_SIZE)
        demo.add_argument("--seed", type=int, default=0)
    if command == "lookup":
        demo.add_argument("--task")
        demo.add_argument("--seed", type=int, default=0)
        demo.add_argument("--max-samples", type=int, default=16)
    known, passthrough = demo.parse_known_args(rest)
    out = [command, "--model", str(model_dir(known.model)), *passthrough]
    if command == "build":
        given = known.candidates
        out += [
            "--candidates",
            given or str(write_candidates(known.n, known.seed, scratch / "candidates.json")),
        ]
        out += ["--seed", str(known.seed)]
    if command == "lookup":
        if known.task:
            if "--dataset" in passthrough:
                demo.error("give --task or --dataset, not both")
            records = write_task_records(known.task, known.max_samples, known.seed, scratch / "task.jsonl")
            out += ["--dataset", str(records)]
        out += ["--max-samples", str(known.max_samples)]
    return out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see build.py
    from elastune_worker.bank.__main__ import main as bank_main

    with tempfile.TemporaryDirectory(prefix="elastune-bank-") as scratch:
        return bank_main(resolve(list(sys.argv[1:] if argv is None else argv), Path(scratch)))


if __name__ == "__main__":
    raise SystemExit(main())
