"""Preble's E2 (Alg. 1–2) with exact picks: exploit vs explore, the key portion's holders by load cost,
rebalancing at Th_bal = 1.5 (strictly above), load cost L + M + P with the eviction cost, prefill/decode
balancing, the history window and decode lengths, multi-turn reuse.

Cost model ``EXACT``: PREFILLTIME(n) = n / 1024 s and no decode cost, so every cost is a dyadic
fraction and comparisons at exactly 1.5× are exact."""

from routing_helpers import batch, make_endpoints, make_request, tokens

from elastune_gateway.routing.cost import CostModel
from elastune_gateway.routing.preble import PrebleConfig, PrebleRouter

EXACT = CostModel(iteration_base=0.0, decode_per_seq=0.0, decode_per_kv_token=0.0, prefill_per_token=1 / 1024)
A = tokens((1, 100))


def router(**config) -> PrebleRouter:
    config.setdefault("default_output_tokens", 0)
    return PrebleRouter(PrebleConfig(**config))


def pool(n=3, **overrides):
    overrides.setdefault("cost", EXACT)
    return make_endpoints(n, **overrides)


def route(r: PrebleRouter, rid: str, toks, endpoint: str, now: float = 0.0, **fields):
    req = make_request(rid, toks, **fields)
    r.on_routed(req, endpoint, now)
    return req


def test_exploit_when_matched_outnumbers_missed_else_explore():
    r = router(rebalance=False)
    route(r, "r0", A + tokens((9, 10)), "e1")
    eps = pool()
    # 100 matched > 50 missed: exploit the key portion's holder e1.
    assert r.pick(make_request("r1", A + tokens((2, 50))), eps, 1.0) == "e1"
    assert r.last_decision.kind == "exploit"
    assert (r.last_decision.matched, r.last_decision.missed) == (100, 50)
    # 60 matched = 60 missed: not more, so explore — the least load cost: e0 (idle, 120/1024) before
    # e1 (110/1024 of history + 60/1024 still to compute) and e2 (ties with e0, later).
    req = make_request("r2", tokens((1, 60)) + tokens((5, 60)))
    assert r.pick(req, eps, 1.0) == "e0"
    assert r.last_decision.kind == "explore"
    assert r.last_decision.costs == {"e0": 120 / 1024, "e1": 170 / 1024, "e2": 120 / 1024}


def test_exploit_goes_to_the_holder_with_the_lowest_load_cost():
    r = router(rebalance=False)
    route(r, "a", A + tokens((3, 20)), "e1")
    route(r, "b", A + tokens((4, 20)), "e2")
    route(r, "c", tokens((7, 300)), "e2")  # e2 is busier
    req = make_request("r", A + tokens((5, 30)))
    assert r.pick(req, pool(), 1.0) == "e1"
    assert r.last_decision.costs == {"e1": (120 + 30) / 1024, "e2": (120 + 300 + 30) / 1024}


def test_the_key_portion_is_the_longest_matched_node_not_the_shared_root():
    r = router(rebalance=False)
    route(r, "s0", tokens((1, 10)) + tokens((2, 200)), "e0")  # system prompt + a long tool manual
    route(r, "s1", tokens((1, 10)) + tokens((3, 200)), "e2")  # the same system prompt + another
    req = make_request("q", tokens((1, 10)) + tokens((3, 200)) + tokens((8, 15)))
    assert r.pick(req, pool(), 1.0) == "e2"


def rebalance_case(extra: int) -> PrebleRouter:
    """e0 holds A and has load (100 + extra + 50)/1024; e1 has load 100/1024; e2 absent."""
    r = router()
    route(r, "a", A + tokens((6, 50 + extra)), "e0")
    route(r, "b", tokens((7, 100)), "e1")
    return r


def test_rebalancing_does_not_kick_in_at_exactly_th_bal():
    r = rebalance_case(0)  # 150/1024 = 1.5 × 100/1024: not *more* than 1.5×
    assert r.pick(make_request("q", A + tokens((5, 20))), pool(2), 1.0) == "e0"
    assert r.last_decision.kind == "exploit"


def test_rebalancing_kicks_in_above_th_bal_and_steers_to_the_lightest():
    r = rebalance_case(1)  # 151/1024 > 1.5 × 100/1024
    assert r.pick(make_request("q", A + tokens((5, 20))), pool(2), 1.0) == "e1"
    assert r.last_decision.kind == "rebalance"
    # A higher threshold keeps it where the prefix is.
    r = rebalance_case(1)
    r.config = PrebleConfig(default_output_tokens=0, balance_threshold=2.0)
    assert r.pick(make_request("q", A + tokens((5, 20))), pool(2), 1.0) == "e0"


def test_rebalancing_applies_to_exploit_picks_only():
    r = rebalance_case(100)  # e0 at 2.5× e1
    # A new prompt explores by load cost: e1 (100/1024 + 30/1024) beats e0 (250/1024 + 30/1024).
    assert r.pick(make_request("n", tokens((4, 30))), pool(2), 1.0) == "e1"
    assert r.last_decision.kind == "explore"


