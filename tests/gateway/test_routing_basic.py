"""The simple policies (round-robin, least-load; CaraServe's MostIdle, FirstFit, Random baselines),
the cost model's formulas and the factory, with exact picks."""

import pytest
from routing_helpers import SIMPLE, batch, caraserve_cost, make_endpoints, make_request

from elastune_gateway.routing.basic import (
    FirstFitRouter,
    LeastLoadRouter,
    MostIdleRouter,
    RandomConfig,
    RandomRouter,
    RoundRobinRouter,
)
from elastune_gateway.routing.combined import CombinedConfig, CombinedRouter
from elastune_gateway.routing.cost import CostModel
from elastune_gateway.routing.factory import make_router
from elastune_gateway.routing.policy import ROUTING_POLICY_NAMES, EndpointView, NoEndpointError, RequestView
from elastune_gateway.routing.preble import PrebleConfig, PrebleRouter
from elastune_gateway.routing.rank_aware import RankAwareConfig, RankAwareRouter


def picks(router, endpoints, n, request=None):
    request = request or make_request()
    return [router.pick(request, endpoints, float(t)) for t in range(n)]


# -- round-robin and least-load -----------------------------------------------------------------------------
def test_round_robin_cycles_in_pool_order_and_wraps_when_the_pool_changes():
    rr = RoundRobinRouter()
    assert picks(rr, make_endpoints(3), 7) == ["e0", "e1", "e2", "e0", "e1", "e2", "e0"]
    # The cursor (7) indexes a pool that grew to 4 modulo its new size.
    assert picks(rr, make_endpoints(4), 3) == ["e3", "e0", "e1"]


def test_least_load_counts_running_and_waiting_then_kv_then_order():
    eps = make_endpoints(
        4,
        num_running={0: 3, 1: 1, 2: 2, 3: 1},
        num_waiting={0: 0, 1: 2, 2: 0, 3: 1},
        kv_usage={0: 0.1, 1: 0.5, 2: 0.9, 3: 0.2},
    )
    # Outstanding: 3, 3, 2, 2 → e2 and e3 tie; e3 has the lower KV usage.
    assert LeastLoadRouter().pick(make_request(), eps, 0.0) == "e3"
    tied = make_endpoints(3, num_running=1)
    assert LeastLoadRouter().pick(make_request(), tied, 0.0) == "e0"


def test_no_endpoint_and_duplicate_ids():
    for name in ROUTING_POLICY_NAMES:
        with pytest.raises(NoEndpointError):
            make_router(name).pick(make_request(), [], 0.0)
    with pytest.raises(ValueError, match="unique"):
        RoundRobinRouter().pick(make_request(), [EndpointView("a"), EndpointView("a")], 0.0)


# -- CaraServe's baselines ----------------------------------------------------------------------------------
def lora_pool():
    """e0 busy with 2 adapters in its 2 slots; e1 holds x, 4 outstanding; e2 idle with a free slot."""
    return make_endpoints(
        3,
        max_adapters=2,
        device_adapters={0: frozenset({"a", "b"}), 1: frozenset({"x"}), 2: frozenset()},
        active={0: batch(8, 8, adapter="a") + batch(8, adapter="b"), 1: batch(16, 16, 16, 16, adapter="x")},
        num_running={0: 3, 1: 4, 2: 0},
    )


def test_most_idle_picks_the_least_outstanding_candidate():
    eps = lora_pool()
    req = make_request(adapter="x", rank=16)
    assert MostIdleRouter().pick(req, eps, 0.0) == "e2"
    # e2 gone: e0 cannot load x (both slots used by running requests), so e1 (4 outstanding) wins.
    assert MostIdleRouter().pick(req, eps[:2], 0.0) == "e1"


def test_first_fit_takes_the_first_candidate_with_room():
    eps = make_endpoints(3, max_running=4, num_running={0: 4, 1: 3, 2: 0})
    assert FirstFitRouter().pick(make_request(), eps, 0.0) == "e1"  # e0 is full
    full = make_endpoints(3, max_running=2, num_running={0: 2, 1: 3, 2: 2}, num_waiting={0: 1})
    assert FirstFitRouter().pick(make_request(), full, 0.0) == "e2"  # none has room: the most idle
    # Not a candidate: e1 cannot load the adapter.
    eps = lora_pool()
    assert FirstFitRouter().pick(make_request(adapter="c", rank=8), eps, 0.0) == "e1"


