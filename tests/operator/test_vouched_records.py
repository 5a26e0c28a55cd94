"""The control plane vouches for what it reads (issue 39 item 1), with a real Redis and scripted workers as
in test_control_core.py, behind a backend that lists its pods (``vouched()``, as the Kubernetes backend
lists a pool's pods and their IPs):

- a READY record naming this pool from a pod the backend does not list for it (a pod of another
  namespace holding the same worker credential) is never bound and is never handed a job: before, such
  a pod was handed team-a's job, spec and dataset URI;
- a FAILED record from such a pod fails no job (before: every waiting job failed as ModelLoadFailed);
- a result event without the attempt's proof ends nothing (before: a forged ``succeeded`` ended the job
  with the forger's prompt and artifact), while the assigned worker's own events still count.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_control_core import MODEL, Clock, FakeBackend, cond, job, pop, post, worker

from elastune_common.bus import Bus
from elastune_contract.protocol import Event, WorkerRecord, WorkerState
from elastune_operator.control.core import ControlCore
from elastune_operator.control.records import CoreSettings, PoolConfig

POOL = "default/pool"


class ListingBackend(FakeBackend):
    """A FakeBackend that lists its pods as a cluster backend does: worker id -> address."""

    def __init__(self) -> None:
        super().__init__()
        self.pods: dict[str, str] = {}

    def vouched(self) -> dict[str, dict[str, str]]:
        return {POOL: dict(self.pods)}


@pytest.fixture
def env(redis_server: Any, tmp_path: Path) -> dict[str, Any]:
    bus = Bus(redis_server.url, namespace=f"vouch{time.time_ns()}")
    backend, clock = ListingBackend(), Clock()
    settings = CoreSettings(cold_capacity=4, channel_url=redis_server.url, work_dir=tmp_path, max_attempts=2)
    pool = PoolConfig(
        "pool", MODEL, max_warm=4, idle_window_seconds=30, cold_start_seconds=5, seconds_per_iteration=0.1
    )
    core = ControlCore(backend, bus, settings, [pool], clock=clock)
    return {"bus": bus, "backend": backend, "clock": clock, "core": core}


def forged(bus: Bus, clock: Clock, wid: str, state: WorkerState = WorkerState.READY, **kw: Any) -> None:
    """A record a pod of another namespace writes with the shared worker credential, naming this pool
    by its id."""
    bus.publish_worker(
        WorkerRecord(
            id=wid, pool=POOL, model=MODEL, state=state, started_at=clock.t - 3, ready_at=clock.t,
            url="http://10.9.9.9:8080", **kw,
        )
    )  # fmt: skip


def unvouched(core: ControlCore, kind: str) -> float:
    value = core.metrics.registry.get_sample_value("elastune_control_unvouched_records_total", {"kind": kind})
    return value or 0.0


def test_a_record_of_a_pod_the_pool_does_not_have_gets_no_job(env: dict[str, Any]) -> None:
    core, bus, clock, backend = env["core"], env["bus"], env["clock"], env["backend"]
    rec = job("a")
    core.submit(rec)
    core.tick()
    assert backend.grown == [(POOL, 1)]
    # A pod of team-c writes a READY record naming this pool, at its own address; the pool's own pod
    # is not up yet.
    forged(bus, clock, "team-c/evil")
    forged(bus, clock, "default/evil")  # an id in the pool's namespace: still no pod of the pool
    clock.t += 5
    core.tick()
    core.tick()
    for wid in ("team-c/evil", "default/evil"):
        assert wid not in core.fleet.gpu_of
        assert bus.pop_assignment(wid, timeout=0.2) is None, f"the forged record {wid} was handed the job"
    assert unvouched(core, "worker") == 2
    # The pool's own pod comes up: it gets the job.
    backend.pods["default/pod-1"] = "10.0.0.1"
    worker(bus, "default/pod-1", clock, url="http://10.0.0.1:8080")
    clock.t += 1
    core.tick()
    a = pop(bus, "default/pod-1")
    assert a.job == rec.key
    # A record under the pool pod's id but at another address (rewritten by another pod) is not it.
    worker(bus, "default/pod-1", clock, url="http://10.9.9.9:8080")
    core.tick()
    assert unvouched(core, "worker") == 3


def test_a_failed_record_from_another_pod_fails_no_job(env: dict[str, Any]) -> None:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    rec = job("b")
    core.submit(rec)
    core.tick()
    forged(bus, clock, "team-c/evil", state=WorkerState.FAILED, reason="ModelLoadFailed", message="forged")
    for _ in range(3):
        clock.t += 1
        core.tick()
    assert not rec.terminal, rec.status.conditions


def test_an_event_without_the_attempts_proof_ends_nothing(env: dict[str, Any]) -> None:
    core, bus, clock, backend = env["core"], env["bus"], env["clock"], env["backend"]
    rec = job("c")
    core.submit(rec)
    core.tick()
    backend.pods["default/pod-1"] = "10.0.0.1"
    worker(bus, "default/pod-1", clock, url="http://10.0.0.1:8080")
    clock.t += 5
    core.tick()
    a = pop(bus, "default/pod-1")
    forged = {"job": a.job, "attempt": a.attempt, "rank": 0, "worker": "default/pod-1"}
    bus.post(Event(type="succeeded", **forged, prompt="attacker", artifact="s3://attacker-bucket/x"))
    bus.post(Event(type="failed", **forged, proof="0" * 64, reason="DatasetNotFound", message="forged"))
    clock.t += 1
    core.tick()
    assert not rec.terminal and rec.status.optimized_prompt is None
    assert unvouched(core, "event") == 1  # logged and counted once per job and worker
    post(bus, a, "succeeded", iterations=50, prompt="p", artifact="/out/c", reason="MaxIterations")
    clock.t += 1
    core.tick()
    assert cond(rec, "Succeeded") == ("True", "MaxIterations") and rec.status.optimized_prompt == "p"
