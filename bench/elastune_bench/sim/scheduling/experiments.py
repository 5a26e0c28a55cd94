"""The scheduler experiments of the paper (§6.2, §6.3: Fig. 7, Table 8, Fig. 8c) and a scale run.

Every figure is measured in the run that reports it: all policies see the same seeded traces and the
same physics; results are averaged over seeds. Each experiment runs on a named workload profile
(``workload.PROFILES``: ``calibrated`` fitted to the paper's absolute figures, ``heavy`` the earlier
workload with about twice the GPU time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from elastune_operator.scheduling.estimator import Estimator, LLMProfile
from elastune_operator.scheduling.factory import PolicyConfig, make_policy
from elastune_operator.scheduling.policy import PolicyName, PoolLimits
from elastune_operator.scheduling.prompttuner import PromptTunerConfig, PromptTunerPolicy
from elastune_operator.scheduling.state import ClusterState, Job, RoundDecision

from . import paper
from .simulator import SimConfig, SimResult, Simulator
from .workload import LOADS, SimLLM, WorkloadConfig, WorkloadProfile, generate

POLICIES: tuple[PolicyName, ...] = ("promptTuner", "infless", "elasticflow")
SLO_LEVELS = (0.5, 1.0, 1.5)
ABLATIONS: dict[str, PromptTunerConfig] = {
    "workloadScheduler": PromptTunerConfig(),
    "withoutWarmAllocator": PromptTunerConfig(warm_allocator=False),
    "withoutDelaySchedulable": PromptTunerConfig(delay_schedulable=False),
    "withoutLatencyBudget": PromptTunerConfig(latency_budget=False),
}
"""Table 8's columns."""
SPEND_MECHANISMS: dict[str, PromptTunerConfig] = {
    "withIdleWindowColdStart": PromptTunerConfig(idle_window_mode="cold_start"),
    "withBankMinSpeedupSizing": PromptTunerConfig(bank_sizing_speedup=paper.BANK_MIN_SPEEDUP),
    "withEarlyRelease": PromptTunerConfig(early_release=True),
    "withAllSpendMechanisms": PromptTunerConfig(
        idle_window_mode="cold_start", bank_sizing_speedup=paper.BANK_MIN_SPEEDUP, early_release=True
    ),
}
"""Rows added to Table 8: each mechanism against idle and starting spend alone, then all together."""
IDLE_WINDOWS = (10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class Cell:
    """Seed-averaged results of one policy on one setting."""

    slo_violation_pct: float
    cost_usd: float
    utilization_pct: float
    runs: list[dict[str, float | int | str]] = field(default_factory=list)
    gpu_seconds: dict[str, float] = field(default_factory=dict)
    """Seed means of paid GPU-seconds split into busy / idle / starting_held (and their sum, paid)."""
    allocated_pct: float = 0.0
    init_wait_pct: float = 0.0
    dropped_pct: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "slo_violation_pct": round(self.slo_violation_pct, 2),
            "cost_usd": round(self.cost_usd, 2),
            "utilization_pct": round(self.utilization_pct, 1),
            "allocated_pct": round(self.allocated_pct, 1),
            "init_wait_pct": round(self.init_wait_pct, 1),
            "dropped_pct": round(self.dropped_pct, 1),
            "gpu_seconds": {k: round(v, 1) for k, v in self.gpu_seconds.items()},
            "seeds": len(self.runs),
        }

    def share(self, part: str) -> float:
        """Percent of paid GPU-seconds that were ``busy``, ``idle`` or ``starting_held``."""
        paid = self.gpu_seconds.get("paid", 0.0)
        return 100.0 * self.gpu_seconds.get(part, 0.0) / paid if paid else 0.0


def run_one(
    policy: PolicyName,
    workload: WorkloadConfig,
    sim: SimConfig,
    config: PolicyConfig | None = None,
) -> SimResult:
    jobs = generate(workload)
    estimator = Estimator([llm.profile for llm in workload.llms.values()])
    return Simulator(workload.llms, jobs, make_policy(policy, estimator, config), sim).run()


