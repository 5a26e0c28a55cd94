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


def test_a_base_model_two_namespaces_pool_goes_to_the_caller_s_namespace_s_pool() -> None:
    """Two namespaces each have a WarmPool of MODEL: a caller's request goes to its own namespace's pool
    and only that pool's pods; a caller of a namespace with none, to the pool of the lowest id that
    admits it; /v1/models lists the base model only where it resolves."""
    d = Directory(Bus("redis://127.0.0.1:1/0"), 10.0, GatewayMetrics())
    pools = {
        f"{B}/tiny": ServingPoolRecord(
            pool="tiny", model=MODEL, namespace=B, admits=["*"], vouched={f"{B}/tiny-1": "127.0.0.1"}
        ),
        f"{A}/tiny": ServingPoolRecord(
            pool="tiny", model=MODEL, namespace=A, admits=[C], vouched={f"{A}/tiny-1": "127.0.0.1"}
        ),
    }
    workers = {}
    for ns in (A, B):
        w = worker([]).model_copy(update={"id": f"{ns}/tiny-1"})
        workers[w.id] = w

    async def apply() -> None:
        d._apply(workers, pools)

    asyncio.run(apply())
    for ns in (A, B):
        m = d.model(MODEL, ns)
        assert m is not None and (m.namespace, m.pool_key) == (ns, f"{ns}/tiny"), (ns, m)
        assert [e.id for e in d.endpoints(m)] == [f"{ns}/tiny-1"], "only its own pool's pods"
        assert m.id == f"{MODEL}@{ns}/tiny"  # a request waiting for it scales that pool only
    # C has no pool: both admit it; the lowest id is A's.
    c = d.model(MODEL, C)
    assert c is not None and c.pool_key == f"{A}/tiny"
    # D is admitted by B's pool only.
    dm = d.model(MODEL, "team-d")
    assert dm is not None and dm.pool_key == f"{B}/tiny"
    assert [e.id for e in d.endpoints(dm)] == [f"{B}/tiny-1"]
    assert MODEL in d.models("team-d")
    # Without authentication: one tenant, the pool of the lowest id.
    anyone = d.model(MODEL)
    assert anyone is not None and anyone.pool_key == f"{A}/tiny"

    # B's pool is deleted (its record goes): B's callers are not admitted by A's; C's still go to A's.
    del pools[f"{B}/tiny"]

    async def reapply() -> None:
        d._apply({f"{A}/tiny-1": workers[f"{A}/tiny-1"]}, pools)

    asyncio.run(reapply())
    assert d.model(MODEL, B) is None and d.model(MODEL, "team-d") is None
    c = d.model(MODEL, C)
    assert c is not None and c.pool_key == f"{A}/tiny"


def test_a_base_model_is_not_listed_where_no_pool_of_it_admits_the_namespace() -> None:
    d = Directory(Bus("redis://127.0.0.1:1/0"), 10.0, GatewayMetrics())
    pools = {
        f"{ns}/tiny": ServingPoolRecord(
            pool="tiny", model=MODEL, namespace=ns, vouched={f"{ns}/tiny-1": "127.0.0.1"}
        )
        for ns in (A, B)
    }
    workers = {f"{ns}/tiny-1": worker([]).model_copy(update={"id": f"{ns}/tiny-1"}) for ns in (A, B)}

    async def apply() -> None:
        d._apply(workers, pools)

    asyncio.run(apply())
    assert d.model(MODEL, C) is None and MODEL not in d.models(C)
    b = d.model(MODEL, B)
    assert b is not None and [e.id for e in d.endpoints(b)] == [f"{B}/tiny-1"]


def test_a_routing_override_names_one_namespaces_pool_or_every_pool_of_a_name() -> None:
    """--pool-policy team-a/tiny=... applies to that WarmPool only; a bare name to that name's pools in
    every namespace; the namespaced entry wins over the bare one, both over what the pool publishes."""
    from elastune_gateway.server.settings import GatewaySettings

    s = GatewaySettings(
        redis_url="redis://unused", pool_policies={"team-a/tiny": "leastLoad", "tiny": "roundRobin"}
    )
    assert s.policy_for("tiny", "rankAware", "team-a/tiny") == "leastLoad"
    assert s.policy_for("tiny", "rankAware", "team-b/tiny") == "roundRobin"
    assert s.policy_for("other", "rankAware", "team-a/other") == "rankAware"
    assert s.policy_for("other", None, "") == s.default_policy
