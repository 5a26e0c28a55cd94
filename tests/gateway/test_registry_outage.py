"""The gateway's view of the registry when Redis fails (issue 24 items 3 and 6), in-process against a
real redis-server of its own that the test stops and starts again on the same port: readiness says
whether the gateway can serve (endpoints known, or a fresh view), not whether Redis answered just now;
failed refreshes are counted and routing goes on from the last view; a malformed record is skipped and
counted while the directory keeps the good ones."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from elastune_common.bus import Bus  # noqa: E402
from elastune_common.servers import Server, binary  # noqa: E402
from elastune_contract.protocol import (  # noqa: E402
    ServingPoolRecord,
    ServingState,
    WorkerRecord,
    WorkerState,
    worker_key,
)
from elastune_gateway.server.app import create_app  # noqa: E402
from elastune_gateway.server.service import Gateway  # noqa: E402
from elastune_gateway.server.settings import GatewaySettings  # noqa: E402
from real_servers import start_redis, stop  # noqa: E402

MODEL = "tiny-llama"


class Redis:
    """A redis-server that can be stopped and started again on its port (a restart without persistence)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server: Server = start_redis(tmp)

    @property
    def url(self) -> str:
        return self.server.url

    def down(self) -> None:
        stop(self.server.proc)

    def up(self) -> None:
        argv = [binary("redis-server"), "--port", str(self.server.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.tmp)]
        self.server.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bus = Bus(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                bus.ping()
                break
            except ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not come back"
                time.sleep(0.05)
        bus.close()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    r = Redis(tmp_path)
    yield r
    r.down()


def endpoint(bus: Bus, wid: str) -> None:
    bus.publish_worker(
        WorkerRecord(
            id=wid,
            pool="pool",
            model=MODEL,
            state=WorkerState.READY,
            url="http://127.0.0.1:9",
            started_at=time.time(),
            serving=ServingState(model=MODEL, max_model_len=256),
        )
    )


def gateway(redis_url: str, **settings: Any) -> Gateway:
    # A short socket timeout: a refresh against a stopped Redis fails at once (connection refused).
    s = GatewaySettings(redis_url=redis_url, namespace="gwo", **settings)
    return Gateway(s, Bus(redis_url, "gwo", socket_timeout=1.0))


async def get(gw: Gateway, path: str) -> Any:
    transport = httpx.ASGITransport(app=create_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.get(path)


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_readiness_stays_200_while_redis_is_down_with_endpoints_known_and_failures_are_counted(
    redis: Redis,
) -> None:
    async def scenario() -> None:
        bus = Bus(redis.url, "gwo")
        endpoint(bus, "w1")
        bus.publish_pool(ServingPoolRecord(pool="pool", model=MODEL, adapters={"units": 8}))
        gw = gateway(redis.url)
        await gw.directory.refresh()
        assert (await get(gw, "/readyz")).status_code == 200

        redis.down()
        for _ in range(3):
            await gw.directory.refresh()
        ready = await get(gw, "/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["endpoints"] == 1 and ready.json()["registry_error"]
        model = gw.directory.model("units")  # routing goes on from the last view
        assert model is not None and [e.id for e in gw.directory.endpoints(model)] == []
        assert [e.id for e in gw.directory.endpoints(gw.directory.model(MODEL))] == ["w1"]  # type: ignore[arg-type]
        text = (await get(gw, "/metrics")).text
        assert sample(text, "elastune_gateway_registry_refresh_failures_total") == 3
        assert sample(text, "elastune_gateway_registry_age_seconds") >= 0

        redis.up()  # back, empty: the worker's next heartbeat re-registers it
        endpoint(bus, "w1")
        await gw.directory.refresh()
        assert gw.directory.last_error is None and (await get(gw, "/readyz")).status_code == 200
        bus.close()
        gw.bus.close()

    asyncio.run(scenario())


def test_readiness_fails_only_when_the_view_is_stale_and_names_no_endpoint(redis: Redis) -> None:
    async def scenario() -> None:
        gw = gateway(redis.url, registry_stale_s=0.3)
        await gw.directory.refresh()
        assert (await get(gw, "/readyz")).status_code == 200  # fresh, empty: it can hold requests
        redis.down()
        await gw.directory.refresh()
        assert (await get(gw, "/readyz")).status_code == 200  # one failed read is not unready
        await asyncio.sleep(0.4)
        await gw.directory.refresh()
        ready = await get(gw, "/readyz")
        assert ready.status_code == 503 and "no endpoint known" in ready.json()["reason"]
        gw.bus.close()

    asyncio.run(scenario())


def test_a_garbage_worker_record_is_skipped_and_counted_while_the_directory_keeps_the_others(
    redis: Redis,
) -> None:
    async def scenario() -> None:
        bus = Bus(redis.url, "gwo")
        endpoint(bus, "w1")
        bus.redis.set(worker_key("gwo", "bad"), '{"id": "bad", "state": "exploded"}', ex=60)
        bus.redis.sadd("gwo:workers", "bad")
        bus.redis.hset("gwo:serving-pools", "junk", "not json")
        gw = gateway(redis.url)
        for _ in range(3):
            await gw.directory.refresh()
        assert gw.directory.last_error is None
        assert [e.id for e in gw.directory.all_endpoints()] == ["w1"]
        assert (await get(gw, "/readyz")).status_code == 200
        text = (await get(gw, "/metrics")).text
        assert 'elastune_gateway_poison_records_total{kind="worker"} 1.0' in text
        assert 'elastune_gateway_poison_records_total{kind="pool"} 1.0' in text
        bus.close()
        gw.bus.close()

    asyncio.run(scenario())
