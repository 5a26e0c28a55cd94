"""A pool is per namespace and model (issue 25 item 1): two namespaces may each have a WarmPool of one
model, and the scheduler (Algorithms 1-2, the estimator, the pool limits) and the fleet run per pool,
by pool id (namespace/name). A job runs on its own namespace's pool of its model, else on the pool of
the lowest id among those that admit its namespace; a job not dispatched yet moves when its own
namespace's pool appears. The core against a real Redis with scripted workers (as test_control_core)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_control_core import Clock, FakeBackend, cond

from elastune_common.bus import Bus
from elastune_contract.api.resources import parse_resource
from elastune_contract.protocol import Assignment, WorkerRecord, WorkerState, pod_worker_id
from elastune_contract.vocabulary import Reason
from elastune_operator.control.core import ControlCore
from elastune_operator.control.records import CoreSettings, JobRecord, PoolConfig

MODEL = "test/model"
A, B, C = "team-a", "team-b", "team-c"


def pool(ns: str, allowed: tuple[str, ...] = ()) -> PoolConfig:
    return PoolConfig(
        "tiny", MODEL, max_warm=2, idle_window_seconds=30, cold_start_seconds=5, seconds_per_iteration=0.1,
        namespace=ns, allowed_namespaces=allowed,
    )  # fmt: skip


def job(ns: str, name: str) -> JobRecord:
    res = parse_resource(
        {
            "apiVersion": "elastune.dev/v1alpha1",
            "kind": "TuningJob",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "model": MODEL,
                "dataset": "/d.jsonl",
                "termination": {"maxIterations": 50},
                "deadline": "10m",
            },
        }
    )
    return JobRecord(f"{ns}/{name}", res.spec, 1_800_000_000.0, "/d.jsonl", f"/out/{name}", generation=1)


def pod(bus: Bus, ns: str, name: str, clock: Clock) -> str:
    """A warm pod of namespace ``ns``'s WarmPool "tiny", registered as a pod registers."""
    wid = pod_worker_id(ns, name)
    bus.publish_worker(
        WorkerRecord(
            id=wid, pool="tiny", model=MODEL, state=WorkerState.READY, started_at=clock.t - 3,
            ready_at=clock.t,
        )
    )  # fmt: skip
    return wid


@pytest.fixture
def env(redis_server: Any, tmp_path: Path) -> dict[str, Any]:
    bus = Bus(redis_server.url, namespace=f"pools{time.time_ns()}")
    backend, clock = FakeBackend(), Clock()
    settings = CoreSettings(cold_capacity=4, channel_url=redis_server.url, work_dir=tmp_path, max_attempts=2)
    return {"bus": bus, "backend": backend, "clock": clock, "settings": settings}


def core_of(env: dict[str, Any], pools: list[PoolConfig]) -> ControlCore:
    return ControlCore(env["backend"], env["bus"], env["settings"], pools, clock=env["clock"])


def assignment(bus: Bus, wid: str) -> Assignment | None:
    return bus.pop_assignment(wid, timeout=0.2)


def test_two_namespaces_pools_of_one_model_each_run_their_own_namespace_s_job(env: dict[str, Any]) -> None:
    bus, backend, clock = env["bus"], env["backend"], env["clock"]
    core = core_of(env, [pool(A), pool(B)])
    assert set(core.pools) == {f"{A}/tiny", f"{B}/tiny"}
    a_job, b_job = job(A, "j"), job(B, "j")
    core.submit(a_job)
    core.submit(b_job)
    assert (a_job.pool, b_job.pool) == (f"{A}/tiny", f"{B}/tiny")
    core.tick()
    # Each pool grows for its own job (Algorithm 2 per pool).
    assert sorted(backend.grown) == [(f"{A}/tiny", 1), (f"{B}/tiny", 1)]
    # B's pod registers first: it is B's, never bound to A's launched GPU.
    b_pod = pod(bus, B, "tiny-00001", clock)
    clock.t += 5
    core.tick()
    got = assignment(bus, b_pod)
    assert got is not None and got.job == b_job.key
    assert cond(a_job, "Scheduled") == ("False", "PoolGrowing"), "A's job waits for A's pod"
    a_pod = pod(bus, A, "tiny-00001", clock)
    clock.t += 1
    core.tick()
    got = assignment(bus, a_pod)
    assert got is not None and got.job == a_job.key
    assert (a_job.workers, b_job.workers) == ([a_pod], [b_pod])
    # The scheduler's state, the estimator and the metrics are per pool.
    assert core.state.counts(f"{A}/tiny")["busy"] == core.state.counts(f"{B}/tiny")["busy"] == 1
    assert core.estimator.cold_start(f"{A}/tiny") > 0 and core.estimator.cold_start(f"{B}/tiny") > 0
    core.tick()
    for ns in (A, B):
        labels = {"model": MODEL, "pool_namespace": ns, "state": "busy"}
        assert core.metrics.registry.get_sample_value("elastune_warm_gpus", labels) == 1

    # Deleting B's pool fails B's running job only; A's pool and job are untouched.
    core.remove_pool(f"{B}/tiny", "WarmPool team-b/tiny was deleted")
    assert cond(b_job, "Succeeded") == ("False", Reason.WARM_POOL_DELETED)
    assert not a_job.terminal and f"{A}/tiny" in core.pools
    core.tick()
    assert a_job.workers == [a_pod] and cond(a_job, "Running")[0] == "True"


