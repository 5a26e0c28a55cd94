"""Fit the ``calibrated`` workload profile to the paper's absolute figures (`elastune calibrate`).

Anchors (``paper.py``):

* PromptTuner at medium load, S = 1.0: 12.4 % SLO violations and $22.9 (Table 8);
* ElasticFlow's GPU cluster utilisation ≈ 56 % (Fig. 3a);
* INFless: instance initialisation ≈ 11 % of an LPT job's end-to-end latency on average (Fig. 3b).

Fig. 3 was measured on Vicuna-7B jobs only ("the first 20 minutes of the trace in Figure 2(b)", §3,
with the §6.1 setup): we run those two anchors on a Vicuna-7B-only trace with the medium load's
Vicuna count (65 jobs; the paper does not say how many the first 20 minutes held), S = 1.0, 32 GPUs.
ElasticFlow's utilisation counts GPUs allocated to jobs, initialising ones included (a training
scheduler's view; the paper's "almost doubling the GPU cluster's cost" reads the other 44 % as
unallocated); busy-only utilisation is reported beside it.

Burstiness is not fitted: §2.2's "maximum number of requests per minute being 5× the mean" pins it
(``BURSTINESS``). The search over six parameters is small and deterministic: 60 points of a coarse
grid (``SPACE``) drawn with a fixed seed and measured on 2 seeds, then coordinate descent on the
bench's 5 seeds from the best of them (each sweep tries every grid value of one parameter with the
others fixed and keeps the best; it stops when a sweep changes nothing). It minimises the sum of
squared relative residuals, each over its anchor's tolerance (``ANCHORS``). The chosen parameters are
committed as ``workload.CALIBRATED``; rerunning the fit reproduces them (about 3 minutes here).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from . import paper
from .experiments import run_one
from .simulator import SimConfig, SimResult
from .workload import HEAVY, LOADS, WorkloadConfig, WorkloadProfile

ANCHORS: dict[str, tuple[float, float, str]] = {
    # name: (paper's value, relative tolerance, source)
    "pt_violation_pct": (paper.TABLE8["workloadScheduler"][0], 0.10, "Table 8: PromptTuner, medium, S = 1.0"),
    "pt_cost_usd": (paper.TABLE8["workloadScheduler"][1], 0.10, "Table 8: PromptTuner, medium, S = 1.0"),
    "ef_utilization_pct": (paper.ELASTICFLOW_UTILIZATION_PCT, 0.20, "Fig. 3a: ElasticFlow, Vicuna-7B trace"),
    "infless_init_wait_pct": (paper.INFLESS_INIT_WAIT_PCT, 0.40, "Fig. 3b: INFless, Vicuna-7B trace"),
}
"""Each anchor's weight in the loss is 1 / tolerance². Table 8's figures are stated for the very
setting the benchmark compares (10 %). Fig. 3's are averages over another trace whose length we
guess, ElasticFlow's under our reading of "utilisation" (20 %). INFless's initialisation share is
set mostly by how often INFless-like's autoscaler meets a job with cold instances, which the workload
moves little and only one way: over 250 random points of the grid (2 seeds) it spans 9–33 % (median
20 %) and falls to ≤ 13 % only with 60–80 s median jobs, where PromptTuner costs $27–44 at ≤ 7 %
violations and ElasticFlow's utilisation is ≥ 75 % — the other three anchors all missed. Weighted as
the others (20 %), the fit settles at PromptTuner $29.1 (+27 %) with INFless still at 19 % (+74 %);
at 40 % it keeps Table 8 and reports the INFless residual (README, "Calibration")."""

FIG3_JOBS = {"vicuna-7b": LOADS["medium"]["vicuna-7b"]}
"""The §3 characterisation trace: Vicuna-7B jobs only (the medium load's count)."""

SAMPLES = 60
SAMPLE_SEEDS = (0, 1)
SAMPLE_RNG_SEED = 14
FIT_SEEDS = (0, 1, 2, 3, 4)
"""The bench's seeds: the residuals the fit prints are the ones the bench measures."""
HELDOUT_SEEDS = (5, 6, 7, 8, 9)

BURSTINESS = 1.5
"""Not fitted but derived: §2.2 reports "the maximum number of requests per minute being 5× the mean"
over the two-hour Vicuna-7B trace of Fig. 2(b). At the medium load's Vicuna rate (65 jobs per 20
minutes, 390 in two hours) gamma minute weights of shape 1.5 give a max/mean of 4.9× (mean of 200
draws; shape 0.7, the heavy profile's, gives 7.3×; 1.0 gives 6.1×; 2.0 gives 4.5×)."""

SPACE: dict[str, tuple[float, ...]] = {
    "duration_median_seconds": (15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 60.0),
    "duration_sigma": (0.5, 0.75, 1.0, 1.25),
    "gpu_decay": (0.1, 0.2, 0.3, 0.4, 0.55),
    "cold_start_scale": (0.5, 0.6, 0.7, 0.85, 1.0),
    "slo_overhead_factor": (0.5, 0.6, 0.75, 0.9, 1.0),
    "bank_median": (1.5, 1.8, 2.2, 2.6, 3.0, 3.5),
}
"""The grid. gpu_decay r: P(1, 2, 4, 8 GPUs) ∝ (1, r, r², r³). cold_start_scale multiplies T_cold
20 / 30 / 50 s; its range keeps Vicuna-7B's T_cold within "tens of seconds" to "close to a minute"
(§1, §3.2). bank_median: the lognormal speedup's median (sigma 0.35), clipped to the paper's 1.2–4.7×
(§4.4.3)."""

START: dict[str, float] = {
    "duration_median_seconds": 30.0,
    "duration_sigma": 1.0,
    "gpu_decay": 0.55,
    "cold_start_scale": 1.0,
    "slo_overhead_factor": 1.0,
    "bank_median": 1.8,
}
"""The grid point nearest the heavy profile."""


FITTED: dict[str, float] = {
    "duration_median_seconds": 15.0,
    "duration_sigma": 1.0,
    "gpu_decay": 0.1,
    "cold_start_scale": 0.7,
    "slo_overhead_factor": 0.6,
    "bank_median": 1.5,
}
"""The point the fit chose (`elastune calibrate`, loss 11.16 on seeds 0–4): workload.CALIBRATED."""


def gpu_weights(decay: float) -> tuple[float, float, float, float]:
    w = [decay**i for i in range(4)]
    total = sum(w)
    a, b, c, d = (round(x / total, 3) for x in w)
    return (a, b, c, d)


def profile_from(point: dict[str, float]) -> WorkloadProfile:
    return WorkloadProfile(
        duration_median_seconds=point["duration_median_seconds"],
        duration_sigma=point["duration_sigma"],
        gpu_weights=gpu_weights(point["gpu_decay"]),
        burstiness=point.get("burstiness", BURSTINESS),
        cold_start_scale=point["cold_start_scale"],
        slo_overhead_factor=point["slo_overhead_factor"],
        bank_speedup=(point["bank_median"], 0.35, paper.BANK_MIN_SPEEDUP, 4.7),
    )


def fig3_workload(profile: WorkloadProfile, seed: int) -> WorkloadConfig:
    return replace(profile.config("medium", 1.0, seed), jobs_per_llm=dict(FIG3_JOBS))


@dataclass(slots=True)
class Measurement:
    anchors: dict[str, float]
    """Seed means of the four anchored quantities."""
    extras: dict[str, float]
    """Reported beside them, not fitted."""

    def residuals(self) -> dict[str, float]:
        """(measured − paper) / paper per anchor."""
        return {k: (self.anchors[k] - target) / target for k, (target, _, _) in ANCHORS.items()}

    def loss(self) -> float:
        """Sum of (residual / tolerance)² over the anchors."""
        res = self.residuals()
        return sum((res[k] / tol) ** 2 for k, (_, tol, _) in ANCHORS.items())


def measure(profile: WorkloadProfile, seeds: Sequence[int], sim: SimConfig | None = None) -> Measurement:
    base = sim or SimConfig(max_seconds=2 * 3600.0)
    pt: list[SimResult] = []
    inf: list[SimResult] = []
    ef: list[SimResult] = []
    for s in seeds:
        cfg = replace(base, seed=s)
        pt.append(run_one("promptTuner", profile.config("medium", 1.0, s), cfg))
        inf.append(run_one("infless", fig3_workload(profile, s), cfg))
        ef.append(run_one("elasticflow", fig3_workload(profile, s), cfg))

    def mean(rs: list[SimResult], f: Callable[[SimResult], float]) -> float:
        return float(np.mean([f(r) for r in rs]))

    anchors = {
        "pt_violation_pct": mean(pt, lambda r: r.slo_violation_pct),
        "pt_cost_usd": mean(pt, lambda r: r.cost_usd),
        "ef_utilization_pct": mean(ef, lambda r: r.allocated_pct),
        "infless_init_wait_pct": mean(inf, lambda r: r.init_wait_pct),
    }
    extras = {
        "ef_busy_utilization_pct": mean(ef, lambda r: r.utilization_pct),
        "ef_dropped_pct": mean(ef, lambda r: 100.0 * r.dropped / r.jobs),
        "infless_init_wait_max_pct": mean(inf, lambda r: 100.0 * max(r.init_wait_fractions, default=0.0)),
        "pt_busy_pct_of_paid": mean(pt, lambda r: 100.0 * r.busy_gpu_seconds / r.paid_gpu_seconds),
        "pt_idle_pct_of_paid": mean(pt, lambda r: 100.0 * r.idle_gpu_seconds / r.paid_gpu_seconds),
        "pt_starting_held_pct_of_paid": mean(
            pt, lambda r: 100.0 * r.starting_held_gpu_seconds / r.paid_gpu_seconds
        ),
    }
    return Measurement(anchors, extras)


@dataclass(slots=True)
class FitResult:
    point: dict[str, float]
    measurement: Measurement
    evaluations: int
    sweeps: int


def fit(
    seeds: Sequence[int] = FIT_SEEDS,
    space: dict[str, tuple[float, ...]] | None = None,
    start: dict[str, float] | None = None,
    samples: int = SAMPLES,
    max_sweeps: int = 5,
    progress: Callable[[str], None] = lambda _: None,
) -> FitResult:
    """Two deterministic stages: ``samples`` grid points drawn with a fixed seed and measured on
    ``SAMPLE_SEEDS`` (a coarse look at the whole grid), then coordinate descent on ``seeds`` from the
    best of them (or from ``start`` when it measures better)."""
    space = space or SPACE
    cache: dict[tuple[float, ...], Measurement] = {}

    def evaluate(p: dict[str, float]) -> Measurement:
        key = tuple(p[k] for k in space)
        if key not in cache:
            cache[key] = measure(profile_from(p), seeds)
        return cache[key]

    rng = random.Random(SAMPLE_RNG_SEED)
    candidates = [dict(start or START)]
    candidates += [{k: rng.choice(v) for k, v in space.items()} for _ in range(samples)]
    coarse = sorted(candidates, key=lambda p: measure(profile_from(p), SAMPLE_SEEDS).loss())
    progress(f"stage 1: {samples} sampled points on seeds {list(SAMPLE_SEEDS)}; best {coarse[0]}")
    point = coarse[0]
    best = evaluate(point)
    sweeps = 0
    for sweeps in range(1, max_sweeps + 1):
        changed = False
        for name, values in space.items():
            for v in values:
                if v == point[name]:
                    continue
                trial = {**point, name: v}
                m = evaluate(trial)
                if m.loss() < best.loss() - 1e-12:
                    point, best, changed = trial, m, True
            progress(f"sweep {sweeps} {name:<24} = {point[name]:<6g} loss {best.loss():.4f}")
        if not changed:
            break
    return FitResult(point, best, samples + len(cache), sweeps)


def report(m: Measurement, out: Callable[[str], None]) -> None:
    res = m.residuals()
    for k, (target, _, source) in ANCHORS.items():
        out(
            f"  {k:<24} measured {m.anchors[k]:8.2f}   paper {target:6.1f}   "
            f"residual {res[k]:+7.1%}   ({source})"
        )
    for k, v in m.extras.items():
        out(f"  {k:<30} {v:8.2f}")


HELP = "fit the calibrated workload profile to the paper's figures; print residuals"


def build_parser() -> argparse.ArgumentParser:
    """`elastune calibrate` (the ``elastune.commands`` entry point ``calibrate`` names ``main``)."""
    ap = argparse.ArgumentParser(prog="elastune calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweeps", type=int, default=5, help="coordinate-descent sweeps at most (default 5)")
    ap.add_argument("--check", action="store_true", help="only measure the committed profiles")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .workload import CALIBRATED

    out = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    if not args.check:
        out(f"fitting {len(SPACE)} parameters on seeds {list(FIT_SEEDS)} (grid: {SPACE})")
        result = fit(max_sweeps=args.sweeps, progress=out)
        out(f"\nbest after {result.sweeps} sweeps, {result.evaluations} evaluations: {result.point}")
        out(f"as a profile: {profile_from(result.point)}")
        if profile_from(result.point) != CALIBRATED:
            out("NOTE: differs from the committed workload.CALIBRATED (calibrate.FITTED)")
    for name, prof in (("calibrated", CALIBRATED), ("heavy", HEAVY)):
        for label, seeds in (("fit seeds", FIT_SEEDS), ("held-out seeds", HELDOUT_SEEDS)):
            m = measure(prof, seeds)
            out(f"\n{name} profile, {label} {list(seeds)}: loss {m.loss():.4f}")
            report(m, out)
    out(f"\ndone in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
