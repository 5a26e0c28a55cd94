"""Level-triggered control (issue 24 items 1 and 3) against a real Redis of its own, with scripted
workers as in test_control_core.py: a Redis that lost everything (FLUSHALL, a restart without
persistence) gets the pool records and placements back within a round or two and keeps its workers; a
worker considered gone that registers again is used again; a malformed registry record or event is
skipped and counted while the rounds go on."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_control_core import MODEL, Clock, FakeBackend, job

from elastune_common.bus import Bus
from elastune_common.servers import Server
from elastune_contract.api.loraadapter import LoRAAdapterSpec
from elastune_contract.api.warmpool import ServingSpec
from elastune_contract.protocol import (
    Event,
    ServingState,
    WorkerRecord,
    WorkerState,
    events_key,
    placement_key,
    pools_key,
    worker_key,
)
from elastune_operator.control.backend import WorkerExit
from elastune_operator.control.core import ControlCore
from elastune_operator.control.lifecycle import succeeded
from elastune_operator.control.records import MISSING_GRACE_S, CoreSettings, PoolConfig
from elastune_operator.control.serving import AdapterRecord
from real_servers import start_redis, stop

ROUND = 0.05
SILENT_S = MISSING_GRACE_S + 2.0
"""Longer than the fleet's grace for a missing record, after its TTL expired."""
PAUSED_S = 20.0
"""A pause a worker comes back from (a GC, a throttled CPU): within the grace."""


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A Redis of this module alone: FLUSHALL here touches no other test's keys."""
    server = start_redis(tmp_path_factory.mktemp("redis-lt"))
    yield server
    stop(server.proc)


def peft_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    return path


@pytest.fixture
def env(own_redis: Server, tmp_path: Path) -> Iterator[dict[str, Any]]:
    bus = Bus(own_redis.url, namespace=f"lt{time.time_ns()}")
    backend, clock = FakeBackend(), Clock()
    settings = CoreSettings(cold_capacity=4, channel_url=own_redis.url, work_dir=tmp_path, max_attempts=3)
    serving = ServingSpec(max_loras=2, max_lora_rank=16, min_replicas=1)
    pool = PoolConfig(
        "pool", MODEL, max_warm=4, idle_window_seconds=600, cold_start_seconds=5, serving=serving
    )
    core = ControlCore(backend, bus, settings, [pool], clock=clock)
    for name in ("units", "dates"):
        spec = LoRAAdapterSpec.model_validate(
            {"baseModel": MODEL, "artifactURL": str(peft_dir(tmp_path, name)), "replicas": 1}
        )
        core.serving.upsert_adapter(AdapterRecord("default", name, spec))
    yield {"bus": bus, "backend": backend, "clock": clock, "core": core}
    bus.close()


def heartbeat(bus: Bus, wid: str, clock: Clock, state: WorkerState = WorkerState.READY) -> None:
    """What a serving worker's heartbeat publishes (a serving pod with two device adapter slots)."""
    bus.publish_worker(
        WorkerRecord(
            id=wid,
            pool="pool",
            model=MODEL,
            state=state,
            url=f"http://{wid}:8080",
            started_at=clock.t - 3,
            ready_at=clock.t,
            serving=ServingState(model=MODEL, max_model_len=256, max_loras=2),
        )
    )


def rounds(env: dict[str, Any], n: int, *, beat: list[str] | None = None, step: float = ROUND) -> None:
    """``n`` control rounds ``step`` apart on the clock, the listed workers heartbeating before each."""
    for _ in range(n):
        for wid in beat or []:
            heartbeat(env["bus"], wid, env["clock"])
        env["clock"].t += step
        env["core"].tick()


def serving_pod(env: dict[str, Any], wid: str) -> None:
    """min_replicas 1: the first round grows the pool; the worker comes up and is bound."""
    env["core"].tick()
    assert env["backend"].grown == [("default/pool", 1)]
    heartbeat(env["bus"], wid, env["clock"])
    env["clock"].t += 5
    env["core"].tick()
    assert wid in env["core"].fleet.gpu_of


def poison(core: ControlCore, kind: str) -> float:
    value = core.metrics.registry.get_sample_value("elastune_control_poison_records_total", {"kind": kind})
    return value or 0.0


# -- item 1: level-triggered ------------------------------------------------------------------------
def test_after_flushall_the_next_rounds_restore_pool_records_and_placements_and_keep_the_worker(
    env: dict[str, Any],
) -> None:
    core, bus, backend = env["core"], env["bus"], env["backend"]
    serving_pod(env, "w1")
    rounds(env, 2, beat=["w1"])
    pools_before = bus.serving_pools()
    placed_before = bus.placement("w1")
    assert set(pools_before["default/pool"].adapters) == {"default/units", "default/dates"}
    assert set(placed_before) == {"default/units", "default/dates"}

    bus.redis.flushall()  # what a Redis restarted without persistence looks like
    rounds(env, 2)  # the worker's next heartbeat has not come yet: its record is missing
    assert "w1" in core.fleet.gpu_of and backend.shrunk == [], "a missing record is not a lost worker yet"
    rounds(env, 3, beat=["w1"])  # the worker heartbeats again (it re-registers by itself)

    assert bus.serving_pools() == pools_before
    assert bus.placement("w1") == placed_before
    assert "w1" in core.fleet.gpu_of and backend.shrunk == [] and backend.grown == [("default/pool", 1)]


