"""How many times a request's ``model`` is resolved on its way gateway → worker → engine (issue 40 item 1):
once at the gateway (``Directory.model``: key's namespace, adapter id, base model, pool, rank), one lookup
by the signed adapter id at the worker (``routes.lookup_adapter``; no name rule: ``adapter_ref.resolve``
is never called), one check of the reference at the engine's admission (``LLMEngine.add_request``).

In one process, over real HTTP and a real Redis: the real gateway (signing each request) in front of the
real worker app (its credential check, the engine's routes, the tiny Llama's engine with an adapter of
namespace team-a loaded), the worker's record published as a worker publishes it.

Fails before issue 40: the worker resolved the name again by its own rule (``resolve``, and with no
namespace header "the only one loaded"), so the walk counted a name resolution at the worker."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("torch")
pytest.importorskip("peft")

from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.protocol import (  # noqa: E402
    AdapterState,
    ServingState,
    WorkerRecord,
    WorkerState,
    pod_worker_id,
)
from elastune_contract.request_credential import namespace_key  # noqa: E402
from elastune_demo import adapters as A  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_gateway.server.app import create_app as gateway_app  # noqa: E402
from elastune_gateway.server.directory import Directory  # noqa: E402
from elastune_gateway.server.service import Gateway  # noqa: E402
from elastune_gateway.server.settings import GatewaySettings  # noqa: E402
from elastune_worker.engine.api import routes  # noqa: E402
from elastune_worker.engine.api.app import create_app as worker_app  # noqa: E402
from elastune_worker.engine.core import adapter_ref  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.frontend.async_engine import AsyncEngine  # noqa: E402
from elastune_worker.engine.frontend.serving_client import EngineServingClient  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.server.request_auth import guard_inference  # noqa: E402

MODEL = "tiny-llama"
NS = "team-a"
SECRET = b"the-gateways-secret-for-the-walk"


def _counting(mp: pytest.MonkeyPatch, calls: Counter[str], owner: Any, name: str, label: str) -> None:
    real = getattr(owner, name, None)

    def counted(*args: Any, **kwargs: Any) -> Any:
        if label != "engine" or kwargs.get("adapter") is not None:  # the engine: adapter requests only
            calls[label] += 1
        return real(*args, **kwargs) if real is not None else None

    mp.setattr(owner, name, counted, raising=False)


def test_one_resolution_one_lookup_by_id_one_admission_check(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTUNE_REQUEST_KEY", SECRET.decode())  # the gateway's signer
    config = EngineConfig(kv_cache_tokens=4096, max_model_len=256, enable_lora=True, max_loras=2)
    engine = AsyncEngine(LLMEngine(B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), config))
    client = EngineServingClient(engine, MODEL)
    worker = worker_app(lambda: client)
    env = {"ELASTUNE_REQUEST_KEY": namespace_key(SECRET, NS).decode(), "POD_NAMESPACE": NS}
    assert guard_inference(worker, environ=env)
    calls: Counter[str] = Counter()

    async def scenario() -> None:
        await client.load_lora("summarizer", str(A.ensure_tiny_adapter(8)), namespace=NS)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(worker, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        prefix = f"walk{time.time_ns()}"
        bus = Bus(redis_server.url, prefix)
        adapters = [AdapterState(name="summarizer", namespace=NS, rank=8, tier="device")]
        bus.publish_worker(
            WorkerRecord(
                id=pod_worker_id(NS, "w0"), pool="tiny", model=MODEL, state=WorkerState.READY,
                url=f"http://127.0.0.1:{port}", started_at=time.time(),
                serving=ServingState(model=MODEL, max_model_len=256, adapters=adapters),
            )
        )  # fmt: skip
        settings = GatewaySettings(redis_url=redis_server.url, namespace=prefix, fair_share=False)
        gw = Gateway(settings, Bus(redis_server.url, prefix))
        await gw.start()
        try:
            transport = httpx.ASGITransport(app=gateway_app(gw))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as http:
                with monkeypatch.context() as mp:
                    _counting(mp, calls, Directory, "model", "gateway")
                    _counting(mp, calls, routes, "lookup_adapter", "worker")
                    _counting(mp, calls, routes, "resolve", "worker_name_rule")
                    _counting(mp, calls, adapter_ref, "resolve", "worker_name_rule")
                    _counting(mp, calls, LLMEngine, "add_request", "engine")
                    body = {"model": "summarizer", "prompt": "12 km →", "max_tokens": 2}
                    r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
        finally:
            await gw.stop()
            server.should_exit = True
            await serving
            bus.close()

    try:
        asyncio.run(scenario())
    finally:
        engine.close()
    assert dict(calls) == {"gateway": 1, "worker": 1, "engine": 1}, dict(calls)
