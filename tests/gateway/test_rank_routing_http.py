"""Rank-aware routing on live traffic (issue 40 item 1), real processes: the gateway in front of two
tiny-Llama workers, each holding a rank-8 and a rank-64 adapter (padded LoRA kernel: a·batch·max rank;
each worker profiles its cost at start and publishes it), requests signed for the workers.

Four streamed requests of ranks 8 and 64, each still in flight when the next is routed. Where rank-aware
(CaraServe Alg. 1) sends each follows from the workers' published costs and the ranks it sees: the test
predicts it with the gateway's own policy and views from those records, seeing the ranks and, as before
issue 40, not seeing them (every request the base model), and picks a trace where the two differ and
where least-load's even spread differs too. The live placement must be the one that sees the ranks, and
the gateway's decision log must name each request's adapter and rank.

Fails before the gateway passed the resolved adapter and rank to the policy: rank-aware placed the trace
as if every request were the base model, and its log had no rank."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from elastune_bench.processes import ServiceProcess, start_gateway, start_worker, wait_for_worker
from elastune_common.bus import Bus
from elastune_contract.request_credential import namespace_key
from elastune_demo import adapters as A
from elastune_demo import build as B
from elastune_gateway.routing.policy import RequestView
from elastune_gateway.routing.rank_aware import RankAwareRouter
from elastune_gateway.server.directory import Endpoint
from elastune_gateway.server.ledger import Ledger
from elastune_gateway.server.settings import GatewaySettings
from elastune_gateway.server.views import endpoint_view

MODEL = "tiny-llama"
NS = "team-a"
SECRET = b"the-gateways-secret-for-the-rank-test"


@pytest.fixture(scope="module")
def stack(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("rank")
    (logs / NS).mkdir()  # worker logs are named after their ids (namespace/pod)
    prefix = f"rank{time.time_ns()}"
    mods = [f"r8={A.ensure_tiny_adapter(8)}", f"r64={A.ensure_tiny_adapter(64)}"]
    args = ("--kv-cache-tokens", "4096", "--max-model-len", "256", "--threads", "1", "--engine-threads", "1",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64", "--lora-kernel", "padded",
            "--lora-modules", *mods)  # fmt: skip
    workers: list[ServiceProcess] = []
    gateways: dict[str, ServiceProcess] = {}
    try:
        with pytest.MonkeyPatch.context() as mp:  # pods of team-a with their namespace's request key
            mp.setenv("POD_NAMESPACE", NS)
            mp.setenv("ELASTUNE_REQUEST_KEY", namespace_key(SECRET, NS).decode())
            model = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
            for i in range(2):
                workers.append(
                    start_worker(
                        redis_server.url, prefix, f"{NS}/w{i}", model, MODEL, logs, *args, wait=False
                    )
                )
        for w in workers:
            wait_for_worker(w, redis_server.url, prefix)
        env = {"ELASTUNE_REQUEST_KEY": SECRET.decode()}
        for policy in ("rankAware", "leastLoad"):
            gateways[policy] = start_gateway(
                redis_server.url, prefix, logs, "--policy", policy, "--log-level", "debug", env=env
            )
        yield {"gateways": gateways, "workers": workers, "redis": redis_server.url, "prefix": prefix}
    finally:
        for g in gateways.values():
            g.stop()
        for w in workers:
            w.stop()


def _idle(redis_url: str, prefix: str) -> None:
    """Until both workers publish an empty queue (the last trace's requests are done everywhere)."""
    bus = Bus(redis_url, prefix)
    try:
        deadline = time.monotonic() + 60
        while True:
            recs = [r for r in bus.workers().values() if r.serving is not None]
            if len(recs) == 2 and all(r.serving.running + r.serving.waiting == 0 for r in recs):  # type: ignore[union-attr]
                # The gateways re-read the registry every 0.25 s and expose no read time to wait on: two
                # periods, so their view is this one too (not the last trace's queues).
                time.sleep(2 * GatewaySettings.model_fields["refresh_s"].default)
                return
            assert time.monotonic() < deadline, "the workers never went idle"
            time.sleep(0.2)
    finally:
        bus.close()


async def _send_trace(url: str, trace: tuple[str, ...]) -> list[str]:
    """The endpoint of each request of ``trace``, each sent once the one before was routed (its answer
    began) and while all before it are still streaming."""
    endpoints: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        open_: list[httpx.Response] = []
        try:
            for i, model in enumerate(trace):
                body = {"model": model, "prompt": f"{i} km →", "max_tokens": 200, "temperature": 0,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                r = await client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
                assert r.status_code == 200, (await r.aread())[:300]
                endpoints.append(r.headers["x-elastune-endpoint"])
                open_.append(r)
            for r in open_:  # all were in flight together; now let them finish
                await r.aread()
        finally:
            for r in open_:
                await r.aclose()
    return endpoints


def _split(endpoints: list[str]) -> list[int]:
    """How many requests each of the two workers got, fewest first."""
    return sorted([*Counter(endpoints).values(), 0])[-2:]


def _published(redis_url: str, prefix: str) -> list[Endpoint]:
    bus = Bus(redis_url, prefix)
    try:
        recs = sorted(bus.workers().values(), key=lambda r: r.id)
        return [Endpoint(r.id, r.pool, r.url, r.started_at, r.serving) for r in recs if r.serving is not None]
    finally:
        bus.close()


def _predict(endpoints: list[Endpoint], trace: tuple[str, ...], *, seen: bool) -> list[str]:
    """Where the gateway's rank-aware policy sends each request of ``trace`` (all in flight together),
    from the published records; ``seen`` False: as the gateway did before issue 40 (no adapter, rank 0)."""
    router, ledger = RankAwareRouter(), Ledger()
    out = []
    for i, name in enumerate(trace):
        view = RequestView(str(i), adapter=name if seen else None, rank=int(name[1:]) if seen else 0)
        chosen = router.pick(view, [endpoint_view(e, ledger) for e in endpoints], 0.0)
        ledger.add(view, chosen)
        out.append(chosen)
    return out


def _discriminating(endpoints: list[Endpoint]) -> tuple[tuple[str, ...], list[str]]:
    """A trace whose rank-aware placement differs from the rank-blind one and from an even spread (what
    least-load does), with that placement; fails when the published costs make none (no LoRA cost)."""
    for trace in itertools.product(("r64", "r8"), repeat=4):
        want = _predict(endpoints, trace, seen=True)
        if want != _predict(endpoints, trace, seen=False) and _split(want) != [2, 2]:
            return trace, want
    raise AssertionError(
        f"no trace tells ranks apart under these costs: {[e.serving.cost for e in endpoints]}"
    )


def test_rank_aware_places_by_rank_where_least_load_spreads(stack: dict[str, Any]) -> None:
    redis, prefix = stack["redis"], stack["prefix"]
    _idle(redis, prefix)
    endpoints = _published(redis, prefix)
    trace, want = _discriminating(endpoints)
    blind = _predict(endpoints, trace, seen=False)
    rank = asyncio.run(_send_trace(stack["gateways"]["rankAware"].url, trace))
    assert rank == want, f"trace {trace}: rank-aware placed {rank}, seeing ranks {want}, blind {blind}"
    _idle(redis, prefix)
    least = asyncio.run(_send_trace(stack["gateways"]["leastLoad"].url, trace))
    assert _split(least) == [2, 2] and rank != least, (trace, least, rank)


def test_the_decision_log_says_the_adapter_and_rank_the_policy_saw(stack: dict[str, Any]) -> None:
    log = stack["gateways"]["rankAware"].log.read_text(errors="replace")
    seen = re.findall(r"routed \S+ \(adapter (\S+), rank (\d+)\) to (\S+) by rankAware", log)
    assert {(a, int(r)) for a, r, _ in seen} >= {("r8", 8), ("r64", 64)}, log[-2000:]
