"""Elastune's combined policy: prefix reuse, rank cost and queue length in one score (seconds).

Cost model SIMPLE: PREFILLTIME(n) = 10 ms + n ms, a decode iteration 10 ms; output length 10."""

import pytest
from routing_helpers import batch, caraserve_cost, make_endpoints, make_request, tokens

from elastune_gateway.routing.combined import CombinedConfig, CombinedRouter

A = tokens((1, 100))


def combined(**config) -> CombinedRouter:
    config.setdefault("default_output_tokens", 10)
    return CombinedRouter(CombinedConfig(**config))


def test_prefix_reuse_wins_when_queues_are_empty():
    r = combined()
    r.on_routed(make_request("a", A), "e1", 0.0)
    req = make_request("q", A + tokens((2, 20)))
    assert r.pick(req, make_endpoints(3), 1.0) == "e1"
    s = r.last_scores
    assert s["e1"].prefix == pytest.approx(0.030)  # 20 uncached tokens
    assert s["e0"].prefix == pytest.approx(0.130)  # all 120
    assert s["e1"].rank == pytest.approx(10 * 0.010)  # its own 10 decode iterations
    assert (s["e1"].queue, s["e1"].load) == (0.0, 0.0)
    assert s["e1"].total == pytest.approx(0.130)


def test_a_long_prefill_backlog_spills_the_request_to_another_endpoint():
    r = combined()
    r.on_routed(make_request("a", A), "e1", 0.0)
    req = make_request("q", A + tokens((2, 20)))
    backlog = {1: batch(0, adapter=None, prefill_left=200)}
    assert r.pick(req, make_endpoints(3, active=backlog), 1.0) == "e0"
    assert r.last_scores["e1"].queue == pytest.approx(0.200)
    assert r.last_scores["e1"].total == pytest.approx(0.330)
    assert r.last_scores["e0"].total == pytest.approx(0.230)
    # A smaller backlog keeps it with the cached prefix.
    small = {1: batch(0, adapter=None, prefill_left=50)}
    assert r.pick(req, make_endpoints(3, active=small), 1.0) == "e1"


def test_full_batches_count_a_wait_for_a_slot():
    r = combined()
    eps = make_endpoints(2, max_running=2, num_running={0: 2, 1: 1})
    assert r.pick(make_request("q", tokens((3, 10))), eps, 0.0) == "e1"
    assert r.last_scores["e0"].queue == pytest.approx(10 * 0.010)  # one average request's decode


def test_rank_cost_and_slo_violations_as_rank_aware_routing():
    slo = 0.036
    eps = make_endpoints(
        2,
        cost=caraserve_cost("padded"),
        active={0: batch(*[32] * 24, slo=slo), 1: batch(*[64] * 16, slo=slo)},
        device_adapters=frozenset({"n"}),
    )
    req = make_request("n", adapter="n", rank=64, tpot_slo=slo)
    assert combined().pick(req, eps, 0.0) == "e1"


def test_adapter_load_time_counts():
    eps = make_endpoints(2, device_adapters={1: frozenset({"n"})}, host_adapters={0: frozenset({"n"})})
    req = make_request("n", adapter="n", rank=64)
    r = combined()
    assert r.pick(req, eps, 0.0) == "e1"
    assert r.last_scores["e0"].load == pytest.approx(eps[0].cost.adapter_load_seconds(64, "host"))
    assert combined(w_load=0.0).pick(req, eps, 0.0) == "e0"  # without it: a tie, the earlier one


def test_multi_turn_output_joins_the_tree():
    r = combined()
    first = make_request("t0", tokens((1, 40)))
    r.on_routed(first, "e1", 0.0)
    r.on_finished(first, "e1", 60, 1.0, output_token_ids=tokens((2, 60)))
    assert r.tree.match(tokens((1, 40)) + tokens((2, 60))).cached_on("e1") == 100
    r.forget_endpoint("e1", 2.0)
    assert r.tree.match(tokens((1, 40))).matched == 0
