"""Co-serving capacity in the scheduler (issue 13): the pure decision with exact outcomes, the progress
models, and the mixed-workload simulation with and without co-serving."""

from __future__ import annotations

import pytest

from elastune_bench.sim.scheduling.mixed import MixedConfig, run_mixed
from elastune_bench.sim.scheduling.simulator import SimConfig
from elastune_bench.sim.scheduling.workload import profile
from elastune_operator.scheduling.coserving import (
    PEAK_DEMAND_RETENTION,
    CoServeModel,
    UtilizationPeaks,
    coserved_finish,
    floored_rate,
)
from elastune_operator.scheduling.prompttuner import PromptTunerPolicy
from elastune_operator.scheduling.state import Allocation, Job, Launch, RoundDecision
from scheduling_helpers import LLM, make_estimator, make_gpus_warm, make_running, make_state

GPU, CPU = CoServeModel("gpu"), CoServeModel("cpu")


def test_progress_models_follow_flexllm_on_a_gpu_and_the_idle_share_on_a_cpu() -> None:
    assert GPU.rate(0.0) == 1.0 and GPU.rate(1.0) == pytest.approx(PEAK_DEMAND_RETENTION)
    assert GPU.rate(0.5) == pytest.approx(1 - (1 - PEAK_DEMAND_RETENTION) / 2)
    assert CPU.rate(1.0) == 0.0 and CPU.rate(0.5) == pytest.approx(0.275)


