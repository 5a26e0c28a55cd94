"""`elastune bench scheduler`: Fig. 7, Table 8, Fig. 8c of the paper, and the 1,000-GPU scale run."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO

from .experiments import (
    IDLE_WINDOWS,
    POLICIES,
    SLO_LEVELS,
    Cell,
    ablations,
    end_to_end,
    idle_window_sweep,
    scale_run,
)
from .simulator import SimConfig
from .workload import LOADS

# The paper's headline (abstract, §6.2) at medium load, S = 1.0: PromptTuner vs each baseline.
TARGETS = {
    "slo_vs_infless": 4.0,
    "slo_vs_elasticflow": 7.9,
    "cost_vs_infless": 1.6,
    "cost_vs_elasticflow": 4.5,
}
ROUND_TARGETS_MS = {"mean": 1.0, "max": 10.0}


def _ratio(baseline: float, ours: float) -> float:
    if ours <= 0:
        return float("inf") if baseline > 0 else 1.0
    return baseline / ours


def ratios(cells: dict[str, Cell]) -> dict[str, float]:
    pt, inf, ef = cells["promptTuner"], cells["infless"], cells["elasticflow"]
    return {
        "slo_vs_infless": round(_ratio(inf.slo_violation_pct, pt.slo_violation_pct), 2),
        "slo_vs_elasticflow": round(_ratio(ef.slo_violation_pct, pt.slo_violation_pct), 2),
        "cost_vs_infless": round(_ratio(inf.cost_usd, pt.cost_usd), 2),
        "cost_vs_elasticflow": round(_ratio(ef.cost_usd, pt.cost_usd), 2),
    }


def run(
    quick: bool, json_path: Path | None, plot_path: Path | None, seeds: int | None, out: TextIO = sys.stdout
) -> dict[str, object]:
    n_seeds = seeds or (2 if quick else 5)
    seed_list = list(range(n_seeds))
    sim = SimConfig(max_seconds=2 * 3600.0)
    t0 = time.perf_counter()
    p = lambda s: print(s, file=out, flush=True)  # noqa: E731
    p(f"elastune bench scheduler — {n_seeds} seeds per cell, 3 LLMs, cold pool {sim.cold_capacity} GPUs")

    e2e = end_to_end(seed_list, sim)
    p("\nFig. 7 — SLO violation % / cost $ (seed mean); ratios = baseline / PromptTuner")
    p(
        f"{'setting':<14}"
        + "".join(f"{name:>22}" for name in POLICIES)
        + f"{'viol ×INF/×EF':>16}{'cost ×INF/×EF':>16}"
    )
    result_e2e: dict[str, object] = {}
    for key, cells in e2e.items():
        r = ratios(cells)
        row = "".join(f"{c.slo_violation_pct:>12.1f}% ${c.cost_usd:>7.2f}" for c in cells.values())
        p(
            f"{key:<14}{row}"
            f"{r['slo_vs_infless']:>8.2f}/{r['slo_vs_elasticflow']:<7.2f}"
            f"{r['cost_vs_infless']:>8.2f}/{r['cost_vs_elasticflow']:<7.2f}"
        )
        result_e2e[key] = {**{k: c.as_dict() for k, c in cells.items()}, "ratios": r}

    abl = ablations(seed_list, sim)
    p("\nTable 8 — medium load, S = 1.0")
    for name, c in abl.items():
        p(f"  {name:<26} violation {c.slo_violation_pct:6.1f}%   cost ${c.cost_usd:7.2f}")

    sweep = idle_window_sweep(seed_list, sim)
    p("\nFig. 8c — idle window, medium load, S = 1.0")
    for name, c in sweep.items():
        p(f"  window {name:>5}  violation {c.slo_violation_pct:6.1f}%   cost ${c.cost_usd:7.2f}")

    # Wall-clock round times are sensitive to other load on the machine: three repetitions, and the
    # one with the median worst round is reported (all three are in the JSON).
    reps = sorted(
        (scale_run(seconds=60.0 if quick else 120.0) for _ in range(3)), key=lambda s: s.round_ms_max
    )
    scale = reps[1]
    p(
        f"\nScale — {scale.gpus} GPUs, ≥{scale.min_pending} pending jobs, {scale.llms} LLMs, "
        f"{scale.rounds} rounds: round mean {scale.round_ms_mean:.3f} ms, max {scale.round_ms_max:.3f} ms, "
        f"p99 {scale.round_ms_p99:.3f} ms ({scale.recomputed_rounds} recomputed, "
        f"mean {scale.recomputed_ms_mean:.3f} ms); max of the 3 repetitions: "
        f"{', '.join(f'{r.round_ms_max:.2f}' for r in reps)} ms; paper: 13 / 67 ms at 96 GPUs"
    )

    medium = e2e["medium_S1.0"]
    r = ratios(medium)
    p("\nHeadline (medium, S = 1.0) vs the paper's:")
    checks = {}
    for k, target in TARGETS.items():
        ok = r[k] >= target
        checks[k] = {"measured": r[k], "target": target, "met": ok}
        p(f"  {k:<22} {r[k]:>6.2f}×  (paper ≥ {target}×)  {'met' if ok else 'MISSED'}")
    for k, limit in ROUND_TARGETS_MS.items():
        v = scale.round_ms_mean if k == "mean" else scale.round_ms_max
        checks[f"round_ms_{k}"] = {"measured": round(v, 4), "target": limit, "met": v <= limit}
        p(f"  round {k:<16} {v:>7.3f} ms (target ≤ {limit} ms)  {'met' if v <= limit else 'MISSED'}")
    elapsed = time.perf_counter() - t0
    p(f"\ndone in {elapsed:.1f} s")

    result: dict[str, object] = {
        "config": {
            "seeds": n_seeds,
            "quick": quick,
            "cold_capacity_gpus": sim.cold_capacity,
            "price_per_gpu_hour": round(sim.price_per_gpu_hour, 4),
            "loads": LOADS,
            "slo_levels": list(SLO_LEVELS),
            "idle_windows_s": list(IDLE_WINDOWS),
        },
        "end_to_end": result_e2e,
        "medium_S1.0": result_e2e["medium_S1.0"],
        "ablations": {k: c.as_dict() for k, c in abl.items()},
        "idle_window": {k: c.as_dict() for k, c in sweep.items()},
        "round_ms": scale.as_dict(),
        "round_ms_repetitions": [r.as_dict() for r in reps],
        "targets": checks,
        "elapsed_s": round(elapsed, 1),
    }
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        p(f"wrote {json_path}")
    if plot_path:
        plot(e2e, abl, sweep, plot_path)
        p(f"wrote {plot_path}")
    return result


def plot(e2e: dict[str, dict[str, Cell]], abl: dict[str, Cell], sweep: dict[str, Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    loads = list(LOADS)
    for col, (xs, keys, label) in enumerate(
        [
            (loads, [f"{ld}_S1.0" for ld in loads], "load (S = 1.0)"),
            ([str(s) for s in SLO_LEVELS], [f"medium_S{s}" for s in SLO_LEVELS], "SLO emergence S (medium)"),
        ]
    ):
        for pol in POLICIES:
            axes[0][col].plot(xs, [e2e[k][pol].slo_violation_pct for k in keys], marker="o", label=pol)
            axes[1][col].plot(xs, [e2e[k][pol].cost_usd for k in keys], marker="o", label=pol)
        axes[0][col].set_title(f"SLO violation % vs {label}")
        axes[1][col].set_title(f"cost $ vs {label}")
        axes[0][col].legend()
    names = list(abl)
    axes[0][2].bar(range(len(names)), [abl[n].slo_violation_pct for n in names])
    axes[0][2].set_xticks(range(len(names)), [n.replace("without", "w/o ") for n in names], rotation=15)
    axes[0][2].set_title("Table 8: SLO violation % (medium, S = 1.0)")
    ws = list(sweep)
    ax = axes[1][2]
    ax.plot(ws, [sweep[w].slo_violation_pct for w in ws], marker="o", color="tab:red", label="violation %")
    ax.set_title("Fig. 8c: idle window")
    ax2 = ax.twinx()
    ax2.plot(ws, [sweep[w].cost_usd for w in ws], marker="s", color="tab:blue", label="cost $")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
