"""`elastune run` and `elastune serve`: TuningJobs and serving on this machine, no cluster, no GPU
(``elastune_operator.local`` starts the worker processes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elastune_operator.scheduling.policy import POLICY_NAMES


def _run(args: argparse.Namespace) -> int:
    from elastune_operator.local.run import RunError, RunOptions, run

    opts = RunOptions(
        files=[Path(f) for f in args.file],
        workers=args.workers,
        state_dir=Path(args.state_dir),
        redis_url=args.redis_url,
        channel=args.channel,
        timeout=args.timeout,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        policy=args.policy,
    )
    try:
        return run(opts)
    except RunError as exc:
        print(f"elastune run: {exc}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from elastune_operator.local.run import RunError
    from elastune_operator.local.serve import ServeOptions, serve

    opts = ServeOptions(
        files=[Path(f) for f in args.file],
        port=args.port,
        workers=args.workers,
        state_dir=Path(args.state_dir),
        redis_url=args.redis_url,
        timeout=args.timeout,
    )
    try:
        return serve(opts)
    except RunError as exc:
        print(f"elastune serve: {exc}", file=sys.stderr)
        return 2


def register(sub: argparse._SubParsersAction) -> None:
    runp = sub.add_parser("run", help="run TuningJobs to completion on this machine (no cluster, no GPU)")
    runp.add_argument("-f", "--file", action="append", required=True, help="manifest file (repeatable)")
    runp.add_argument("--workers", type=int, default=2, help="local CPU workers = GPUs of the cold pool")
    runp.add_argument("--state-dir", default=".elastune", help="checkpoints, artifacts, logs, status")
    runp.add_argument("--redis-url", help="use this Redis instead of starting an embedded one")
    runp.add_argument(
        "--channel", default="redis", help="gradient channel: redis (default), memcached, or a URL"
    )
    runp.add_argument("--timeout", type=float, help="give up after this many seconds")
    runp.add_argument("--eval-every", type=int, default=10, help="iterations between evaluations")
    runp.add_argument("--checkpoint-every", type=int, default=10, help="iterations between checkpoints")
    runp.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default="promptTuner",
        help="scheduling policy: promptTuner (default) or a baseline of the paper (infless, elasticflow)",
    )
    runp.set_defaults(func=_run)

    servep = sub.add_parser(
        "serve", help="serve WarmPools, LoRAAdapters and published prompts on this machine behind the gateway"
    )
    servep.add_argument(
        "-f", "--file", action="append", required=True, help="manifest file or folder (repeatable)"
    )
    servep.add_argument("--port", type=int, default=8000, help="the gateway's port (0: a free one)")
    servep.add_argument("--workers", type=int, default=2, help="local CPU workers = GPUs of the cold pool")
    servep.add_argument("--state-dir", default=".elastune", help="checkpoints, artifacts, logs, status")
    servep.add_argument("--redis-url", help="use this Redis instead of starting an embedded one")
    servep.add_argument("--timeout", type=float, help="stop after this many seconds (default: Ctrl-C)")
    servep.set_defaults(func=_serve)
