"""CPU binding of the engine process (vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND): the plan for each spec,
the container's CPU quota, and a real engine process bound to one CPU that serves the same greedy
tokens as an unbound one."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from elastune_worker.engine.model_runner.cpu_binding import (
    CpuPlan,
    cpu_quota,
    parse_cpu_list,
    plan_cpus,
    validate_spec,
)


def test_auto_reserves_the_last_cpu_for_the_front_end_and_does_not_bind_one_cpu() -> None:
    assert plan_cpus("auto", {0, 1, 2, 3}) == CpuPlan(engine=(0, 1, 2), frontend=(3,))
    assert plan_cpus("auto", {4, 7}) == CpuPlan(engine=(4,), frontend=(7,))
    assert plan_cpus("auto", {0}) is None
    assert plan_cpus("none", {0, 1, 2, 3}) is None


def test_auto_does_not_bind_under_a_quota_smaller_than_the_usable_cpus() -> None:
    # A Kubernetes CPU limit of 2 on a 64-CPU node: 63 bound threads would oversubscribe the quota.
    assert plan_cpus("auto", set(range(64)), quota=2.0) is None
    # The static CPU manager gives the pod an exclusive cpuset matching its limit: binding applies.
    assert plan_cpus("auto", {10, 11}, quota=2.0) == CpuPlan(engine=(10,), frontend=(11,))


def test_an_explicit_list_binds_there_and_leaves_the_rest_to_the_front_end() -> None:
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)
    assert plan_cpus("1-2", {0, 1, 2, 3}) == CpuPlan(engine=(1, 2), frontend=(0, 3))
    assert plan_cpus("0-1", {0, 1}) == CpuPlan(engine=(0, 1), frontend=(0, 1))  # nothing left: shared
    with pytest.raises(ValueError, match=r"engine CPUs \[5\] are not usable here"):
        plan_cpus("4-5", {0, 1, 2, 3, 4})


@pytest.mark.parametrize("spec", ["x", "3-1", "-1", "1,,2", ""])
def test_bad_cpu_lists_are_refused_with_the_text(spec: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        validate_spec(spec)


def test_the_quota_is_read_from_cgroup_v2_or_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(v2) == 2.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(v1) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(v1) is None
    assert cpu_quota(tmp_path / "absent") is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_a_bound_engine_process_runs_on_its_cpu_with_one_thread_and_serves_the_same_tokens() -> None:
    pytest.importorskip("torch")
    from elastune_demo import build as B
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.core.sampling import SamplingParams
    from elastune_worker.engine.frontend.engine_process import ProcessEngine
    from elastune_worker.engine.llm_engine import LLMEngine

    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    config = EngineConfig(kv_cache_tokens=4096)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = [5, 17, 99, 3, 250, 8]
    expected = LLMEngine(path, config).generate([prompt], params)[0]
    before = os.sched_getaffinity(0)
    cpu = max(before)
    eng = ProcessEngine(path, config, cpus=(cpu,))
    try:
        assert eng.engine_cpus == (cpu,) and eng.engine_threads == 1
        assert os.sched_getaffinity(eng.proc.pid) == {cpu}

        async def run() -> list[int]:
            got: list[int] = []
            async for o in eng.generate("r", prompt, params):
                got += o.new_token_ids
            return got

        assert asyncio.run(run()) == expected
    finally:
        eng.close()
    assert os.sched_getaffinity(0) == before  # binding the engine leaves the caller as it was