def run_cell(
    policy: PolicyName,
    workload: WorkloadConfig,
    sim: SimConfig,
    seeds: list[int],
    config: PolicyConfig | None = None,
) -> Cell:
    """One policy on one setting, averaged over seeds (policies never mutate their config)."""
    results = [run_one(policy, replace(workload, seed=s), replace(sim, seed=s), config) for s in seeds]

    def mean(values: list[float]) -> float:
        return float(np.mean(values))

    return Cell(
        slo_violation_pct=mean([r.slo_violation_pct for r in results]),
        cost_usd=mean([r.cost_usd for r in results]),
        utilization_pct=mean([r.utilization_pct for r in results]),
        runs=[r.summary() for r in results],
        gpu_seconds={
            "busy": mean([r.busy_gpu_seconds for r in results]),
            "idle": mean([r.idle_gpu_seconds for r in results]),
            "starting_held": mean([r.starting_held_gpu_seconds for r in results]),
            "paid": mean([r.paid_gpu_seconds for r in results]),
        },
        allocated_pct=mean([r.allocated_pct for r in results]),
        init_wait_pct=mean([r.init_wait_pct for r in results]),
        dropped_pct=mean([100.0 * r.dropped / r.jobs if r.jobs else 0.0 for r in results]),
    )


def end_to_end(
    profile: WorkloadProfile,
    seeds: list[int],
    sim: SimConfig,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[str, Cell]]:
    """Fig. 7: every policy at low/medium/high load × S ∈ {0.5, 1.0, 1.5}."""
    out: dict[str, dict[str, Cell]] = {}
    for load in LOADS:
        for s in SLO_LEVELS:
            key = f"{load}_S{s}"
            wl = profile.config(load, s)
            out[key] = {p: run_cell(p, wl, sim, seeds) for p in POLICIES}
            progress(key)
    return out


def prompttuner_grid(
    profile: WorkloadProfile, seeds: list[int], sim: SimConfig, config: PromptTunerConfig
) -> dict[str, Cell]:
    """PromptTuner with ``config`` over the Fig. 7 grid (the same traces as ``end_to_end``)."""
    return {
        f"{load}_S{s}": run_cell("promptTuner", profile.config(load, s), sim, seeds, config)
        for load in LOADS
        for s in SLO_LEVELS
    }


def ablations(
    profile: WorkloadProfile,
    seeds: list[int],
    sim: SimConfig,
    configs: dict[str, PromptTunerConfig] | None = None,
) -> dict[str, Cell]:
    """Table 8 at medium load, S = 1.0 (its columns, then the spend mechanisms)."""
    wl = profile.config("medium", 1.0)
    rows = configs if configs is not None else {**ABLATIONS, **SPEND_MECHANISMS}
    return {name: run_cell("promptTuner", wl, sim, seeds, cfg) for name, cfg in rows.items()}


def idle_window_sweep(profile: WorkloadProfile, seeds: list[int], sim: SimConfig) -> dict[str, Cell]:
    """Fig. 8c at medium load, S = 1.0."""
    wl = profile.config("medium", 1.0)
    return {
        f"{w:g}s": run_cell("promptTuner", wl, sim, seeds, PromptTunerConfig(idle_window_seconds=w))
        for w in IDLE_WINDOWS
    }


# -- scale ------------------------------------------------------------------------------------------
def scale_llms(count: int = 6) -> dict[str, SimLLM]:
    """``count`` LLMs of growing size (per-iteration time and T_cold), for the scale run."""
    out = {}
    for i in range(count):
        p = LLMProfile(
            f"llm-{i}", 0.1 * (1 + i), 20.0 + 8.0 * i, bank_lookup_seconds=5.0 + i, max_gpus_per_job=32
        )
        out[p.name] = SimLLM(p)
    return out