def test_eviction_cost_counts_recomputation_times_hits_in_the_window():
    c = tokens((3, 150))
    d = make_request("d", tokens((4, 100)))

    def setup():
        r = router()
        for t in range(4):  # four requests share C on e0: 4 hits, only the first one missed
            route(r, f"c{t}", c, "e0", float(t))
        route(r, "x", tokens((5, 300)), "e1")
        return r

    # e0 holds 150 of its 200 tokens: fitting D's 100 evicts 50 of C, hit 4 times:
    # M = 50/1024 × 4. e0: L 150 + M 200 + P 100 = 450/1024; e1: L 300 + P 100 = 400/1024.
    r = setup()
    assert r.pick(d, pool(2, kv_capacity_tokens={0: 200, 1: 10_000}), 4.0) == "e1"
    assert r.last_decision.costs == {"e0": 450 / 1024, "e1": 400 / 1024}
    # With room for D on e0 nothing is evicted: e0 costs 250/1024 and wins.
    r = setup()
    assert r.pick(d, pool(2, kv_capacity_tokens=10_000), 4.0) == "e0"
    # Hits and history older than the window no longer count: at t = 200 nothing is left of either.
    r = setup()
    assert r.pick(d, pool(2, kv_capacity_tokens={0: 200, 1: 10_000}), 200.0) == "e0"
    assert r.last_decision.costs == {"e0": 100 / 1024, "e1": 100 / 1024}


def test_prefill_decode_balancing_sends_explored_requests_to_a_decode_heavy_endpoint():
    r = router(rebalance=False)
    eps = pool(
        3,
        active={
            0: batch(0, 0, 0, 0, 0, adapter=None),  # ratio 1.0 but only 5 decoding: not heavy
            1: batch(*[0] * 9, adapter=None) + batch(0, adapter=None, prefill_left=400),  # 9 of 10
            2: batch(*[0] * 9, adapter=None) + batch(0, 0, adapter=None, prefill_left=9),  # 9 of 11
        },
    )
    assert r.pick(make_request("n", tokens((4, 30))), eps, 0.0) == "e1"
    assert r.last_decision.kind == "pd-balance"
    # Exploit requests are not redirected by it.
    route(r, "a", A, "e0")
    assert r.pick(make_request("q", A + tokens((5, 5))), eps, 1.0) == "e0"
    assert r.last_decision.kind == "exploit"
    # Turned off: plain load cost.
    r2 = router(pd_balance=False)
    assert r2.pick(make_request("n", tokens((4, 30))), eps, 0.0) == "e0"


def test_load_uses_the_history_window_and_the_average_decode_length():
    cost = CostModel(
        iteration_base=1 / 64, decode_per_seq=0.0, decode_per_kv_token=0.0, prefill_per_token=1 / 1024
    )
    r = router(default_output_tokens=2, history_requests=3)
    eps = pool(1, cost=cost)
    r.pick(make_request("x", ()), eps, 0.0)  # learns e0's cost model
    req = route(r, "a", tokens((1, 64)), "e0", 0.0, predicted_output_tokens=8)
    # PT(64) = 1/64 + 64/1024 = 5/64; DT(8) = 8 iterations × 1/64.
    assert r.load("e0", 1.0) == 13 / 64
    r.on_finished(req, "e0", 4, 2.0)  # the real length replaces the prediction
    assert r.load("e0", 2.0) == 9 / 64
    route(r, "b", tokens((1, 64)), "e0", 3.0)  # fully cached: PT(0) = 0, decode: the average (4)
    assert r.load("e0", 3.0) == 5 / 64 + 2 * 4 / 64
    # The first request left the window (with its known length): b alone, decode length the default.
    assert r.load("e0", 181.0) == 2 / 64
    assert r.load("e0", 400.0) == 0.0
    # At most H = 3 requests count.
    for i in range(5):
        route(r, f"h{i}", tokens((20 + i, 64)), "e0", 500.0 + i)
    assert r.load("e0", 505.0) == 3 * (5 / 64 + 2 / 64)


def test_multi_turn_output_is_reused_by_the_next_turn():
    r = router(rebalance=False)
    first = route(r, "t0", tokens((1, 40)), "e2")
    r.on_finished(first, "e2", 60, 1.0, output_token_ids=tokens((2, 60)))
    nxt = make_request("t1", tokens((1, 40)) + tokens((2, 60)) + tokens((3, 20)))
    assert r.pick(nxt, pool(), 2.0) == "e2"
    assert r.last_decision.matched == 100


def test_a_holder_that_left_the_pool_is_not_exploited():
    r = router(rebalance=False)
    route(r, "a", A, "e1")
    req = make_request("q", A + tokens((5, 5)))
    assert r.pick(req, pool(3)[::2], 1.0) == "e0"  # e1 is not in the pool now
    assert r.last_decision.kind == "explore"
    r.forget_endpoint("e1", 2.0)
    assert r.tree.match(A).matched == 0
    assert r.load("e1", 2.0) == 0.0


def test_decode_heavy_ties_go_to_the_lower_load_cost():
    r = router(rebalance=False)
    route(r, "busy", tokens((6, 300)), "e0")  # e0 carries 300/1024 of recent load
    eps = pool(3, active={0: batch(*[0] * 8, adapter=None), 1: batch(*[0] * 8, adapter=None)})
    assert r.pick(make_request("n", tokens((4, 30))), eps, 1.0) == "e1"  # both at ratio 1.0
    assert r.last_decision.kind == "pd-balance"
    assert set(r.last_decision.costs) == {"e0", "e1"}