def test_random_is_seeded_and_stays_among_candidates():
    eps = lora_pool()
    req = make_request(adapter="c", rank=8)  # e0 cannot load c
    a = picks(RandomRouter(RandomConfig(seed=7)), eps, 50, req)
    b = picks(RandomRouter(RandomConfig(seed=7)), eps, 50, req)
    assert a == b
    assert set(a) == {"e1", "e2"}
    assert a != picks(RandomRouter(RandomConfig(seed=8)), eps, 50, req)


def test_no_candidate_can_load_the_adapter_falls_back_to_every_endpoint():
    eps = make_endpoints(
        2,
        max_adapters=1,
        device_adapters=frozenset({"a"}),
        active=batch(8, adapter="a"),
        num_running={0: 2, 1: 1},
    )
    assert MostIdleRouter().pick(make_request(adapter="z", rank=8), eps, 0.0) == "e1"


# -- the cost model -----------------------------------------------------------------------------------------
def test_cost_model_formulas():
    c = caraserve_cost("padded")
    assert c.decode_iteration([32] * 24) == pytest.approx(0.0348)
    assert c.decode_iteration([64] * 16) == pytest.approx(0.0358)
    assert c.decode_iteration([8, 64]) == pytest.approx(0.0318 + 2 * 64 * 0.001 / 256)  # padded to 64
    u = caraserve_cost("unpadded")
    assert u.decode_iteration([32] * 24) == pytest.approx(0.0353)
    assert u.decode_iteration([8, 64]) == pytest.approx(0.0335 + 72 * 0.0006 / 256)
    assert c.decode_iteration([0, 0]) == 0.0  # no LoRA in the batch, no base cost in this model
    assert c.decode_iteration([]) == 0.0
    assert SIMPLE.prefill_seconds(0) == 0.0
    assert SIMPLE.prefill_seconds(100) == pytest.approx(0.110)
    assert SIMPLE.decode_seconds(5) == pytest.approx(0.050)
    d = CostModel()
    assert d.adapter_load_seconds(64, "device") == 0.0
    assert d.adapter_load_seconds(64, "host") == pytest.approx(0.002 + 64 * 1.5e-4)
    assert d.adapter_load_seconds(64, "storage") > d.adapter_load_seconds(64, "host")
    assert d.iteration_seconds([], 0, 0) == 0.0
    assert d.iteration_seconds([], 0, 512) == pytest.approx(d.iteration_base + 512 * d.prefill_per_token)
    with pytest.raises(ValueError):
        CostModel(prefill_per_token=-1.0)


def test_request_view_prompt_length():
    assert RequestView("a", (1, 2, 3)).prompt_len == 3
    assert RequestView("a", (), length=40).prompt_len == 40
    with pytest.raises(ValueError):
        RequestView("a", (1, 2), length=1)
    with pytest.raises(ValueError):
        RequestView("a", rank=8)  # a rank without an adapter


# -- the factory --------------------------------------------------------------------------------------------
def test_factory_builds_every_named_policy():
    for name in ROUTING_POLICY_NAMES:
        assert make_router(name).name == name
    assert isinstance(make_router("preble", PrebleConfig(balance_threshold=2.0)), PrebleRouter)
    assert isinstance(make_router("rankAware", RankAwareConfig(violation_penalty=5.0)), RankAwareRouter)
    assert isinstance(make_router("combined", CombinedConfig()), CombinedRouter)
    assert make_router("random", RandomConfig(seed=3)).config.seed == 3  # type: ignore[attr-defined]


def test_factory_rejects_foreign_configs_and_unknown_names():
    with pytest.raises(TypeError, match="PrebleConfig"):
        make_router("preble", RankAwareConfig())
    with pytest.raises(TypeError, match="no config"):
        make_router("roundRobin", PrebleConfig())
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router("fastest")  # type: ignore[arg-type]
