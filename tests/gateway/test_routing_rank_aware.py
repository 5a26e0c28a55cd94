"""CaraServe's rank-aware routing (§5, Alg. 1) with exact picks, on the paper's own toy example (§2.3,
Fig. 5): instance 1 runs 24 requests of rank 32, instance 2 16 of rank 64, TPOT SLO 36 ms, a new
rank-64 request arrives. With the padded kernel (BGMV) it belongs on instance 2; with the unpadded
kernel (MBGMV) on instance 1."""

import pytest
from routing_helpers import batch, caraserve_cost, make_endpoints, make_request

from elastune_gateway.routing.rank_aware import RankAwareConfig, RankAwareRouter, rank_cost

SLO = 0.036


def fig5(kernel: str, **overrides):
    return make_endpoints(
        2,
        cost=caraserve_cost(kernel),
        active={0: batch(*[32] * 24, slo=SLO), 1: batch(*[64] * 16, slo=SLO)},
        num_running={0: 24, 1: 16},
        device_adapters=frozenset({"x", "new"}),
        **overrides,
    )


NEW = make_request("new", adapter="new", rank=64, tpot_slo=SLO)


def test_padded_kernel_sends_the_rank_64_request_to_the_rank_64_batch():
    r = RankAwareRouter()
    assert r.pick(NEW, fig5("padded"), 0.0) == "e1"
    c0, c1 = r.last_costs["e0"], r.last_costs["e1"]
    # e0: 25 × 64 slots → 38.05 ms, every one of its 25 requests over 36 ms; e1: 17 × 64 → 36.05 ms.
    assert c0.iteration_after == pytest.approx(0.03805)
    assert c1.iteration_after == pytest.approx(0.03605)
    assert c0.added_latency == pytest.approx(24 * (0.03805 - 0.0348))
    assert c1.added_latency == pytest.approx(16 * (0.03605 - 0.0358))
    assert (c0.violations, c1.violations) == (25, 17)  # fewer violations win


def test_unpadded_kernel_sends_it_to_the_batch_with_the_lower_rank_sum():
    r = RankAwareRouter()
    assert r.pick(NEW, fig5("unpadded"), 0.0) == "e0"
    c0, c1 = r.last_costs["e0"], r.last_costs["e1"]
    assert c0.iteration_after == pytest.approx(0.03545)  # Σ 832 → within the SLO
    assert c1.iteration_after == pytest.approx(0.03605)  # Σ 1088 → 17 violations
    assert (c0.violations, c1.violations) == (0, 17)


def test_without_violations_the_lower_added_latency_wins():
    # A looser SLO: nobody is violated, so the cost is the latency added to ongoing requests.
    eps = make_endpoints(
        2,
        cost=caraserve_cost("padded"),
        active={0: batch(*[8] * 10), 1: batch(*[64] * 10)},
        device_adapters=frozenset({"new"}),
    )
    req = make_request("new", adapter="new", rank=64, tpot_slo=1.0)
    r = RankAwareRouter()
    # e0: its 10 rank-8 requests get padded to 64: 10 × (11 × 64 − 10 × 8) slots; e1: 10 × 64 slots.
    assert r.pick(req, eps, 0.0) == "e1"
    assert r.last_costs["e0"].added_latency == pytest.approx(10 * (11 * 64 - 80) * 0.001 / 256)
    assert r.last_costs["e1"].added_latency == pytest.approx(10 * 64 * 0.001 / 256)
    low = make_request("low", adapter="new", rank=8, tpot_slo=1.0)
    assert r.pick(low, eps, 0.0) == "e0"  # a rank-8 request pads nothing on e0


def test_penalty_counts_ongoing_and_new_requests_and_the_pool_default_slo():
    e = make_endpoints(1, cost=caraserve_cost("padded"), active=batch(64, 64, slo=0.03) + batch(64))[0]
    req = make_request("n", adapter="x", rank=64)  # no SLO of its own
    c = rank_cost(req, e, penalty=100.0)
    assert c.violations == 2  # the two with a 30 ms SLO; the others have none
    assert c.total == pytest.approx(c.added_latency + 200.0)
    c = rank_cost(req, e, penalty=100.0, default_tpot_slo=0.03)
    assert c.violations == 4  # the pool's SLO applies to the two without one


def test_candidates_hold_or_can_load_the_adapter():
    eps = make_endpoints(
        3,
        cost=caraserve_cost("padded"),
        max_adapters=1,
        device_adapters={0: frozenset({"a"}), 1: frozenset({"b"}), 2: frozenset({"c"})},
        active={0: batch(8, adapter="a"), 1: batch(8, 8, 8, adapter="b"), 2: batch(64, adapter="c")},
    )
    req = make_request("n", adapter="b", rank=8, tpot_slo=1.0)
    r = RankAwareRouter()
    # e0 and e2 cannot load b (their one slot is in use); e1 holds it, though its batch is larger.
    assert r.pick(req, eps, 0.0) == "e1"
    assert set(r.last_costs) == {"e1"}


def test_ties_prefer_the_adapter_on_the_device_then_in_host_memory_then_the_idlest():
    eps = make_endpoints(
        3,
        cost=caraserve_cost("padded"),
        device_adapters={2: frozenset({"n"})},
        host_adapters={1: frozenset({"n"})},
        num_running={0: 0, 1: 0, 2: 3},
    )
    req = make_request("n", adapter="n", rank=16)
    assert RankAwareRouter().pick(req, eps, 0.0) == "e2"  # nothing is added anywhere: e2 holds it
    assert RankAwareRouter().pick(req, eps[:2], 0.0) == "e1"  # in host memory beats storage
    base = make_request("b")
    assert RankAwareRouter().pick(base, eps, 0.0) == "e0"  # a base request: the idlest, first


def test_config_validation():
    with pytest.raises(ValueError):
        RankAwareConfig(violation_penalty=-1.0)