def test_a_second_pool_of_a_model_in_one_namespace_is_refused(env: dict[str, Any]) -> None:
    core = core_of(env, [pool(A)])
    other = PoolConfig("tiny-copy", MODEL, namespace=A)
    with pytest.raises(ValueError, match="already has a warm pool"):
        core.add_pool(other)
    core.add_pool(pool(B))  # another namespace's: a pool of its own
    assert set(core.pools) == {f"{A}/tiny", f"{B}/tiny"}


def test_an_admitted_namespace_uses_another_s_pool_only_while_it_has_none(env: dict[str, Any]) -> None:
    bus, backend, clock = env["bus"], env["backend"], env["clock"]
    # Both admit every namespace: B's job still runs on B's own pool; C's on the lowest id, A's.
    core = core_of(env, [pool(B, ("*",)), pool(A, ("*",))])
    b_job, c_job = job(B, "j"), job(C, "j")
    core.submit(b_job)
    core.submit(c_job)
    assert (b_job.pool, c_job.pool) == (f"{B}/tiny", f"{A}/tiny")
    core.tick()
    assert sorted(backend.grown) == [(f"{A}/tiny", 1), (f"{B}/tiny", 1)]

    # C gets a pool of its own before its job ran anywhere: the job moves there.
    core.add_pool(pool(C))
    assert c_job.pool == f"{C}/tiny"
    assert core.state.jobs[c_job.key].llm == f"{C}/tiny"
    assert c_job.key not in core.state.pending[f"{A}/tiny"]
    core.tick()
    assert (f"{C}/tiny", 1) in backend.grown
    c_pod = pod(bus, C, "tiny-00001", clock)
    a_pod = pod(bus, A, "tiny-00001", clock)
    clock.t += 5
    core.tick()
    got = assignment(bus, c_pod)
    assert got is not None and got.job == c_job.key
    assert assignment(bus, a_pod) is None, "A's pod runs nothing of C's"

    # A job of a namespace no pool of the model admits is not C's or B's: A admits everyone.
    d_job = job("team-d", "j")
    core.submit(d_job)
    assert d_job.pool == f"{A}/tiny"


def test_a_job_no_pool_admits_fails_and_runs_nowhere(env: dict[str, Any]) -> None:
    """Local mode submits straight to the core (the operator holds such a job first, PoolNotShared):
    A's pool admits only A, so B's job fails with the reason instead of running on A's pool, and no
    GPU grows for it. It ran on the model's pool of the lowest id before (issue 25's known limit)."""
    backend = env["backend"]
    core = core_of(env, [pool(A)])
    b_job = job(B, "j")
    core.submit(b_job)
    core.tick()
    assert cond(b_job, "Succeeded")[:2] == ("False", Reason.POOL_NOT_SHARED)
    message = next(c.message for c in b_job.status.conditions if c.type == "Succeeded")
    assert f"{A}/tiny" in message and f"namespace {B}" in message, message
    assert backend.grown == [] and b_job.key not in core.state.jobs
    assert not b_job.pool


def test_local_workers_of_two_namespaces_pools_of_one_name_bind_to_their_own(tmp_path: Path) -> None:
    """Local mode: a worker process has no namespace (a pod registers as <namespace>/<pod> with its
    pool's name), so LocalBackend tells it the pool's id; with the name alone, B's worker bound to A's
    pool (the lowest id of that name and model)."""
    from elastune_operator.control.records import record_pool
    from elastune_operator.local.backend import LocalBackend

    fake = tmp_path / "fake-python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv.txt\n')
    fake.chmod(0o755)
    backend = LocalBackend(tmp_path / "state", "redis://127.0.0.1:1", python=str(fake))
    pools = {p.key: p for p in (pool(A), pool(B))}
    backend.grow(f"{B}/tiny", MODEL, 1)
    (proc,) = backend.procs.values()
    assert proc.proc.wait(timeout=30) == 0
    argv = (tmp_path / "argv.txt").read_text().split()
    told = argv[argv.index("--pool") + 1]
    rec = WorkerRecord(id=proc.wid, pool=told, model=MODEL, state=WorkerState.READY, started_at=0.0)
    assert record_pool(rec, pools) == f"{B}/tiny"
    assert proc.pool == f"{B}/tiny"
