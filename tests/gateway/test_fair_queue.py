"""The VTC fair queue as pure policy: who is served next, the lift of a client back from idleness, the
bounds, and the service shares it gives two clients that both stay backlogged."""

from __future__ import annotations

import pytest

from elastune_gateway.server.fair_queue import FairQueue, LineFull


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (served := q.pop()) is not None:
        out.append(served[1])
    return out


def test_a_light_client_is_served_before_a_flood_that_came_first() -> None:
    q: FairQueue[str] = FairQueue(max_per_client=100, max_total=1000)
    for i in range(10):
        q.push("flood", f"f{i}", cost=10)
    q.pop()  # one flood request served: its counter is 10
    q.push("light", "l0", cost=10)
    assert q.peek() == "light"
    order = drain(q)
    assert order[0] == "l0"
    assert order[1:] == [f"f{i}" for i in range(1, 10)]  # each client's own requests stay in order


def test_backlogged_clients_alternate_by_the_service_they_received() -> None:
    q: FairQueue[str] = FairQueue(max_per_client=100, max_total=1000)
    for i in range(6):
        q.push("a", f"a{i}", cost=10)
        q.push("b", f"b{i}", cost=30)  # b's requests cost three times a's
    order = drain(q)
    # Service, not request count, is shared: a gets three requests for each of b's while both wait.
    assert order[:8] == ["a0", "b0", "a1", "a2", "a3", "b1", "a4", "a5"]


def test_an_idle_client_banks_no_credit() -> None:
    q: FairQueue[str] = FairQueue(max_per_client=100, max_total=1000)
    for i in range(5):
        q.push("busy", f"x{i}", cost=100)
    for _ in range(3):
        q.pop()
    assert q.counter("busy") == 300
    # A client never seen (counter 0) is lifted to the smallest backlogged counter: the two alternate
    # (ties to the shorter queue) rather than the newcomer taking 300 tokens' worth in a row.
    for i in range(4):
        q.push("new", f"n{i}", cost=100)
    assert q.counter("new") == 300
    assert drain(q) == ["x3", "n0", "x4", "n1", "n2", "n3"]


def test_with_nobody_waiting_a_returning_client_is_lifted_to_the_last_served_counter() -> None:
    q: FairQueue[str] = FairQueue(max_per_client=10, max_total=10)
    q.push("a", "a0", cost=50)
    q.pop()
    q.push("b", "b0", cost=5)
    assert q.counter("b") == 50


def test_a_correction_moves_the_counter_both_ways() -> None:
    q: FairQueue[str] = FairQueue(max_per_client=10, max_total=10)
    q.push("a", "a0", cost=q.cost(input_tokens=10, output_tokens=16))
    q.pop()
    assert q.counter("a") == 10 + 2 * 16  # the paper's weights: output tokens count twice
    q.charge("a", q.cost(10, 4) - q.cost(10, 16))  # it produced 4 tokens, not 16
    assert q.counter("a") == 18


def test_bounds_per_client_and_overall() -> None:
    q: FairQueue[str] = FairQueue(max_per_client=2, max_total=3)
    q.push("a", "a0", 1)
    q.push("a", "a1", 1)
    with pytest.raises(LineFull) as info:
        q.push("a", "a2", 1)
    assert info.value.bound == "client" and info.value.limit == 2
    q.push("b", "b0", 1)
    with pytest.raises(LineFull) as info:
        q.push("c", "c0", 1)
    assert info.value.bound == "total"
    assert len(q) == 3 and q.queued("a") == 2


def test_remove_takes_a_waiter_out_unserved() -> None:
    q: FairQueue[str] = FairQueue(max_per_client=5, max_total=5)
    q.push("a", "a0", 1)
    q.push("b", "b0", 1)
    assert q.remove("a", "a0") and not q.remove("a", "a0")
    assert q.queued("a") == 0 and len(q) == 1
    assert q.pop() == ("b", "b0", 1)
    assert q.pop() is None and q.peek() is None
    assert q.counter("a") == 0  # never served: never charged


def test_forget_idle_keeps_clients_above_the_floor() -> None:
    q: FairQueue[str] = FairQueue(max_per_client=5, max_total=5)
    q.push("a", "a0", 10)
    q.push("b", "b0", 50)
    q.pop()
    q.pop()  # a at 10, b at 50: b served last, the floor is 50
    q.push("c", "c0", 5)
    q.pop()  # c lifted to 50, served: 55, the floor
    q.charge("b", 20)  # b's answer was longer than estimated: 70, above the floor
    q.forget_idle()
    assert q.counter("a") == 0  # forgotten: it would be lifted to the floor anyway
    assert q.counter("b") == 70
    q.push("a", "a1", 1)
    assert q.counter("a") == 55


def test_shares_under_sustained_backlog_follow_the_counters() -> None:
    """Two clients refilling their queues for 1000 pops: equal costs give equal service."""
    q: FairQueue[int] = FairQueue(max_per_client=4, max_total=8)
    served = {"heavy": 0, "light": 0}
    for client in served:
        for i in range(4):
            q.push(client, i, cost=7)
    for i in range(1000):
        out = q.pop()
        assert out is not None
        served[out[0]] += 1
        q.push(out[0], i, cost=7)
    assert abs(served["heavy"] - served["light"]) <= 1
