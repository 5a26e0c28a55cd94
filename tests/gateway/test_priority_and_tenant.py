"""What the gateway forwards of a request's ``priority`` and of its caller (issue 25, tenancy): a client's
``priority`` (lower first in the engine's priority and sjf queues) reaches the worker only for a key whose
Secret says ``allowPriority: "true"``; any other key's is ignored (the answer says so) and the request is
ordered by the gateway's own length prediction, if any. The caller's key goes to the worker as the tenant
of the engine's ``fair`` queue, and a client cannot set that header itself. Without authentication (the
loopback ``elastune serve``) a client's ``priority`` goes through as before.

In-process: the real gateway app over a real Redis (its key map and registry), forwarding to a worker
stand-in that records the body and headers each request reached it with."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.api_keys import TENANT_HEADER, KeySecret, key_map, publish  # noqa: E402
from elastune_contract.protocol import ServingState, WorkerRecord, WorkerState  # noqa: E402
from elastune_gateway.server.app import create_app  # noqa: E402
from elastune_gateway.server.service import Gateway  # noqa: E402
from elastune_gateway.server.settings import GatewaySettings  # noqa: E402

MODEL = "tiny-llama"
NS = "team-a"
PLAIN, VIP = "sk-plain-0123456789", "sk-vip-0123456789"
ANSWER = {
    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}  # fmt: skip


class RecordingWorker:
    """A worker stand-in: answers every completion at once and keeps (body, headers) of each."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], dict[str, str]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.seen.append((json.loads(body), headers))
        out = json.dumps(ANSWER).encode()
        headers_out = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
        await send({"type": "http.response.start", "status": 200, "headers": headers_out})
        await send({"type": "http.response.body", "body": out})


@contextlib.asynccontextmanager
async def stack(redis_url: str, auth: str) -> AsyncIterator[tuple[Any, RecordingWorker, Gateway]]:
    ns = f"prio{time.time_ns()}"
    bus = Bus(redis_url, ns)
    worker = RecordingWorker()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(worker, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    secrets = [
        KeySecret(namespace=NS, name="plain", key=PLAIN, models=None, requests_per_minute=None,
                  tokens_per_minute=None),
        KeySecret(namespace=NS, name="vip", key=VIP, models=None, requests_per_minute=None,
                  tokens_per_minute=None, allow_priority=True),
    ]  # fmt: skip
    publish(bus.redis, ns, key_map(secrets, {NS: [MODEL]}))
    bus.publish_worker(
        WorkerRecord(
            id="w0",
            pool="pool",
            model=MODEL,
            state=WorkerState.READY,
            url=f"http://127.0.0.1:{port}",
            started_at=time.time(),
            serving=ServingState(model=MODEL, max_model_len=256),
        )
    )
    settings = GatewaySettings(redis_url=redis_url, namespace=ns, auth=auth, fair_share=False)  # type: ignore[arg-type]
    gw = Gateway(settings, Bus(redis_url, ns))
    await gw.start()
    try:
        transport = httpx.ASGITransport(app=create_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
            yield client, worker, gw
    finally:
        await gw.stop()
        server.should_exit = True
        await serving
        bus.close()


async def complete(client: Any, key: str | None, **extra: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers |= extra.pop("headers", {})
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1} | extra
    r = await client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


class Predictor:
    """The length predictor's stand-in: every request is predicted 7 tokens."""

    async def predict(self, text: str) -> int | None:
        return 7


def test_a_key_without_allow_priority_cannot_jump_the_queue(redis_server: Any) -> None:
    async def scenario() -> None:
        async with stack(redis_server.url, "required") as (client, worker, gw):
            r = await complete(client, PLAIN, priority=-1000)
            assert r.headers["x-elastune-priority"] == "ignored"
            assert "priority" not in worker.seen[-1][0]  # the engine sees no priority: 0, like everyone's
            streamed = await complete(client, PLAIN, priority=-1000, stream=True)
            assert streamed.headers["x-elastune-priority"] == "ignored"
            assert "priority" not in worker.seen[-1][0]
            gw.predictor = Predictor()  # type: ignore[assignment]
            await complete(client, PLAIN, priority=-1000)
            assert worker.seen[-1][0]["priority"] == 7  # the gateway's own prediction (SSJF), not -1000
            r = await complete(client, PLAIN)  # none set: nothing to ignore
            assert "x-elastune-priority" not in r.headers and worker.seen[-1][0]["priority"] == 7

    asyncio.run(scenario())


def test_a_key_with_allow_priority_sets_it(redis_server: Any) -> None:
    async def scenario() -> None:
        async with stack(redis_server.url, "required") as (client, worker, gw):
            r = await complete(client, VIP, priority=-1000)
            assert "x-elastune-priority" not in r.headers
            assert worker.seen[-1][0]["priority"] == -1000
            gw.predictor = Predictor()  # type: ignore[assignment]
            await complete(client, VIP, priority=-1000)
            assert worker.seen[-1][0]["priority"] == -1000  # the client's wins over the prediction

    asyncio.run(scenario())


def test_the_worker_learns_the_tenant_from_the_key_and_never_from_the_client(redis_server: Any) -> None:
    async def scenario() -> None:
        async with stack(redis_server.url, "required") as (client, worker, _):
            await complete(client, PLAIN, headers={TENANT_HEADER: "team-a/vip"})
            assert worker.seen[-1][1][TENANT_HEADER] == "team-a/plain"
            await complete(client, VIP)
            assert worker.seen[-1][1][TENANT_HEADER] == "team-a/vip"

    asyncio.run(scenario())


def test_without_authentication_priority_goes_through_and_no_tenant_is_set(redis_server: Any) -> None:
    async def scenario() -> None:
        async with stack(redis_server.url, "off") as (client, worker, _):
            r = await complete(client, None, priority=-1000, headers={TENANT_HEADER: "team-a/vip"})
            assert "x-elastune-priority" not in r.headers
            body, headers = worker.seen[-1]
            assert body["priority"] == -1000 and TENANT_HEADER not in headers

    asyncio.run(scenario())