def test_the_real_finish_follows_the_pods_changing_load() -> None:
    loads = {0: 0.0, 1: 1.0}  # idle for a minute, then saturated
    at = lambda t: loads.get(int(t // 60), 1.0)  # noqa: E731
    # 90 s of dedicated work: 60 s at rate 1, then 30 s of work at rate 0.76 -> 39.5 s more.
    gpu, cpu = (lambda t: GPU.rate(at(t))), (lambda t: CPU.rate(at(t)))
    assert coserved_finish(0.0, 90.0, gpu, 60.0, 1e4) == pytest.approx(60 + 30 / 0.76)
    assert coserved_finish(0.0, 90.0, cpu, 60.0, 1e4) is None  # a CPU pod at full load: no progress


def test_co_serving_the_mixed_workload_lowers_cost_and_a_saturated_pod_takes_nothing() -> None:
    workload = profile("calibrated").config("low", 1.0, seed=3)
    light = MixedConfig(mean_utilization=0.2)
    off = run_mixed(workload, SimConfig(seed=3), light, coserve=False)
    on = run_mixed(workload, SimConfig(seed=3), light, coserve=True)
    assert off.coserved_jobs == 0 and on.coserved_jobs > 0 and on.jobs == off.jobs
    assert on.serving_cost_usd == pytest.approx(off.serving_cost_usd)  # the same warm serving pods
    assert on.tuning_cost_usd < off.tuning_cost_usd and on.cost_usd < off.cost_usd
    # On a saturated CPU pod co-serving makes no progress: the policy declines every job.
    full = MixedConfig(mean_utilization=1.0, burstiness=1e9, model=CPU)  # 98 % (the clip) every minute
    none = run_mixed(workload, SimConfig(seed=3), full, coserve=True)
    assert none.coserved_jobs == 0 and none.cost_usd == pytest.approx(off.cost_usd)
    assert none.slo_violation_pct == pytest.approx(off.slo_violation_pct)


# -- the live scheduler: PromptTuner offers serving pods to co-servable jobs (exact decisions) -------------
# The helpers' profile: 1 s per iteration on one GPU, perfect scaling, T_cold 10 s, no overheads.


def _round(rates: list[float], job: Job, dedicated: int = 0) -> tuple[RoundDecision, list[int], list[int]]:
    """One PromptTuner round with ``dedicated`` idle GPUs and idle serving pods at ``rates``."""
    state = make_state(idle={LLM: dedicated})
    free = list(state.idle[LLM])
    pods = make_gpus_warm(state, LLM, len(rates))
    state.set_coserve_rates(dict(zip(pods, rates, strict=True)))
    state.submit(job)
    return PromptTunerPolicy(make_estimator()).round(state, 0.0), free, pods


def _job(iterations: int, slo: float, coservable: bool = True) -> Job:
    j = Job("j", LLM, 0.0, slo, iterations)
    j.coservable = coservable
    return j


def test_a_serving_pod_is_given_to_a_coservable_job_when_its_co_served_time_meets_the_slo() -> None:
    # 60 iterations, SLO 100 s: co-served on the 0.9 pod 60 / 0.9 = 66.7 s <= 0.8 x 100 s.
    d, _, pods = _round([0.5, 0.9], _job(60, 100.0))
    assert d.allocations == [Allocation("j", [pods[1]], 1)] and d.launches == []


def test_too_slow_co_served_grows_the_pool_instead_and_never_waits_for_serving_pods() -> None:
    # SLO 70 s: 60 / 0.9 = 66.7 s and (2 pods) 30 / 0.5 = 60 s both exceed 0.8 x 70 = 56 s; one GPU from the
    # cold pool meets it (10 + 60 = 70 s). The idle serving pods are not "free now" to DelaySchedulable.
    d, _, _ = _round([0.9, 0.5], _job(60, 70.0))
    assert d.allocations == [] and d.launches == [Launch(LLM, 1)]
    # A job the engine cannot co-serve never takes a serving pod, however idle it is.
    d, _, _ = _round([1.0], _job(10, 100.0, coservable=False))
    assert d.allocations == [] and d.launches == [Launch(LLM, 1)]
    # A pod with no spare budget (rate 0) is neither free nor co-servable.
    d, _, _ = _round([0.0], _job(10, 100.0))
    assert d.allocations == [] and d.launches == [Launch(LLM, 1)]


def test_a_data_parallel_co_served_gang_runs_at_its_slowest_pod_and_takes_idle_dedicated_gpus_first() -> None:
    # 120 iterations, SLO 100 s: A = 2. Two serving pods: 60 / min(0.9, 0.8) = 75 s <= 80 s.
    d, _, pods = _round([0.8, 0.9], _job(120, 100.0))
    assert d.allocations == [Allocation("j", [pods[1], pods[0]], 2)]
    # With 0.9 and 0.7 it takes 60 / 0.7 = 85.7 s > 80 s on two; three (40 / 0.7 = 57 s) are not there.
    d, _, _ = _round([0.7, 0.9], _job(120, 100.0))
    assert d.allocations == [] and d.launches == [Launch(LLM, 2)]
    # One idle dedicated GPU and one serving pod: the gang is both (60 / 0.9 = 66.7 s).
    d, free, pods = _round([0.9], _job(120, 100.0), dedicated=1)
    assert d.allocations == [Allocation("j", [*free, pods[0]], 2)]


def test_a_running_jobs_serving_pods_are_not_counted_as_dedicated_capacity_to_wait_for() -> None:
    state = make_state()
    gpus = make_running(state, Job("co", LLM, 0.0, 100.0, 5), 1, 0.0, 5.0)
    state.set_coserve_rates({gpus[0]: 0.9})
    waiting = Job("w", LLM, 0.0, 70.0, 60)  # could wait for a dedicated GPU freed at 5 s: 5 + 60 <= 70
    state.submit(waiting)
    d = PromptTunerPolicy(make_estimator()).round(state, 0.0)
    assert d.launches == [Launch(LLM, 1)]
    state.set_coserve_rates({})  # the same pod no longer serves: it is a dedicated GPU freeing at 5 s
    d = PromptTunerPolicy(make_estimator()).round(state, 0.0)
    assert d.launches == [] and d.allocations == []


def test_pods_are_rated_at_their_peak_utilisation_of_the_last_minute() -> None:
    peaks = UtilizationPeaks(window_seconds=60.0)
    assert peaks.observe("p", 100.0, 0.2) == 0.2
    assert peaks.observe("p", 110.0, 0.9) == 0.9
    assert peaks.observe("p", 110.0, 0.1) == 0.9  # the same heartbeat read again is not a new report
    assert peaks.observe("p", 165.0, 0.3) == 0.9
    assert peaks.observe("p", 171.0, 0.3) == 0.3  # the 0.9 of t = 110 left the window
    peaks.forget(set())
    assert peaks.observe("p", 172.0, 0.1) == 0.1
    assert floored_rate(GPU, 0.5) == pytest.approx(0.85) and floored_rate(CPU, 0.5) == pytest.approx(0.25)