@dataclass(slots=True)
class ScaleResult:
    gpus: int
    llms: int
    jobs: int
    min_pending: int
    rounds: int
    round_ms_mean: float
    round_ms_max: float
    round_ms_p99: float
    recomputed_rounds: int
    recomputed_ms_mean: float
    wall_seconds: float

    def as_dict(self) -> dict[str, object]:
        return {
            "gpus": self.gpus,
            "llms": self.llms,
            "jobs": self.jobs,
            "min_pending_jobs": self.min_pending,
            "rounds": self.rounds,
            "mean": round(self.round_ms_mean, 4),
            "max": round(self.round_ms_max, 3),
            "p99": round(self.round_ms_p99, 3),
            "recomputed_rounds": self.recomputed_rounds,
            "recomputed_mean": round(self.recomputed_ms_mean, 3),
            "wall_seconds": round(self.wall_seconds, 1),
        }


def scale_run(
    gpus: int = 1000, pending: int = 1000, llms: int = 6, seconds: float = 120.0, seed: int = 0
) -> ScaleResult:
    """Round time of PromptTuner with ``gpus`` GPUs busy and at least ``pending`` jobs queued.

    A backlog of long jobs fills the 1,000-GPU cold pool first; then a steady stream keeps well over
    ``pending`` jobs waiting while jobs keep finishing and GPUs keep being handed out. Only rounds
    with the pool full and the queue at least ``pending`` deep are measured.
    """
    wl = WorkloadConfig(
        llms=scale_llms(llms),
        jobs_per_llm={},
        slo_emergence=1.5,
        duration_median_seconds=60.0,
        seed=seed,
    )
    per_llm = math.ceil((gpus * 1.0 + pending * 2.0) / llms)
    wl.jobs_per_llm = {name: per_llm for name in wl.llms}
    wl.minutes = max(1, math.ceil(seconds / 60))
    jobs = generate(wl)
    for j in jobs:  # the backlog: everything arrives within the first minutes
        j.arrival = j.arrival / 4
    estimator = Estimator([llm.profile for llm in wl.llms.values()])
    timed = _TimedRounds(PromptTunerPolicy(estimator), gpus, pending)
    sim = Simulator(wl.llms, jobs, timed, SimConfig(cold_capacity=gpus, seed=seed, max_seconds=seconds))
    t0 = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - t0
    measured, recomputed = timed.measured, timed.recomputed
    arr = np.asarray(measured) if measured else np.zeros(1)
    return ScaleResult(
        gpus=gpus,
        llms=llms,
        jobs=len(jobs),
        min_pending=timed.min_pending if measured else 0,
        rounds=len(measured),
        round_ms_mean=float(arr.mean()),
        round_ms_max=float(arr.max()),
        round_ms_p99=float(np.percentile(arr, 99)),
        recomputed_rounds=len(recomputed),
        recomputed_ms_mean=float(np.mean(recomputed)) if recomputed else 0.0,
        wall_seconds=wall,
    )


class _TimedRounds:
    """PromptTuner's policy with each round timed once the cluster is full and the backlog deep."""

    def __init__(self, policy: PromptTunerPolicy, gpus: int, pending: int) -> None:
        self.policy = policy
        self.name, self.estimator = policy.name, policy.estimator
        self.keep_warm, self.billing = policy.keep_warm, policy.billing
        self.measured: list[float] = []
        self.recomputed: list[float] = []
        self.min_pending = 1 << 30
        self._gpus, self._pending = gpus, pending

    def set_pool_limits(self, llm: str, limits: PoolLimits) -> None:
        self.policy.set_pool_limits(llm, limits)

    def bank_budget_seconds(self, slo_seconds: float) -> float:
        return self.policy.bank_budget_seconds(slo_seconds)

    def admit(self, state: ClusterState, job: Job, now: float) -> None:
        self.policy.admit(state, job, now)

    def round(self, state: ClusterState, now: float) -> RoundDecision:
        misses = self.policy.round_cache.misses
        t0 = time.perf_counter()
        d = self.policy.round(state, now)
        dt = (time.perf_counter() - t0) * 1000.0
        n_pending = sum(len(p) for p in state.pending.values())
        if len(state.gpus) >= self._gpus and n_pending >= self._pending:
            self.measured.append(dt)
            self.min_pending = min(self.min_pending, n_pending)
            if self.policy.round_cache.misses != misses:
                self.recomputed.append(dt)
        return d
