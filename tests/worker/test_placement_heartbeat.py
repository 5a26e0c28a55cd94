"""A slow adapter load never holds up the worker's heartbeat (issue 24 item 5): the agent's heartbeat
and the adapter placement wired as the worker wires them (``on_heartbeat=AdapterSync.sync_in_background``),
over a real Redis registry. The load is slowed on purpose: the serving client's ``load_lora`` blocks
(as a big download or a long host copy would) until the test lets it finish; meanwhile the worker's
registry record must keep being refreshed (heartbeat timestamp and key TTL)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastune_common.bus import Bus
from elastune_contract.protocol import (
    HEARTBEAT_SECONDS,
    WORKER_TTL_SECONDS,
    PlacedAdapter,
    WorkerState,
    worker_key,
)
from elastune_worker.server.agent import Agent, AgentConfig
from elastune_worker.server.placement import AdapterSync

SLOW_LOAD_S = 6.0
"""Longer than several heartbeats; the TTL (10 s) is not waited out: freshness is what is checked."""


class SlowLoadClient:
    """The serving client's adapter calls, with a load that takes as long as the test wants."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.loaded: list[str] = []

    async def load_lora(self, name: str, path: str) -> None:
        self.started.set()
        self.release.wait(SLOW_LOAD_S * 3)  # blocking, as a load in the engine's call is for its caller
        self.loaded.append(name)

    async def unload_lora(self, name: str) -> None:
        pass


@pytest.fixture
def bus(redis_server: Any) -> Iterator[Bus]:
    b = Bus(redis_server.url, f"hb{time.time_ns()}")
    yield b
    b.close()


def test_the_heartbeat_stays_fresh_while_a_placed_adapter_loads_slowly(bus: Bus) -> None:
    client = SlowLoadClient()
    sync = AdapterSync(bus, "w-slow", lambda: client)
    agent = Agent(
        AgentConfig(
            worker_id="w-slow", pool="p", model="m", url="http://127.0.0.1:1",
            on_heartbeat=sync.sync_in_background,
        ),
        bus,
    )  # fmt: skip
    agent._set(state=WorkerState.READY)
    beat = threading.Thread(target=agent.heartbeat_forever, daemon=True)
    beat.start()
    try:
        bus.set_placement("w-slow", {"slow": PlacedAdapter(url="/adapters/slow", tier="host")})
        assert client.started.wait(10), "the placement was never applied"
        ages, ttls = [], []
        until = time.monotonic() + SLOW_LOAD_S
        while time.monotonic() < until:
            rec = bus.workers().get("w-slow")
            ages.append(time.time() - rec.heartbeat if rec is not None else float("inf"))
            ttls.append(int(bus.redis.ttl(worker_key(bus.ns, "w-slow"))))
            time.sleep(0.25)
        assert not client.loaded, "the load was to be still under way"
        worst = max(ages)
        assert worst < 3 * HEARTBEAT_SECONDS, f"heartbeat went stale during the load: {worst:.1f} s old"
        assert min(ttls) >= WORKER_TTL_SECONDS - 3, f"the registration's TTL ran down to {min(ttls)} s"
        client.release.set()
        deadline = time.monotonic() + 10
        while sync.managed != {"slow": "/adapters/slow"} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sync.managed == {"slow": "/adapters/slow"} and client.loaded == ["slow"]
    finally:
        client.release.set()
        agent.stop()
        beat.join(timeout=10)


class EngineLikeClient:
    """What the engine holds, changed by loads and unloads from anyone (the placement or the HTTP API)."""

    def __init__(self) -> None:
        self.present: set[str] = set()
        self.loads = 0

    async def load_lora(self, name: str, path: str) -> None:
        self.present.add(name)
        self.loads += 1

    async def unload_lora(self, name: str) -> None:
        self.present.discard(name)

    def adapters(self) -> list[Any]:
        return [type("Info", (), {"name": n})() for n in sorted(self.present)]


def test_a_placed_adapter_unloaded_behind_the_placements_back_is_loaded_again(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastune_worker.server import placement

    monkeypatch.setattr(placement, "STATS_GRACE_SECONDS", 0.0, raising=False)
    client = EngineLikeClient()
    sync = AdapterSync(bus, "w-back", lambda: client)
    bus.set_placement("w-back", {"units": PlacedAdapter(url="/adapters/units", tier="host")})
    sync.sync()
    assert client.present == {"units"} and client.loads == 1
    client.present.discard("units")  # POST /v1/unload_lora_adapter with the control token
    sync.sync()
    assert client.present == {"units"} and client.loads == 2, "still placed here, so loaded again"
    sync.sync()
    assert client.loads == 2  # nothing to do while the engine has it
