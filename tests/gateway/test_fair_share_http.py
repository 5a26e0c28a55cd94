"""Fair sharing across API keys (issue 25 item 3) over HTTP: the real gateway (``--auth required``) in
front of one real tiny-Llama worker that runs one request at a time (``--max-num-seqs 1``, which the
worker publishes and the gateway takes as the endpoint's cap), two keys in a real Redis.

A flooding key sends a burst of long requests; while they wait, the other key sends one. With fair
sharing the other key's request is served next (at most the flood's request in flight and one more,
for the tie the lift makes, finish before it); with ``--fair-share off`` the same request waits
behind the whole burst in the engine's FCFS queue (what this test would see without the fair line).
Past the per-key bound the flooder gets 429 with Retry-After, the other key none. Order is asserted,
not timings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from elastune_bench.processes import (  # noqa: E402
    ServiceProcess,
    start_gateway,
    start_worker,
    wait_for_endpoints,
)
from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.api_keys import KeySecret, key_map, publish  # noqa: E402
from elastune_demo import build as B  # noqa: E402

MODEL = "tiny-llama"
NS = "team-a"
FLOOD_KEY, VICTIM_KEY = "sk-flood-0123456789", "sk-victim-0123456789"
BURST = 12
QUEUED_PER_KEY = 8
"""The flood's burst: one in flight, ``QUEUED_PER_KEY`` queued, the rest refused with 429."""
FLOOD_TOKENS = 200


@pytest.fixture(scope="module")
def gateways(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    ns, logs = f"fair{time.time_ns()}", tmp_path_factory.mktemp("fair")
    bus = Bus(redis_server.url, ns)
    procs: list[ServiceProcess] = []
    try:
        secrets = [
            KeySecret(
                namespace=NS,
                name="flood",
                key=FLOOD_KEY,
                models=None,
                requests_per_minute=None,
                tokens_per_minute=None,
            ),
            KeySecret(
                namespace=NS,
                name="victim",
                key=VICTIM_KEY,
                models=None,
                requests_per_minute=None,
                tokens_per_minute=None,
            ),
        ]
        publish(bus.redis, ns, key_map(secrets, {NS: [MODEL]}))
        model = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
        worker_args = ("--max-num-seqs", "1", "--kv-cache-tokens", "4096", "--max-model-len", "256")
        procs.append(start_worker(redis_server.url, ns, "w0", model, MODEL, logs, *worker_args))
        urls = {}
        for mode in ("on", "off"):
            extra = ("--auth", "required", "--fair-share", mode, "--max-queued-per-key", str(QUEUED_PER_KEY))
            g = start_gateway(redis_server.url, ns, Path(logs), *extra)
            procs.append(g)
            wait_for_endpoints(g.url, 1)
            urls[mode] = g.url
        yield urls
        for p in procs:
            assert p.alive(), f"{p.name} crashed:\n{p.log_tail()}"
    finally:
        for p in reversed(procs):
            p.stop()
        bus.close()


async def _request(client: Any, url: str, key: str, tokens: int, tag: str) -> tuple[str, int, float]:
    """(tag, status, monotonic time the answer ended) of one streamed request."""
    body = {"model": MODEL, "prompt": f"{tag}: 198 km to m", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        async for _ in r.aiter_raw():
            pass
        if r.status_code == 429:
            assert 1 <= int(r.headers["Retry-After"]) <= 60
    return tag, r.status_code, time.monotonic()


async def _flood_then_victim(url: str) -> tuple[list[tuple[str, int, float]], float]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        flood = [
            asyncio.create_task(_request(client, url, FLOOD_KEY, FLOOD_TOKENS, f"flood{i}"))
            for i in range(BURST)
        ]
        await asyncio.sleep(0.5)  # the burst reached the gateway: one in flight, the rest queued or refused
        sent = time.monotonic()
        victim = asyncio.create_task(_request(client, url, VICTIM_KEY, 4, "victim"))
        return list(await asyncio.gather(*flood, victim)), sent


def _flood_done_before_victim(results: list[tuple[str, int, float]], sent: float) -> tuple[int, int]:
    """(flood requests that ended after the victim was sent and before its answer ended, flood requests
    still unfinished when it ended)."""
    victim_end = next(end for tag, _, end in results if tag == "victim")
    ok = [end for tag, status, end in results if tag != "victim" and status == 200]
    return sum(sent < end < victim_end for end in ok), sum(end > victim_end for end in ok)


def test_the_other_key_is_served_before_the_flood_it_found_queued(gateways: dict[str, str]) -> None:
    results, sent = asyncio.run(_flood_then_victim(gateways["on"]))
    statuses = {tag: status for tag, status, _ in results}
    assert statuses["victim"] == 200
    refused = [tag for tag, status in statuses.items() if status == 429]
    assert len(refused) == BURST - 1 - QUEUED_PER_KEY, statuses  # the flooder is throttled at its bound
    before, after = _flood_done_before_victim(results, sent)
    assert after >= 3, "the flood was not still queued when the victim's request ended: nothing shown"
    assert before <= 2, f"{before} flood requests were served before the victim's"


def test_without_fair_sharing_the_same_request_waits_behind_the_flood(gateways: dict[str, str]) -> None:
    """The contrast: the gateway forwards everything, the engine serves FCFS, the victim comes last."""
    results, sent = asyncio.run(_flood_then_victim(gateways["off"]))
    statuses = {tag: status for tag, status, _ in results}
    assert set(statuses.values()) == {200}, statuses  # no line, no per-key bound
    before, _ = _flood_done_before_victim(results, sent)
    assert before > 2
