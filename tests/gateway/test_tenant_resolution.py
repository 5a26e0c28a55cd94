"""How the gateway resolves a served name for a caller (issue 25 item 1; the rule is in
``elastune_gateway.server.directory``'s doc): the caller's namespace's adapter first, then the base model of
a pool in or admitting that namespace, then an adapter loaded by hand; never another namespace's adapter.
Without authentication, one tenant: a name two namespaces serve is ambiguous. The directory runs on
records handed to it (the Bus is never connected)."""

from __future__ import annotations

import asyncio

from elastune_common.bus import Bus
from elastune_contract.protocol import (
    AdapterState,
    ServingPoolRecord,
    ServingState,
    WorkerRecord,
    WorkerState,
)
from elastune_gateway.server.directory import Directory
from elastune_gateway.server.metrics import GatewayMetrics

MODEL = "elastune/tiny-llama"
A, B, C = "team-a", "team-b", "team-c"


def worker(held: list[tuple[str, str]]) -> WorkerRecord:
    serving = ServingState(
        model=MODEL, max_model_len=256,
        adapters=[AdapterState(name=n, namespace=ns, rank=8, tier="host") for ns, n in held],
    )  # fmt: skip
    return WorkerRecord(
        id="w1", pool="tiny", model=MODEL, state=WorkerState.READY, url="http://127.0.0.1:9", started_at=1.0,
        serving=serving,
    )  # fmt: skip


def directory(held: list[tuple[str, str]], placed: dict[str, int]) -> Directory:
    d = Directory(Bus("redis://127.0.0.1:1/0"), 10.0, GatewayMetrics())
    pool = ServingPoolRecord(
        pool="tiny", model=MODEL, namespace=A, admits=[B], adapters=placed, vouched={"w1": "127.0.0.1"}
    )

    async def apply() -> None:  # the directory's change event lives on a loop, as in the gateway
        d._apply({"w1": worker(held)}, {"tiny": pool})

    asyncio.run(apply())
    return d


def test_each_namespace_resolves_its_own_adapter_and_only_admitted_base_models() -> None:
    d = directory([(A, "summarizer"), (B, "summarizer"), ("", "by-hand")], {f"{C}/summarizer": 16})
    for ns in (A, B, C):
        m = d.model("summarizer", ns)
        assert m is not None and (m.namespace, m.name, m.parent) == (ns, "summarizer", MODEL), (ns, m)
        assert m.id == f"{ns}/summarizer"
    assert d.model("summarizer", "team-d") is None  # no adapter of its own: never another namespace's
    # The base model: A's pool, admitting B; C is not admitted.
    assert d.model(MODEL, A) is not None and d.model(MODEL, B) is not None
    assert d.model(MODEL, C) is None
    assert set(d.models(C)) == {"summarizer", "by-hand"} and set(d.models(A)) == {
        MODEL,
        "summarizer",
        "by-hand",
    }
    # An adapter loaded by hand (no namespace) is there for every caller, after its own and the base.
    by_hand = d.model("by-hand", C)
    assert by_hand is not None and by_hand.namespace == ""
    # Endpoints: an adapter's are the pods holding that namespace's adapter, not another's of the name.
    mine, placed_only = d.model("summarizer", A), d.model("summarizer", C)
    assert mine is not None and placed_only is not None
    assert [e.id for e in d.endpoints(mine)] == ["w1"]
    assert d.endpoints(placed_only) == []  # placed, not loaded yet: its requests wait


def test_without_authentication_a_name_two_namespaces_serve_is_ambiguous() -> None:
    d = directory([(A, "summarizer"), (B, "summarizer"), (A, "only-a")], {})
    assert d.model("summarizer") is None
    assert d.namespaces_serving("summarizer") == [A, B]
    only = d.model("only-a")
    assert only is not None and only.namespace == A
    assert d.model(MODEL) is not None
    assert "summarizer" not in d.models() and "only-a" in d.models()
