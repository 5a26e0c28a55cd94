"""The `elastune` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def _cmd_crds(args: argparse.Namespace) -> int:
    from .api.crds import render_crds, write_crds

    if args.write:
        for path in write_crds(Path(args.write)):
            print(f"wrote {path}")
        return 0
    print("\n---\n".join(text.rstrip("\n") for _, text in sorted(render_crds().items())))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    """Check manifests the way the API server (CRD schema) and the operator (models) will."""
    from .api.crdcheck import validate_against_crd
    from .api.crds import render_crds
    from .api.resources import InvalidResource, parse_resource

    crds = {}
    for text in render_crds().values():
        crd = yaml.safe_load(text)
        crds[crd["spec"]["names"]["kind"]] = crd
    failed = 0
    for file in args.file:
        docs = [d for d in yaml.safe_load_all(Path(file).read_text()) if d]
        for doc in docs:
            name = f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"
            crd = crds.get(doc.get("kind", ""))
            problems = validate_against_crd(doc, crd) if crd else [f"kind: unknown kind {doc.get('kind')!r}"]
            try:
                parse_resource(doc)
            except InvalidResource as exc:
                problems += [f"(model) {e}" for e in exc.errors]
            if problems:
                failed += 1
                print(f"{file}: {name}: invalid", file=sys.stderr)
                for problem in problems:
                    print(f"  {problem}", file=sys.stderr)
            else:
                print(f"{file}: {name}: valid")
    return 1 if failed else 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    """Run the three schedulers on one seeded sample workload and print the comparison."""
    from .sim.experiments import POLICIES, run_one
    from .sim.simulator import SimConfig
    from .sim.workload import LOADS, WorkloadConfig

    wl = WorkloadConfig(
        jobs_per_llm=dict(LOADS[args.load]),
        slo_emergence=args.slo_emergence,
        seed=args.seed,
        arrivals_csv=Path(args.arrivals_csv) if args.arrivals_csv else None,
    )
    sim = SimConfig(cold_capacity=args.gpus, seed=args.seed)
    print(
        f"Simulating a 20-minute trace, {args.load} load ({sum(wl.jobs_per_llm.values())} TuningJobs "
        f"over {len(wl.jobs_per_llm)} LLMs), S = {args.slo_emergence}, {args.gpus} GPUs in the cold pool, "
        f"seed {args.seed}"
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


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "scheduler":
        from .sim.bench_scheduler import run

        run(
            args.quick,
            Path(args.json) if args.json else None,
            Path(args.plot) if args.plot else None,
            args.seeds,
        )
        return 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


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
        "--arrivals-csv",
        help="replay arrival timestamps from this CSV (first column), stretched over the 20-minute trace",
    )
    simp.set_defaults(func=_cmd_simulate)

    bench = sub.add_parser("bench", help="benchmarks that print measured figures")
    bench.add_argument("what", choices=["scheduler"])
    bench.add_argument("--quick", action="store_true", help="fewer seeds, shorter scale run (< 60 s)")
    bench.add_argument("--json", metavar="PATH")
    bench.add_argument("--plot", metavar="PATH")
    bench.add_argument("--seeds", type=int, help="seeds per cell (default 5, --quick 2)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
