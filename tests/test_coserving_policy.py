"""Co-serving capacity in the scheduler (issue 13): the pure decision with exact outcomes, the progress
models, and the mixed-workload simulation with and without co-serving."""

from __future__ import annotations

import pytest

from elastune_operator.scheduling.coserving import (
    PEAK_DEMAND_RETENTION,
    SAFETY,
    CoServeModel,
    ServingPod,
    choose_pod,
    coserved_finish,
    predicted_seconds,
)
from elastune_operator.sim.mixed import MixedConfig, run_mixed
from elastune_operator.sim.simulator import SimConfig
from elastune_operator.sim.workload import profile

GPU, CPU = CoServeModel("gpu"), CoServeModel("cpu")


def test_progress_models_follow_flexllm_on_a_gpu_and_the_idle_share_on_a_cpu() -> None:
    assert GPU.rate(0.0) == 1.0 and GPU.rate(1.0) == pytest.approx(PEAK_DEMAND_RETENTION)
    assert GPU.rate(0.5) == pytest.approx(1 - (1 - PEAK_DEMAND_RETENTION) / 2)
    assert CPU.rate(1.0) == 0.0 and CPU.rate(0.5) == pytest.approx(0.275)
    assert predicted_seconds(100.0, 1.0, CPU) is None
    assert predicted_seconds(76.0, 1.0, GPU) == pytest.approx(100.0)


def test_the_least_loaded_free_pod_is_chosen_when_the_job_still_meets_its_deadline() -> None:
    pods = [
        ServingPod("a", "m", 0.9),
        ServingPod("b", "m", 0.2),
        ServingPod("c", "m", 0.1, free=False),  # already co-serves a job
        ServingPod("d", "other", 0.0),
    ]
    choice = choose_pod("m", 1, 50.0, 100.0, pods, GPU)
    assert choice.pod == "b" and choice.predicted_seconds == pytest.approx(50.0 / GPU.rate(0.2))
    # Too slow co-served: 50 / rate(0.2) = 52.1 s > 0.8 x 60 s.
    late = choose_pod("m", 1, 50.0, 60.0, pods, GPU)
    assert late.pod is None and "more than 80% of the 60 s left" in late.reason
    assert choose_pod("m", 4, 50.0, 100.0, pods, GPU).reason.startswith("the job needs 4 GPUs")
    assert choose_pod("x", 1, 1.0, 100.0, pods, GPU).reason == "no free serving pod of x"
    assert choose_pod("m", 1, 1.0, 100.0, pods, GPU, "method lora").reason == "method lora"
    assert choose_pod("m", 1, 1.0, 100.0, [ServingPod("a", "m", 1.0)], CPU).reason.endswith(
        f"never, more than {SAFETY:.0%} of the 100 s left"
    )


def test_the_real_finish_follows_the_pods_changing_load() -> None:
    loads = {0: 0.0, 1: 1.0}  # idle for a minute, then saturated
    at = lambda t: loads.get(int(t // 60), 1.0)  # noqa: E731
    # 90 s of dedicated work: 60 s at rate 1, then 30 s of work at rate 0.76 -> 39.5 s more.
    assert coserved_finish(0.0, 90.0, at, GPU, 60.0, 1e4) == pytest.approx(60 + 30 / 0.76)
    assert coserved_finish(0.0, 90.0, at, CPU, 60.0, 1e4) is None  # a CPU pod at full load: no progress


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
