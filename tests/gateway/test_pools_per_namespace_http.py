"""A base model two namespaces each have a WarmPool of (issue 25 item 1: a pool is per namespace and
model): a key's request for it goes to its own namespace's pool's pods only; a key of a namespace with
no pool of its own, to the admitting pool of the lowest id; a key no pool admits gets a 404.

In-process: the real gateway app (``--auth required``) over a real Redis (its key map, the pool records
and worker records as the operator and the pods write them), forwarding to two worker stand-ins, one
per namespace's pool, that record what reached them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from test_priority_and_tenant import RecordingWorker  # noqa: E402

from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.api_keys import KeySecret, key_map, publish  # noqa: E402
from elastune_contract.protocol import (  # noqa: E402
    ServingPoolRecord,
    ServingState,
    WorkerRecord,
    WorkerState,
    pod_worker_id,
)
from elastune_gateway.server.app import create_app  # noqa: E402
from elastune_gateway.server.service import Gateway  # noqa: E402
from elastune_gateway.server.settings import GatewaySettings  # noqa: E402

MODEL = "tiny-llama"
A, B, C, D, E = "team-a", "team-b", "team-c", "team-d", "team-e"
KEYS = {ns: f"sk-{ns}-0123456789" for ns in (A, B, C, D, E)}


@contextlib.asynccontextmanager
async def stack(redis_url: str) -> AsyncIterator[tuple[Any, dict[str, RecordingWorker]]]:
    ns = f"pools{time.time_ns()}"
    bus = Bus(redis_url, ns)
    workers: dict[str, RecordingWorker] = {}
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []
    admits = {A: [C], B: [C, D]}  # C is admitted by both (A's id is lower); D by B's only
    for pool_ns in (A, B):
        worker = workers[pool_ns] = RecordingWorker()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(worker, log_level="warning", lifespan="off"))
        servers.append((server, asyncio.create_task(server.serve(sockets=[sock]))))
        wid = pod_worker_id(pool_ns, "tiny-00001")
        bus.publish_worker(
            WorkerRecord(
                id=wid, pool="tiny", model=MODEL, state=WorkerState.READY, url=f"http://127.0.0.1:{port}",
                started_at=time.time(), serving=ServingState(model=MODEL, max_model_len=256),
            )
        )  # fmt: skip
        bus.publish_pool(
            ServingPoolRecord(
                pool="tiny", model=MODEL, namespace=pool_ns, admits=admits[pool_ns],
                vouched={wid: f"127.0.0.1:{port}"},
            )
        )  # fmt: skip
    secrets = [
        KeySecret(namespace=k_ns, name="key", key=key, models=None, requests_per_minute=None,
                  tokens_per_minute=None)
        for k_ns, key in KEYS.items()
    ]  # fmt: skip
    publish(bus.redis, ns, key_map(secrets, {k_ns: [MODEL] for k_ns in KEYS}))
    settings = GatewaySettings(redis_url=redis_url, namespace=ns, auth="required", fair_share=False)  # type: ignore[arg-type]
    gw = Gateway(settings, Bus(redis_url, ns))
    await gw.start()
    try:
        transport = httpx.ASGITransport(app=create_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
            yield client, workers
    finally:
        await gw.stop()
        for server, task in servers:
            server.should_exit = True
            await task
        bus.close()


async def complete(client: Any, key: str) -> Any:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    return await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_a_key_s_base_model_request_goes_to_its_namespace_s_pool(redis_server: Any) -> None:
    async def scenario() -> None:
        async with stack(redis_server.url) as (client, workers):
            for caller, pool_ns in ((A, A), (B, B), (A, A), (C, A), (D, B)):
                seen = {ns: len(w.seen) for ns, w in workers.items()}
                r = await complete(client, KEYS[caller])
                assert r.status_code == 200, (caller, r.text)
                grew = {ns for ns, w in workers.items() if len(w.seen) > seen[ns]}
                assert grew == {pool_ns}, f"{caller}'s request went to {grew}, not {pool_ns}'s pool"
            listed = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[D]}"})
            assert [m["id"] for m in listed.json()["data"]] == [MODEL]
            # team-e: the model is in its key's scope, but no pool admits the namespace.
            seen = {ns: len(w.seen) for ns, w in workers.items()}
            r = await complete(client, KEYS[E])
            assert r.status_code == 404, r.text
            assert {ns: len(w.seen) for ns, w in workers.items()} == seen
            listed = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[E]}"})
            assert listed.json()["data"] == []

    asyncio.run(scenario())
