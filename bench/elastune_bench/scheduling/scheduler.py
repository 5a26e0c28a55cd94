"""`elastune bench scheduler`: Fig. 7, Table 8, Fig. 8c of the paper on each workload profile, the
comparison with what the paper reports, and the 1,000-GPU scale run.

Like with like: at every setting of the Fig. 7 grid our violation-point differences and cost savings
stand next to the paper's (``paper.FIG7``); the abstract's "up to" ratios are compared with the
maxima over the grid; Table 8's absolute figures with PromptTuner's at medium load, S = 1.0, on the
``calibrated`` profile (the headline; ``heavy`` is reported beside it).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from elastune_bench.sim.scheduling import paper
from elastune_bench.sim.scheduling.calibrate import ANCHORS, Measurement, measure
from elastune_bench.sim.scheduling.experiments import (
    ABLATIONS,
    IDLE_WINDOWS,
    POLICIES,
    SLO_LEVELS,
    SPEND_MECHANISMS,
    Cell,
    ScaleResult,
    ablations,
    end_to_end,
    idle_window_sweep,
    prompttuner_grid,
    scale_run,
)
from elastune_bench.sim.scheduling.simulator import SimConfig
from elastune_bench.sim.scheduling.workload import LOADS, PROFILE_NAMES, ProfileName, profile

HEADLINE: ProfileName = "calibrated"
ALL_SPEND = "withAllSpendMechanisms"
"""The Table 8 row whose configuration also runs over the whole grid (``promptTunerAllSpend``)."""
RATIO_KEYS = ("slo_vs_infless", "slo_vs_elasticflow", "cost_vs_infless", "cost_vs_elasticflow")

MEDIUM_TARGETS = {
    # The upper end of what the paper implies at medium load, S = 1.0 (paper.implied_ratios_medium:
    # 2.2–3.0× / 4.9–5.1× fewer violations, 1.30× / ≈2.4–3.0× lower cost), as issue 14 sets them.
    "slo_vs_infless": 3.0,
    "slo_vs_elasticflow": 5.1,
    "cost_vs_infless": 1.30,
    "cost_vs_elasticflow": 2.4,
}
TABLE8_TOLERANCE = 0.15
"""PromptTuner's violations and cost at medium, S = 1.0 should be within 15 % of Table 8's."""
ROUND_TARGETS_MS = {"mean": 0.5, "max": 5.0}
"""Issue 27: the round at 1,000 GPUs as fast as before co-serving joined it (0.36–0.52 ms mean)."""
SCALE_REPETITIONS = 5


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


def grid_max(grid: dict[str, dict[str, float]]) -> tuple[dict[str, float], dict[str, str]]:
    """For each ratio, its maximum over the settings of ``grid`` (setting → ratios) and where it is
    reached (the first setting in the grid's order on ties)."""
    best: dict[str, float] = {}
    at: dict[str, str] = {}
    for setting, r in grid.items():
        for k, v in r.items():
            if k not in best or v > best[k]:
                best[k], at[k] = v, setting
    return best, at


def versus_paper(setting: str, cells: dict[str, Cell]) -> dict[str, object]:
    """Our violation-point differences and cost savings at one setting next to the paper's (§6.2)."""
    pt, inf, ef = cells["promptTuner"], cells["infless"], cells["elasticflow"]
    ours = {
        "viol_points_vs_infless": round(inf.slo_violation_pct - pt.slo_violation_pct, 1),
        "viol_points_vs_elasticflow": round(ef.slo_violation_pct - pt.slo_violation_pct, 1),
        "cost_saving_vs_infless": round(1.0 - pt.cost_usd / inf.cost_usd, 3) if inf.cost_usd else 0.0,
        "cost_saving_vs_elasticflow": round(1.0 - pt.cost_usd / ef.cost_usd, 3) if ef.cost_usd else 0.0,
    }
    reported = paper.FIG7.get(setting)
    out: dict[str, object] = {"ours": ours, "paper": None}
    if reported is not None:
        out["paper"] = {k: v for k, v in asdict(reported).items() if v is not None}
    return out


def _fmt_range(r: object) -> str:
    if r is None:
        return "—"
    if isinstance(r, (list, tuple)):
        lo, hi = r
        return f"≥{lo:g}" if hi is None else f"{lo:g}–{hi:g}"
    if isinstance(r, float):
        return f"{r:.0%}"
    return str(r)


@dataclass(slots=True)
class ProfileRun:
    name: str
    e2e: dict[str, dict[str, Cell]]
    abl: dict[str, Cell]
    sweep: dict[str, Cell]
    anchors: Measurement
    json: dict[str, object]


def run_profile(name: ProfileName, seeds: list[int], sim: SimConfig, p: Callable[[str], None]) -> ProfileRun:
    prof = profile(name)
    p(f"\n=== workload profile '{name}': {prof}")
    anchors = measure(prof, seeds, sim)
    res = anchors.residuals()
    p("Anchors (seed means; the calibrated profile was fitted to these, heavy was not):")
    anchors_json: dict[str, object] = {}
    for k, (target, _, source) in ANCHORS.items():
        v = anchors.anchors[k]
        p(f"  {k:<24} {v:8.2f}   paper {target:6.1f}   residual {res[k]:+7.1%}   ({source})")
        anchors_json[k] = {"measured": round(v, 2), "paper": target, "residual": round(res[k], 3)}
    p("  beside them: " + ", ".join(f"{k} {v:.1f}" for k, v in anchors.extras.items()))

    e2e = end_to_end(prof, seeds, sim)
    p(f"\nFig. 7 ({name}) — SLO violation % / cost $ (seed mean); ratios = baseline / PromptTuner")
    p(
        f"{'setting':<13}"
        + "".join(f"{n:>20}" for n in POLICIES)
        + f"{'viol ×INF/×EF':>15}{'cost ×INF/×EF':>15}"
    )
    grid: dict[str, dict[str, float]] = {}
    e2e_json: dict[str, object] = {}
    for key, cells in e2e.items():
        r = ratios(cells)
        grid[key] = r
        row = "".join(f"{c.slo_violation_pct:>10.1f}% ${c.cost_usd:>7.2f}" for c in cells.values())
        p(
            f"{key:<13}{row}"
            f"{r['slo_vs_infless']:>8.2f}/{r['slo_vs_elasticflow']:<6.2f}"
            f"{r['cost_vs_infless']:>8.2f}/{r['cost_vs_elasticflow']:<6.2f}"
        )
        e2e_json[key] = {
            **{k: c.as_dict() for k, c in cells.items()},
            "ratios": r,
            "versus_paper": versus_paper(key, cells),
        }

    p(f"\nFig. 7 vs the paper ({name}): ours [paper, §6.2]; points = baseline % − PromptTuner %")
    p(
        f"{'setting':<13}{'viol pts vs INF':>22}{'viol pts vs EF':>22}"
        f"{'cost saving vs INF':>24}{'cost saving vs EF':>24}"
    )
    for key in e2e:
        vp = e2e_json[key]["versus_paper"]  # type: ignore[index]
        ours, rep = vp["ours"], vp["paper"] or {}
        ef_max = rep.get("cost_saving_vs_elasticflow_max")
        p(
            f"{key:<13}"
            f"{ours['viol_points_vs_infless']:>10.1f} [{_fmt_range(rep.get('viol_points_vs_infless')):>8}]"
            f"{ours['viol_points_vs_elasticflow']:>12.1f} "
            f"[{_fmt_range(rep.get('viol_points_vs_elasticflow')):>8}]"
            f"{ours['cost_saving_vs_infless']:>14.0%} [{_fmt_range(rep.get('cost_saving_vs_infless')):>6}]"
            f"{ours['cost_saving_vs_elasticflow']:>16.0%} "
            f"[{'≤' + _fmt_range(ef_max) if ef_max is not None else '—':>6}]"
        )

    spend = prompttuner_grid(prof, seeds, sim, SPEND_MECHANISMS[ALL_SPEND])
    p(f"\nPromptTuner with all spend mechanisms ({ALL_SPEND}) over the grid ({name}); same baselines")
    grid_spend: dict[str, dict[str, float]] = {}
    for key, c in spend.items():
        r = ratios({**e2e[key], "promptTuner": c})
        grid_spend[key] = r
        e2e_json[key]["promptTunerAllSpend"] = c.as_dict()  # type: ignore[index]
        e2e_json[key]["ratios_all_spend"] = r  # type: ignore[index]
        p(
            f"{key:<13}{c.slo_violation_pct:>10.1f}% ${c.cost_usd:>7.2f}"
            f"   viol ×{r['slo_vs_infless']:.2f}/×{r['slo_vs_elasticflow']:.2f}"
            f"   cost ×{r['cost_vs_infless']:.2f}/×{r['cost_vs_elasticflow']:.2f}"
        )

    gmax, gat = grid_max(grid)
    smax, sat = grid_max(grid_spend)
    p(f"\nMaxima over the 3 × 3 grid ({name}) vs the abstract's 'up to' [with all spend mechanisms]:")
    for k in RATIO_KEYS:
        up_to = paper.ABSTRACT_UP_TO[k]
        p(
            f"  {k:<22} {gmax[k]:>6.2f}× at {gat[k]:<12} (paper up to {up_to}×)  {_met(gmax[k] >= up_to):<7}"
            f"[{smax[k]:.2f}× at {sat[k]}]"
        )

    medium = e2e["medium_S1.0"]
    p(f"\nCost breakdown ({name}, medium, S = 1.0): paid GPU-seconds, busy / idle / starting-or-held")
    breakdown: dict[str, object] = {}
    for pol, c in medium.items():
        g = c.gpu_seconds
        p(
            f"  {pol:<12} {g['paid']:>8.0f} = {g['busy']:>7.0f} ({c.share('busy'):4.1f} %) / "
            f"{g['idle']:>7.0f} ({c.share('idle'):4.1f} %) / {g['starting_held']:>7.0f} "
            f"({c.share('starting_held'):4.1f} %)"
        )
        breakdown[pol] = {
            **{f"{k}_gpu_s": round(v, 1) for k, v in g.items()},
            **{f"{k}_pct": round(c.share(k), 1) for k in ("busy", "idle", "starting_held")},
        }

    abl = ablations(prof, seeds, sim)
    p(
        f"\nTable 8 ({name}, medium, S = 1.0) and the spend mechanisms — ours [paper]; ratios against the "
        "baselines' cells above"
    )
    abl_json: dict[str, object] = {}
    for row, c in abl.items():
        ref = paper.TABLE8.get(row)
        paper_txt = f"[{ref[0]:5.1f} %  ${ref[1]:5.1f}]" if ref else ""
        g = c.gpu_seconds
        r = ratios({**medium, "promptTuner": c})
        p(
            f"  {row:<26} violation {c.slo_violation_pct:5.1f} %  cost ${c.cost_usd:6.2f}  {paper_txt:<17}"
            f" idle {g['idle']:6.0f} / starting-held {g['starting_held']:6.0f} GPU-s;"
            f" ×{r['slo_vs_infless']:.2f}/×{r['slo_vs_elasticflow']:.2f} viol,"
            f" ×{r['cost_vs_infless']:.2f}/×{r['cost_vs_elasticflow']:.2f} cost"
        )
        abl_json[row] = {
            **c.as_dict(),
            "ratios": r,
            **({"paper": {"slo_violation_pct": ref[0], "cost_usd": ref[1]}} if ref else {}),
        }

    sweep = idle_window_sweep(prof, seeds, sim)
    p(f"\nFig. 8c ({name}) — idle window, medium load, S = 1.0")
    for w, c in sweep.items():
        p(f"  window {w:>5}  violation {c.slo_violation_pct:6.1f}%   cost ${c.cost_usd:7.2f}")

    body: dict[str, object] = {
        "workload": asdict(prof),
        "anchors": anchors_json,
        "anchor_extras": {k: round(v, 2) for k, v in anchors.extras.items()},
        "end_to_end": e2e_json,
        "grid_max": gmax,
        "grid_max_at": gat,
        "grid_max_all_spend": smax,
        "grid_max_all_spend_at": sat,
        "paper_up_to": dict(paper.ABSTRACT_UP_TO),
        "cost_breakdown": {"medium_S1.0": breakdown},
        "ablation": abl_json,
        "idle_window": {k: c.as_dict() for k, c in sweep.items()},
    }
    return ProfileRun(name, e2e, abl, sweep, anchors, body)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _ahead(cells: dict[str, Cell], metric: Callable[[Cell], float]) -> bool:
    """PromptTuner strictly better than every baseline on ``metric`` (lower is better)."""
    return all(metric(cells["promptTuner"]) < metric(cells[b]) for b in POLICIES[1:])


def _checks(runs: dict[str, ProfileRun], p: Callable[[str], None]) -> dict[str, dict[str, object]]:
    checks: dict[str, dict[str, object]] = {}
    head = runs.get(HEADLINE) or next(iter(runs.values()))
    p(f"\nDone-when checks ({head.name} profile unless named)")
    pt = head.e2e["medium_S1.0"]["promptTuner"]
    table8_v, table8_c = paper.TABLE8["workloadScheduler"]
    for key, value, target in (
        ("pt_violation_pct", pt.slo_violation_pct, table8_v),
        ("pt_cost_usd", pt.cost_usd, table8_c),
    ):
        rel = (value - target) / target
        ok = abs(rel) <= TABLE8_TOLERANCE
        checks[key] = {
            "measured": round(value, 2),
            "target": target,
            "tolerance": TABLE8_TOLERANCE,
            "residual": round(rel, 3),
            "met": ok,
        }
        p(f"  {key:<32} {value:>7.2f} vs Table 8 {target} ({rel:+.1%}; ±15 %)  {_met(ok)}")
    p("  (in brackets, for information: PromptTuner with all spend mechanisms)")
    r = ratios(head.e2e["medium_S1.0"])
    r_all = head.json["end_to_end"]["medium_S1.0"]["ratios_all_spend"]  # type: ignore[index]
    for k in RATIO_KEYS:
        ok = r[k] >= MEDIUM_TARGETS[k]
        checks[k] = {
            "measured": r[k],
            "target": MEDIUM_TARGETS[k],
            "setting": "medium_S1.0",
            "met": ok,
            "with_all_spend_mechanisms": r_all[k],
        }
        p(
            f"  {k + ' (medium, S = 1.0)':<32} {r[k]:>6.2f}× (≥ {MEDIUM_TARGETS[k]}×)  {_met(ok):<7}"
            f"[{r_all[k]:.2f}×]"
        )
    gmax, gat = head.json["grid_max"], head.json["grid_max_at"]
    smax = head.json["grid_max_all_spend"]
    for k in RATIO_KEYS:
        v = gmax[k]  # type: ignore[index]
        ok = v >= paper.ABSTRACT_UP_TO[k]
        checks[f"grid_max_{k}"] = {
            "measured": v,
            "at": gat[k],  # type: ignore[index]
            "target": paper.ABSTRACT_UP_TO[k],
            "met": ok,
            "with_all_spend_mechanisms": smax[k],  # type: ignore[index]
        }
        p(
            f"  {'grid max ' + k:<32} {v:>6.2f}× (≥ {paper.ABSTRACT_UP_TO[k]}×, up to)  {_met(ok):<7}"
            f"[{smax[k]:.2f}×]"  # type: ignore[index]
        )
    if "heavy" in runs:
        e2e = runs["heavy"].e2e
        viol = [k for k, c in e2e.items() if _ahead(c, lambda x: x.slo_violation_pct)]
        cost = [k for k, c in e2e.items() if _ahead(c, lambda x: x.cost_usd)]
        ok = len(viol) == len(cost) == len(e2e)
        checks["heavy_ahead_at_every_setting"] = {
            "fewer_violations_at": len(viol),
            "lower_cost_at": len(cost),
            "settings": len(e2e),
            "met": ok,
        }
        p(
            f"  {'heavy: ahead at every setting':<32} fewer violations at {len(viol)}/{len(e2e)}, "
            f"lower cost at {len(cost)}/{len(e2e)}  {_met(ok)}"
        )
    return checks


def run(
    quick: bool,
    json_path: Path | None,
    plot_path: Path | None,
    seeds: int | None,
    out: TextIO = sys.stdout,
    profiles: Sequence[ProfileName] = PROFILE_NAMES,
) -> dict[str, object]:
    n_seeds = seeds or (2 if quick else 5)
    seed_list = list(range(n_seeds))
    sim = SimConfig(max_seconds=2 * 3600.0)
    t0 = time.perf_counter()
    p = lambda s: print(s, file=out, flush=True)  # noqa: E731
    p(
        f"elastune bench scheduler — {n_seeds} seeds per cell, 3 LLMs, cold pool {sim.cold_capacity} GPUs, "
        f"profiles: {', '.join(profiles)}"
    )
    runs = {name: run_profile(name, seed_list, sim, p) for name in profiles}

    # Wall-clock round times are sensitive to other load on the machine: five repetitions, and the
    # one with the median worst round is reported (all are in the JSON). Each starts from a collected
    # heap with what the profile runs left alive frozen (gc.freeze), so a round is never the one that
    # pays for collecting or scanning the simulations before it; collections of the scale run's own
    # objects still land in its rounds, as they would in the operator.
    reps = sorted((_scale_rep(60.0 if quick else 120.0) for _ in range(SCALE_REPETITIONS)), key=_worst)
    scale = reps[len(reps) // 2]
    p(
        f"\nScale — {scale.gpus} GPUs, ≥{scale.min_pending} pending jobs, {scale.llms} LLMs, "
        f"{scale.rounds} rounds: round mean {scale.round_ms_mean:.3f} ms, max {scale.round_ms_max:.3f} ms, "
        f"p99 {scale.round_ms_p99:.3f} ms ({scale.recomputed_rounds} recomputed, "
        f"mean {scale.recomputed_ms_mean:.3f} ms); max of the {len(reps)} repetitions: "
        f"{', '.join(f'{r.round_ms_max:.2f}' for r in reps)} ms; paper: 13 / 67 ms at 96 GPUs"
    )

    checks = _checks(runs, p)
    for k, limit in ROUND_TARGETS_MS.items():
        v = scale.round_ms_mean if k == "mean" else scale.round_ms_max
        checks[f"round_ms_{k}"] = {"measured": round(v, 4), "target": limit, "met": v <= limit}
        p(f"  {'round ' + k:<32} {v:>7.3f} ms (≤ {limit} ms)  {_met(v <= limit)}")
    elapsed = time.perf_counter() - t0
    p(f"\ndone in {elapsed:.1f} s")

    head = runs.get(HEADLINE) or next(iter(runs.values()))
    e2e_json = head.json["end_to_end"]
    abl_json = head.json["ablation"]
    result: dict[str, object] = {
        "config": {
            "seeds": n_seeds,
            "quick": quick,
            "cold_capacity_gpus": sim.cold_capacity,
            "price_per_gpu_hour": round(sim.price_per_gpu_hour, 4),
            "loads": LOADS,
            "slo_levels": list(SLO_LEVELS),
            "idle_windows_s": list(IDLE_WINDOWS),
            "profiles": list(profiles),
            "headline_profile": head.name,
            "spend_mechanisms": list(SPEND_MECHANISMS),
        },
        # The top-level figures are the headline profile's (see config.headline_profile).
        "end_to_end": e2e_json,
        "medium_S1.0": e2e_json["medium_S1.0"],  # type: ignore[index]
        "ablations": {k: v for k, v in abl_json.items() if k in ABLATIONS},  # type: ignore[union-attr]
        "ablation": abl_json,
        "idle_window": head.json["idle_window"],
        "profiles": {name: r.json for name, r in runs.items()},
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
        plot(runs, head.name, plot_path)
        p(f"wrote {plot_path}")
    return result


def _scale_rep(seconds: float) -> ScaleResult:
    gc.collect()
    gc.freeze()
    try:
        return scale_run(seconds=seconds)
    finally:
        gc.unfreeze()


def _worst(s: ScaleResult) -> float:
    return s.round_ms_max


def plot(runs: dict[str, ProfileRun], headline: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    loads = list(LOADS)
    for name, run_ in runs.items():
        style = "-" if name == headline else "--"
        for col, (xs, keys, label) in enumerate(
            [
                (loads, [f"{ld}_S1.0" for ld in loads], "load (S = 1.0)"),
                ([str(s) for s in SLO_LEVELS], [f"medium_S{s}" for s in SLO_LEVELS], "S (medium)"),
            ]
        ):
            for i, pol in enumerate(POLICIES):
                kw = {"marker": "o", "linestyle": style, "color": f"C{i}", "label": f"{pol} ({name})"}
                axes[0][col].plot(xs, [run_.e2e[k][pol].slo_violation_pct for k in keys], **kw)
                axes[1][col].plot(xs, [run_.e2e[k][pol].cost_usd for k in keys], **kw)
            axes[0][col].set_title(f"SLO violation % vs {label}")
            axes[1][col].set_title(f"cost $ vs {label}")
    axes[0][0].legend(fontsize=7)
    head = runs[headline]
    names = list(head.abl)
    axes[0][2].bar(range(len(names)), [head.abl[n].slo_violation_pct for n in names], color="tab:red")
    ax = axes[0][2].twinx()
    ax.plot(range(len(names)), [head.abl[n].cost_usd for n in names], "s", color="tab:blue")
    labels = [n.replace("without", "w/o ").replace("with", "+") for n in names]
    axes[0][2].set_xticks(range(len(names)), labels, rotation=60, fontsize=7)
    axes[0][2].set_title(f"Table 8 + spend ({headline}): violation % bars, cost $ squares", fontsize=9)
    ws = list(head.sweep)
    ax = axes[1][2]
    viol = [head.sweep[w].slo_violation_pct for w in ws]
    ax.plot(ws, viol, marker="o", color="tab:red", label="violation %")
    ax.set_title(f"Fig. 8c: idle window ({headline})")
    ax2 = ax.twinx()
    ax2.plot(ws, [head.sweep[w].cost_usd for w in ws], marker="s", color="tab:blue", label="cost $")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="elastune bench scheduler",
        description="Fig. 7, Table 8 and Fig. 8c of the paper on each workload profile, and the scale run",
    )
    p.add_argument("--quick", action="store_true", help="fewer seeds, shorter scale run (< 60 s)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.add_argument("--seeds", type=int, help="seeds per cell (default 5, --quick 2)")
    p.add_argument(
        "--profile",
        choices=[*PROFILE_NAMES, "all"],
        default="all",
        help="workload profile(s) to run (default all: calibrated, the headline, and heavy)",
    )
    args = p.parse_args(argv)
    run(
        args.quick,
        Path(args.json) if args.json else None,
        Path(args.plot) if args.plot else None,
        args.seeds,
        profiles=PROFILE_NAMES if args.profile == "all" else (args.profile,),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
