"""`elastune bench coserve-sim`: the mixed workload (tuning + inference on the same pools) with and without
co-serving, at a light and a heavy inference load, on the calibrated workload (medium tuning load,
S = 1.0), for the GPU co-serving model (FlexLLM's measured retention) and the CPU one (measured here).
Prints both rows and their ratios with the machine's load; ``--json`` writes them."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastune_bench.sim.scheduling.mixed import MixedConfig, with_and_without
from elastune_bench.sim.scheduling.simulator import SimConfig
from elastune_bench.sim.scheduling.workload import profile
from elastune_operator.scheduling.coserving import CoServeModel

LOADS = {"light": 0.3, "heavy": 0.8}
"""Mean inference utilisation of the serving pods."""


def run(quick: bool, seeds: int | None = None) -> dict[str, Any]:
    n = seeds or (2 if quick else 5)
    workload = profile("calibrated").config("medium", 1.0)
    out: dict[str, Any] = {"seeds": n, "serving_pods_per_llm": MixedConfig().serving_pods}
    for kind in ("gpu", "cpu"):
        for load, mean in LOADS.items():
            cfg = MixedConfig(mean_utilization=mean, model=CoServeModel(kind))  # type: ignore[arg-type]
            out[f"{kind}.{load}"] = with_and_without(workload, SimConfig(), cfg, list(range(n)))
    # The headline keys: the platform's target (GPU model) at the heavy load.
    out["with_coserving"] = out["gpu.heavy"]["with_coserving"]
    out["without_coserving"] = out["gpu.heavy"]["without_coserving"]
    out["load_avg"] = list(os.getloadavg())
    return out


def report(result: dict[str, Any]) -> None:
    print(f"mixed workload, {result['seeds']} seeds, {result['serving_pods_per_llm']} serving pods per LLM")
    print(f"{'model.load':<12} {'mode':<18} {'SLO viol %':>10} {'cost $':>8} {'co-served':>9}")
    for key in (k for k in result if "." in k and k not in ("load_avg",)):
        cell = result[key]
        for mode in ("without_coserving", "with_coserving"):
            c = cell[mode]
            print(
                f"{key:<12} {mode:<18} {c['slo_violation_pct']:>10.2f} {c['cost_usd']:>8.2f} "
                f"{c['coserved_jobs']:>9.1f}"
            )
        w, wo = cell["with_coserving"], cell["without_coserving"]
        cost = wo["cost_usd"] / w["cost_usd"] if w["cost_usd"] else float("inf")
        print(
            f"{'':<12} co-serving: {cost:.2f}x lower cost, SLO violations "
            f"{wo['slo_violation_pct']:.2f} % -> {w['slo_violation_pct']:.2f} %"
        )
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in result["load_avg"]))


def run_and_report(quick: bool, json_path: Path | None, seeds: int | None = None) -> dict[str, Any]:
    """Run, print the rows and (with ``json_path``) write them; ``elastune bench coserve`` adds them to its
    own JSON under ``sim``."""
    result = run(quick, seeds)
    report(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="elastune bench coserve-sim",
        description="the mixed tuning + inference workload in the simulator, with and without co-serving",
    )
    p.add_argument("--quick", action="store_true", help="2 seeds instead of 5")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--seeds", type=int)
    args = p.parse_args(argv)
    run_and_report(args.quick, Path(args.json) if args.json else None, args.seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
