"""The `elastune` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elastune_operator.scheduling.policy import POLICY_NAMES
from elastune_operator.sim.workload import PROFILE_NAMES


def _cmd_crds(args: argparse.Namespace) -> int:
    from elastune_contract.api.crds import render_crds, write_crds

    if args.write:
        for path in write_crds(Path(args.write)):
            print(f"wrote {path}")
        return 0
    print("\n---\n".join(text.rstrip("\n") for _, text in sorted(render_crds().items())))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    """Check manifests the way the API server (CRD schema) and the operator (models) will."""
    from elastune_contract.api import manifests

    failed = 0
    for m in manifests.load([Path(f) for f in args.file]):
        if m.problems:
            failed += 1
            print(f"{m.file}: {m.name}: invalid", file=sys.stderr)
            for problem in m.problems:
                print(f"  {problem}", file=sys.stderr)
        else:
            print(f"{m.file}: {m.name}: valid")
    return 1 if failed else 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    """Run the three schedulers on one seeded sample workload and print the comparison."""
    from dataclasses import replace

    from .sim.experiments import POLICIES, run_one
    from .sim.simulator import SimConfig
    from .sim.workload import profile

    wl = replace(
        profile(args.profile).config(args.load, args.slo_emergence, args.seed),
        arrivals_csv=Path(args.arrivals_csv) if args.arrivals_csv else None,
    )
    sim = SimConfig(cold_capacity=args.gpus, seed=args.seed)
    print(
        f"Simulating a 20-minute trace, {args.load} load ({sum(wl.jobs_per_llm.values())} TuningJobs "
        f"over {len(wl.jobs_per_llm)} LLMs), S = {args.slo_emergence}, {args.gpus} GPUs in the cold pool, "
        f"workload profile {args.profile}, seed {args.seed}"
    )
    print(
        f"{'scheduler':<14}{'SLO violations':>16}{'cost':>10}{'GPU util':>10}{'dropped':>9}"
        f"{'round mean/max':>18}"
    )
    results = {}
    for name in POLICIES:
        r = run_one(name, wl, sim)
        results[name] = r
        print(
            f"{name:<14}{r.slo_violation_pct:>15.1f}%{'$' + format(r.cost_usd, '.2f'):>10}"
            f"{r.utilization_pct:>9.1f}%{r.dropped:>9}"
            f"{r.round_ms_mean:>9.3f}/{r.round_ms_max:.2f} ms"
        )
    pt = results["promptTuner"]
    for base in ("infless", "elasticflow"):
        b = results[base]
        viol = b.slo_violation_pct / pt.slo_violation_pct if pt.slo_violation_pct else float("inf")
        cost = b.cost_usd / pt.cost_usd if pt.cost_usd else float("inf")
        print(f"PromptTuner vs {base}: {viol:.2f}× fewer SLO violations, {cost:.2f}× lower cost")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from .sim.calibrate import main

    return main(["--sweeps", str(args.sweeps)] + (["--check"] if args.check else []))


def _exec_worker_module(module: str, argv: list[str]) -> int:
    """Run a data-plane command in its own interpreter: the control plane never imports torch or the
    worker package (it runs in a small image), so it only checks that they are installed."""
    import importlib.util
    import os

    for name in ("elastune_worker", "torch"):
        if importlib.util.find_spec(name) is None:
            print(
                f"elastune: this command needs the worker extra ({name} is missing): "
                "pip install torch==2.13.0 (CPU; on its own first), then pip install 'elastune[worker]'",
                file=sys.stderr,
            )
            return 2
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on shared cores
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])
    return 0  # not reached


def _exec_gateway(argv: list[str]) -> int:
    """`elastune gateway [flags]`: the gateway in its own interpreter (it needs the gateway extra)."""
    import importlib.util
    import os

    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"elastune gateway needs the gateway extra (missing: {', '.join(missing)}): "
            "pip install 'elastune[gateway]'",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "elastune_gateway.server", *argv])
    return 0  # not reached


def _cmd_run(args: argparse.Namespace) -> int:
    from .local.run import RunError, RunOptions, run

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


def _cmd_serve(args: argparse.Namespace) -> int:
    from .local.run import RunError
    from .local.serve import ServeOptions, serve

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    crds = sub.add_parser("crds", help="print the CRDs generated from the API models (or --write them)")
    crds.add_argument("--write", metavar="DIR", help="write one YAML file per CRD into DIR")
    crds.set_defaults(func=_cmd_crds)

    val = sub.add_parser("validate", help="validate manifests against the CRD schemas and the API models")
    val.add_argument("-f", "--file", action="append", required=True, help="manifest file (repeatable)")
    val.set_defaults(func=_cmd_validate)

    simp = sub.add_parser("simulate", help="compare PromptTuner, INFless and ElasticFlow on a sample trace")
    simp.add_argument("--load", choices=["low", "medium", "high"], default="medium")
    simp.add_argument("--slo-emergence", type=float, default=1.0, help="S: SLO = duration × S + T_cold")
    simp.add_argument("--gpus", type=int, default=32, help="cold pool capacity (GPUs)")
    simp.add_argument("--seed", type=int, default=0)
    simp.add_argument(
        "--profile",
        choices=PROFILE_NAMES,
        default="calibrated",
        help="workload profile: calibrated (fitted to the paper's figures, default) or heavy",
    )
    simp.add_argument(
        "--arrivals-csv",
        help="replay arrival timestamps from this CSV (first column), stretched over the 20-minute trace",
    )
    simp.set_defaults(func=_cmd_simulate)

    bench = sub.add_parser(
        "bench",
        help="benchmarks that print measured figures (the elastune_bench package: elastune bench --help)",
        add_help=False,
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda a: _run_command("bench", a.rest))

    cal = sub.add_parser(
        "calibrate", help="fit the calibrated workload profile to the paper's figures; print residuals"
    )
    cal.add_argument("--sweeps", type=int, default=5, help="coordinate-descent sweeps at most")
    cal.add_argument("--check", action="store_true", help="only measure the committed profiles")
    cal.set_defaults(func=_cmd_calibrate)

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
    runp.set_defaults(func=_cmd_run)
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
    servep.set_defaults(func=_cmd_serve)

    worker = sub.add_parser(
        "worker", help="run one worker process (python -m elastune_worker serve)", add_help=False
    )
    worker.add_argument("rest", nargs=argparse.REMAINDER)
    worker.set_defaults(func=lambda a: _exec_worker_module("elastune_worker", ["serve", *a.rest]))

    gateway = sub.add_parser(
        "gateway", help="the OpenAI-compatible gateway in front of the warm workers", add_help=False
    )
    gateway.add_argument("rest", nargs=argparse.REMAINDER)
    gateway.set_defaults(func=lambda a: _exec_gateway(a.rest))

    bank = sub.add_parser("bank", help="Prompt Bank: build | lookup | insert", add_help=False)
    bank.add_argument("rest", nargs=argparse.REMAINDER)
    bank.set_defaults(func=lambda a: _exec_worker_module("elastune_worker.tiny.bank_cli", a.rest))
    return parser


def _run_operator(argv: list[str]) -> int:
    """`elastune operator [kopf run flags]`: kopf's own runner over our handlers module."""
    import os

    os.execv(
        sys.executable, [sys.executable, "-m", "kopf", "run", "-m", "elastune_operator.k8s.handlers", *argv]
    )
    return 0  # not reached