def test_what_the_core_owns_is_rewritten_periodically_even_when_nothing_changed(env: dict[str, Any]) -> None:
    bus = env["bus"]
    serving_pod(env, "w1")
    rounds(env, 2, beat=["w1"])
    placed = bus.placement("w1")
    # Someone (or a partial loss) removed one placement and nothing changed on the core's side.
    bus.redis.delete(placement_key(bus.ns, "w1"))
    rounds(env, int(6 / ROUND), beat=["w1"])  # a few seconds of rounds
    assert bus.placement("w1") == placed


def test_a_worker_lost_for_a_missing_record_that_registers_again_is_used_again(env: dict[str, Any]) -> None:
    core, bus, backend = env["core"], env["bus"], env["backend"]
    serving_pod(env, "w1")
    bus.redis.delete(worker_key(bus.ns, "w1"))  # its record expired (paused past its TTL)
    rounds(env, int(SILENT_S), step=1.0)
    assert "w1" not in core.fleet.gpu_of and "w1" in backend.shrunk, "silent past the grace: lost"
    # It resumes and heartbeats again.
    rounds(env, 2, beat=["w1"])
    assert "w1" in core.fleet.gpu_of, "a worker that registers again is bound again"
    returned = core.metrics.registry.get_sample_value(
        "elastune_control_workers_returned_total", {"model": MODEL, "pool_namespace": "default"}
    )
    assert returned == 1
    # ... and used: a job goes to it.
    rec = job("after-return", iterations=10)
    core.submit(rec)
    rounds(env, 2, beat=["w1"])
    a = bus.pop_assignment("w1", timeout=0.5)
    assert a is not None and a.job == rec.key


def test_a_worker_paused_20_s_is_neither_lost_nor_stopped_and_keeps_its_work(env: dict[str, Any]) -> None:
    """Issue 38 item 2: three heartbeats after its record's TTL declared a worker paused ~20 s lost, and
    the control plane stopped it when it resumed (its streams cut). A pause within the grace is not a
    loss: the worker keeps its GPU and its placement, and a job still goes to it."""
    core, bus, backend = env["core"], env["bus"], env["backend"]
    serving_pod(env, "w1")
    bus.redis.delete(worker_key(bus.ns, "w1"))  # paused: its record expired
    rounds(env, int(PAUSED_S), step=1.0)
    assert "w1" in core.fleet.gpu_of and backend.shrunk == [], "a paused worker was declared lost"
    rounds(env, 2, beat=["w1"])  # it resumes
    assert "w1" in core.fleet.gpu_of and backend.shrunk == []
    rec = job("after-pause", iterations=10)
    core.submit(rec)
    rounds(env, 2, beat=["w1"])
    a = bus.pop_assignment("w1", timeout=0.5)
    assert a is not None and a.job == rec.key


def test_a_worker_the_backend_saw_exit_is_not_revived_by_its_stale_record(env: dict[str, Any]) -> None:
    core, bus, backend = env["core"], env["bus"], env["backend"]
    serving_pod(env, "w1")
    backend.dead["w1"] = WorkerExit(MODEL, "exit code -9")
    rounds(env, 1)
    assert "w1" not in core.fleet.gpu_of
    heartbeat(bus, "w1", env["clock"])  # a record still in the registry
    rounds(env, 2)
    assert "w1" not in core.fleet.gpu_of


# -- item 3: poison stays local ---------------------------------------------------------------------
def test_a_garbage_worker_record_is_skipped_and_counted_once_while_the_rounds_go_on(
    env: dict[str, Any],
) -> None:
    core, bus = env["core"], env["bus"]
    bus.redis.set(worker_key(bus.ns, "bad"), "{this is not json", ex=60)
    bus.redis.sadd(f"{bus.ns}:workers", "bad")
    bus.redis.set(worker_key(bus.ns, "bytes"), b"\xff\xfe\x00garbage", ex=60)
    bus.redis.sadd(f"{bus.ns}:workers", "bytes")
    serving_pod(env, "w1")  # the good worker is still bound, the pool record still written
    rounds(env, 5, beat=["w1"])
    assert set(bus.workers()) == {"w1"}
    assert set(bus.serving_pools()["default/pool"].adapters) == {"default/units", "default/dates"}
    assert poison(core, "worker") == 2  # counted once each, not once per round


def test_a_malformed_event_is_skipped_and_counted_and_the_job_still_finishes(env: dict[str, Any]) -> None:
    core, bus = env["core"], env["bus"]
    serving_pod(env, "w1")
    rec = job("poisoned-stream", iterations=10)
    core.submit(rec)
    rounds(env, 2, beat=["w1"])
    a = bus.pop_assignment("w1", timeout=0.5)
    assert a is not None
    key = events_key(bus.ns, rec.key)
    bus.redis.xadd(key, {"event": '{"type": "exploded"}'})
    bus.redis.xadd(key, {"not-an-event": "x"})
    rounds(env, 3, beat=["w1"])
    done = Event(
        type="succeeded", job=a.job, attempt=a.attempt, rank=0, worker="w1", proof=a.proof, iterations=10
    )
    bus.post(done.model_copy(update={"artifact": "/out/x"}))
    rounds(env, 3, beat=["w1"])
    assert rec.terminal and succeeded(rec)
    assert poison(core, "event") == 2


def test_a_malformed_pool_record_or_placement_is_skipped_by_the_readers(env: dict[str, Any]) -> None:
    bus = env["bus"]
    serving_pod(env, "w1")
    rounds(env, 1, beat=["w1"])
    bus.redis.hset(pools_key(bus.ns), "junk", "[1, 2")
    bus.redis.hset(placement_key(bus.ns, "w1"), "junk", "{}")
    assert set(bus.serving_pools()) == {"default/pool"}
    assert set(bus.placement("w1")) == {"default/units", "default/dates"}  # adapter ids: namespace/name
    assert bus.poison == {"pool": 1, "placement": 1}
