"""The worker's queue is bounded (issue 25 item 3: bounded queues everywhere, the engine's waiting queue
too): past ``--max-queued-requests`` requests accepted and not yet started, a new one gets an
OpenAI-shaped 503 with ``Retry-After`` instead of an unbounded wait; the places come back when requests
start, so the bound holds again later; a request whose holder is dropped without ever running (a stream
whose client left first) gives its place back too."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.api.admission import QueueBound  # noqa: E402
from elastune_worker.engine.api.app import create_app  # noqa: E402
from elastune_worker.engine.client import EngineBusy  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.frontend.async_engine import AsyncEngine  # noqa: E402
from elastune_worker.engine.frontend.serving_client import EngineServingClient  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[AsyncEngine, EngineServingClient]]:
    config = EngineConfig(kv_cache_tokens=4096, max_num_seqs=1, device="cpu")
    engine = AsyncEngine(LLMEngine(B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), config))
    try:
        yield engine, EngineServingClient(engine, MODEL)
    finally:
        engine.close()


def _body(tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "12 km to m",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def _behind_a_long_request(http: Any, engine: AsyncEngine, bound: QueueBound, n: int) -> list[Any]:
    """One long request running alone (max_num_seqs 1), then ``n`` more at once: the answers of those."""
    long = asyncio.create_task(http.post("/v1/completions", json=_body(600)))
    deadline = time.monotonic() + 30
    while engine.stats().num_requests_running < 1 or bound.queued:  # started, its first output back
        assert time.monotonic() < deadline, "the long request never started"
        await asyncio.sleep(0.005)
    answers = await asyncio.gather(*(http.post("/v1/completions", json=_body(2)) for _ in range(n)))
    assert (await long).status_code == 200
    return list(answers)


def test_past_the_bound_a_request_gets_503_with_retry_after_and_the_places_come_back(
    served: tuple[AsyncEngine, EngineServingClient],
) -> None:
    engine, client = served
    app = create_app(lambda: client, max_queued_requests=2)

    async def main() -> list[list[Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=120) as http:
            return [await _behind_a_long_request(http, engine, app.state.queue, 3) for _ in range(2)]

    for answers in asyncio.run(main()):  # twice: the first round's places were given back
        assert sorted(r.status_code for r in answers) == [200, 200, 503]
        refused = next(r for r in answers if r.status_code == 503)
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert "queue is full" in error["message"] and "--max-queued-requests 2" in error["message"]


def test_a_dropped_request_that_never_ran_gives_its_place_back() -> None:
    bound = QueueBound(1)

    class Holder:
        pass

    holder = Holder()
    ticket = bound.admit(holder)
    with pytest.raises(EngineBusy, match="queue is full"):
        bound.admit(Holder())
    del holder
    gc.collect()
    assert bound.queued == 0
    ticket.release()  # idempotent after the finalizer
    assert bound.queued == 0
    bound.admit(Holder())
    with pytest.raises(ValueError):
        QueueBound(0)