#: Data-plane commands: everything after them goes to the worker package's own parser (incl. --help).
WORKER_COMMANDS: dict[tuple[str, ...], list[str]] = {
    ("worker",): ["elastune_worker", "serve"],
    ("bank",): ["elastune_worker.tiny.bank_cli"],
}

#: The entry-point group of commands that packages outside the product add to `elastune` (the benchmarks:
#: ``bench = "elastune_bench.cli:main"``, pyproject.toml); the product never imports them.
COMMANDS_GROUP = "elastune.commands"


def _run_command(name: str, argv: list[str]) -> int:
    """`elastune NAME ...` for a command that a package outside the product provides through an entry
    point: load its ``main(argv)`` and call it with the arguments after NAME."""
    from importlib.metadata import entry_points

    found = entry_points(group=COMMANDS_GROUP, name=name)
    try:
        command = next(iter(found)).load() if found else None
    except ImportError as exc:
        print(f"elastune {name}: {exc}", file=sys.stderr)
        command = None
    if command is None:
        print(
            f"elastune {name}: the benchmarks package (elastune_bench, folder bench/ of the source tree) is "
            "not installed here: pip install -e '.[dev,worker,gateway]' from a checkout",
            file=sys.stderr,
        )
        return 2
    return int(command(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for prefix, target in WORKER_COMMANDS.items():
        if tuple(argv[: len(prefix)]) == prefix:
            return _exec_worker_module(target[0], target[1:] + argv[len(prefix) :])
    if argv[:1] == ["operator"]:
        return _run_operator(argv[1:])
    if argv[:1] == ["gateway"]:
        return _exec_gateway(argv[1:])
    if argv[:1] == ["bench"]:
        return _run_command("bench", argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
