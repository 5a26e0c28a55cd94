"""Shared builders for the scheduling and simulator tests.

The default profile makes the arithmetic trivial: 1 s per iteration on one GPU, perfect scaling, no
allocation overhead, no Prompt Bank lookup and a 10 s cold start, so T_warm(a) = iterations / a and
T_cold = 10 s.
"""

from __future__ import annotations

from collections.abc import Iterable

from elastune_operator.scheduling.estimator import Estimator, LLMProfile
from elastune_operator.scheduling.state import ClusterState, GPUState, Job, RoundDecision

LLM = "m"


def make_profile(name: str = LLM, **overrides: float) -> LLMProfile:
    values: dict[str, float] = {
        "iteration_seconds": 1.0,
        "cold_start_seconds": 10.0,
        "warm_overhead_seconds": 0.0,
        "comm_fraction": 0.0,
        "bank_lookup_seconds": 0.0,
        "max_gpus_per_job": 8,
    }
    values.update(overrides)
    values["max_gpus_per_job"] = int(values["max_gpus_per_job"])
    return LLMProfile(name, **values)  # type: ignore[arg-type]


def make_estimator(*profiles: LLMProfile, ewma_alpha: float = 0.3, **overrides: float) -> Estimator:
    """An estimator over ``profiles``, or over one simple profile named ``m`` (with ``overrides``)."""
    return Estimator(list(profiles) or [make_profile(**overrides)], ewma_alpha=ewma_alpha)


def make_jobs(*specs: tuple[str, float, float, int], llm: str = LLM) -> list[Job]:
    """Jobs from (id, arrival, slo, iterations) tuples; deadline = arrival + slo."""
    return [Job(jid, llm, arrival, slo, iterations) for jid, arrival, slo, iterations in specs]


def make_gpus_warm(state: ClusterState, llm: str, n: int, at: float = 0.0) -> list[int]:
    """Take n GPUs from the cold pool into ``llm``'s warm pool, idle since ``at``."""
    ids = []
    for _ in range(n):
        gpu = state.launch(llm, at)
        state.gpu_ready(gpu.id, at)
        ids.append(gpu.id)
    return ids


def make_state(
    capacity: int = 16,
    llms: Iterable[str] = (LLM,),
    jobs: Iterable[Job] = (),
    idle: dict[str, int] | None = None,
    idle_since: float = 0.0,
) -> ClusterState:
    """A cluster with ``idle[llm]`` idle warm GPUs per LLM since ``idle_since``, and ``jobs`` pending."""
    state = ClusterState(capacity, list(llms))
    for llm, n in (idle or {}).items():
        make_gpus_warm(state, llm, n, idle_since)
    for job in jobs:
        state.submit(job)
    return state


def make_running(
    state: ClusterState, job: Job, gpus: int, started: float, predicted_finish: float
) -> list[int]:
    """Submit ``job`` and run it on ``gpus`` fresh warm GPUs since ``started``."""
    state.submit(job)
    ids = make_gpus_warm(state, job.llm, gpus, started)
    state.assign(job.id, ids)
    state.start(job.id, started, predicted_finish)
    return ids


def apply(state: ClusterState, decision: RoundDecision, now: float, keep_warm: bool = True) -> None:
    """Apply a decision the way Simulator._apply does (without the physics: launched GPUs stay STARTING)."""
    for jid, n in decision.restarts:
        job = state.jobs[jid]
        state.preempt(jid, job.done_iterations, now, keep_warm=keep_warm)
        for _ in range(n):
            state.launch(job.llm, now, job=jid, target=n)
    for alloc in decision.allocations:
        state.assign(alloc.job, alloc.gpus, alloc.target)
    for gid in decision.releases:  # before launches: released GPUs refill the cold pool
        gpu = state.gpus.get(gid)
        if gpu is not None and gpu.state is GPUState.IDLE:
            state.release(gid)
    for launch in decision.launches:
        for _ in range(launch.count):
            state.launch(launch.llm, now, job=launch.job, target=launch.count)


def allocation_map(decision: RoundDecision) -> dict[str, int]:
    """job id → number of GPUs handed to it in this decision."""
    return {a.job: len(a.gpus) for a in decision.allocations}


def starting_ids(state: ClusterState, llm: str = LLM) -> list[int]:
    return [g.id for g in state.gpus.values() if g.llm == llm and g.state is GPUState.STARTING]
