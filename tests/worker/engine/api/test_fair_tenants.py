"""The engine's ``fair`` queue policy end to end on the tiny model (issue 25, tenancy): the worker's OpenAI
API takes the tenant from the gateway's ``x-elastune-tenant`` header, the request carries it to the
engine's scheduler, and the VTC queue shares service across tenants: with one request running at a time
(``max_num_seqs`` 1), a tenant that queued a flood does not make another tenant's requests wait behind
all of it, as they do under FCFS. Order of completion is asserted, not timings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from elastune_contract.api_keys import TENANT_HEADER  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.api.app import create_app  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.queue_policy import VTCQueue  # noqa: E402
from elastune_worker.engine.frontend.async_engine import AsyncEngine  # noqa: E402
from elastune_worker.engine.frontend.serving_client import EngineServingClient  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402

MODEL = "tiny-llama"
FLOOD, VICTIMS = 8, 2
FLOOD_TOKENS, VICTIM_TOKENS = 24, 4


@pytest.fixture(scope="module", params=["fair", "fcfs"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, AsyncEngine, EngineServingClient]]:
    config = EngineConfig(kv_cache_tokens=4096, max_num_seqs=1, queue_policy=request.param, device="cpu")
    engine = AsyncEngine(LLMEngine(B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), config))
    try:
        yield request.param, engine, EngineServingClient(engine, MODEL)
    finally:
        engine.close()


def _completion_order(engine: AsyncEngine, client: EngineServingClient) -> list[str]:
    app = create_app(lambda: client)
    done: list[str] = []

    async def one(http: Any, tag: str, tenant: str, tokens: int) -> None:
        body = {"model": MODEL, "prompt": f"{tag}: 198 km to m", "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = await http.post("/v1/completions", json=body, headers={TENANT_HEADER: tenant})
        assert r.status_code == 200, r.text
        done.append(tag)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=120) as http:
            flood = [
                asyncio.create_task(one(http, f"flood{i}", "team-a/flood", FLOOD_TOKENS))
                for i in range(FLOOD)
            ]
            deadline = time.monotonic() + 30
            while engine.stats().num_requests_waiting < FLOOD - 1:  # one runs, the rest wait
                assert time.monotonic() < deadline, "the flood never queued"
                await asyncio.sleep(0.005)
            victims = [
                asyncio.create_task(one(http, f"victim{i}", "team-b/victim", VICTIM_TOKENS))
                for i in range(VICTIMS)
            ]
            await asyncio.gather(*flood, *victims)

    asyncio.run(main())
    return done


def test_a_flooding_tenant_does_not_make_another_wait_behind_all_of_it(
    served: tuple[str, AsyncEngine, EngineServingClient],
) -> None:
    policy, engine, client = served
    order = _completion_order(engine, client)
    victims_at = [i for i, tag in enumerate(order) if tag.startswith("victim")]
    if policy == "fcfs":  # the contrast: arrival order, the victim after the whole flood
        assert victims_at == [FLOOD, FLOOD + 1], order
        return
    # The victim's requests are admitted as soon as its counter (lifted to the flood's on arrival) is the
    # smaller one: right after the flood request that was running when they came, or the one after it
    # on a slow machine; never behind the rest of the flood.
    assert victims_at[-1] <= 3, order
    queue = engine.engine.scheduler.waiting
    assert isinstance(queue, VTCQueue)
    # The tenants reached the scheduler from the header, and were charged what they were served.
    assert set(queue.counters) >= {"team-a/flood", "team-b/victim"}
    assert queue.counter("team-a/flood") > queue.counter("team-b/victim") > 0
