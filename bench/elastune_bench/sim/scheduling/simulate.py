"""`elastune simulate`: the three schedulers on one seeded sample workload, side by side.

The product CLI (``elastune_cli``) never imports this package: it finds ``main`` through the
``elastune.commands`` entry point ``simulate`` (pyproject.toml) and passes the arguments after the name.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .experiments import POLICIES, run_one
from .simulator import SimConfig
from .workload import PROFILE_NAMES, profile

HELP = "compare PromptTuner, INFless and ElasticFlow on a sample trace"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastune simulate", description=HELP)
    p.add_argument(
        "--load",
        choices=["low", "medium", "high"],
        default="medium",
        help="arrival rate of TuningJobs (§6.1)",
    )
    p.add_argument("--slo-emergence", type=float, default=1.0, help="S: SLO = duration × S + T_cold")
    p.add_argument("--gpus", type=int, default=32, help="cold pool capacity (GPUs)")
    p.add_argument("--seed", type=int, default=0, help="seeds the trace and the simulator")
    p.add_argument(
        "--profile",
        choices=PROFILE_NAMES,
        default="calibrated",
        help="workload profile: calibrated (fitted to the paper's figures, default) or heavy",
    )
    p.add_argument(
        "--arrivals-csv",
        help="replay arrival timestamps from this CSV (first column), stretched over the 20-minute trace",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
