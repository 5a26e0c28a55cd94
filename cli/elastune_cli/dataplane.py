"""`elastune worker`, `elastune gateway` and `elastune bank`: data-plane commands, each run in its own
interpreter with its own parser (everything after the command name, --help included, goes to it). The
control plane's small image has no torch, so this module only checks that the extra is installed."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable

WORKER_EXTRA = "pip install torch==2.13.0 (CPU; on its own first), then pip install 'elastune[worker]'"


def _exec(module: str, argv: list[str]) -> int:
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])
    return 0  # not reached


def exec_worker_module(module: str, argv: list[str]) -> int:
    for name in ("elastune_worker", "torch"):
        if importlib.util.find_spec(name) is None:
            print(
                f"elastune: this command needs the worker extra ({name} is missing): {WORKER_EXTRA}",
                file=sys.stderr,
            )
            return 2
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on shared cores
    return _exec(module, argv)


def exec_gateway(argv: list[str]) -> int:
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"elastune gateway needs the gateway extra (missing: {', '.join(missing)}): "
            "pip install 'elastune[gateway]'",
            file=sys.stderr,
        )
        return 2
    return _exec("elastune_gateway.server", argv)


def exec_bank(argv: list[str]) -> int:
    if importlib.util.find_spec("elastune_demo") is None:
        print(
            "elastune bank: its defaults (the tiny models, candidates) come from the demo package "
            "elastune_demo, which is not installed here: pip install -e . from a checkout; or run "
            "python -m elastune_worker.bank with your own model and candidates",
            file=sys.stderr,
        )
        return 2
    return exec_worker_module("elastune_demo.bank_cli", argv)


#: name -> (help, runner of the arguments after the name)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "worker": (
        "run one worker process (python -m elastune_worker serve; elastune worker --help)",
        lambda argv: exec_worker_module("elastune_worker", ["serve", *argv]),
    ),
    "gateway": (
        "the OpenAI-compatible gateway in front of the warm workers (elastune gateway --help)",
        exec_gateway,
    ),
    "bank": (
        "Prompt Bank: build | lookup | insert, with the demo defaults (elastune bank --help)",
        exec_bank,
    ),
}


def register(sub: argparse._SubParsersAction) -> None:
    for name, (help_text, runner) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args, runner=runner: runner(args.rest))
