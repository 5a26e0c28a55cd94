"""The global radix tree: matching, inserting (splits), per-endpoint caching, hits in the window W,
LRU eviction from a modelled capacity, pruning and the size bound."""

import random

from routing_helpers import tokens

from elastune_gateway.routing.radix import GlobalRadixTree

A = tokens((1, 100))
AB = A + tokens((2, 50))
AC = A + tokens((3, 30))


def test_insert_match_and_split():
    t = GlobalRadixTree()
    t.insert(AB, "e0", 0.0)
    assert t.num_nodes == 1
    m = t.match(AC)
    assert (m.matched, m.missed, m.cached_on("e0"), m.cached_on("e1")) == (100, 30, 100, 0)
    t.insert(AC, "e1", 1.0)  # splits AB into A (shared) + B
    assert t.num_nodes == 3
    assert t.match(AC).cached_on("e1") == 130
    assert t.match(AC).cached_on("e0") == 100
    assert t.match(AB).cached_on("e1") == 100
    assert t.match(tokens((9, 10))).matched == 0
    assert (t.cached_tokens("e0"), t.cached_tokens("e1")) == (150, 130)
    t.check()


def test_partial_match_inside_a_node_and_key_portion():
    t = GlobalRadixTree()
    t.insert(tokens((1, 10)) + tokens((2, 200)), "e0", 0.0)
    t.insert(tokens((1, 10)) + tokens((3, 5)), "e1", 0.0)  # nodes: [1×10] → [2×200] | [3×5]
    m = t.match(tokens((1, 10)) + tokens((2, 120)) + tokens((7, 3)))
    assert m.matched == 130
    node, n = m.key_portion()
    assert n == 120 and node.endpoints == {"e0"}  # the longest matched node, not the shared root
    assert t.match(()).key_portion() is None


def test_hits_are_counted_per_endpoint_within_the_window():
    t = GlobalRadixTree(window_seconds=10.0)
    for now in (0.0, 5.0, 9.0):
        t.insert(AB, "e0", now)
    t.insert(AB, "e1", 9.0)
    node = t.match(AB).path[0][0]
    assert t.hits(node, "e0", 9.0) == 3
    assert t.hits(node, "e0", 12.0) == 2  # the hit at 0 left the window
    assert t.hits(node, "e1", 12.0) == 1
    assert t.hits(node, "e2", 12.0) == 0


def test_capacity_evicts_least_recently_used_leaves_first_and_parts_of_nodes():
    t = GlobalRadixTree()
    t.insert(AB, "e0", 0.0)  # A(100) + B(50) after the next insert splits them
    t.insert(AC, "e0", 1.0)  # A(100) → B(50), C(30): 180 cached
    assert t.cached_tokens("e0") == 180
    # A new prompt of 60 tokens with capacity 200: 40 tokens must go. B is the LRU leaf: 40 of its
    # 50 tokens are evicted (its tail), 10 stay.
    d = tokens((4, 60))
    t.insert(d, "e0", 2.0, capacity=200)
    assert t.cached_tokens("e0") == 200
    assert t.match(AB).cached_on("e0") == 110
    assert t.match(AC).cached_on("e0") == 130
    t.check()
    # 100 more: the rest of B (10), then C (30), then 60 of A's 100 tokens (A is now a leaf).
    t.insert(tokens((5, 100)), "e0", 3.0, capacity=200)
    assert t.match(AC).cached_on("e0") == 40
    assert t.match(d).cached_on("e0") == 60
    t.check()


def test_eviction_victims_do_not_evict_and_protect_the_request_path():
    t = GlobalRadixTree()
    t.insert(AB, "e0", 0.0)
    t.insert(AC, "e0", 1.0)
    before = t.cached_tokens("e0")
    victims = t.eviction_victims("e0", 60)
    assert [(len(n), k) for n, k in victims] == [(50, 50), (30, 10)]  # B whole, then a part of C
    assert t.cached_tokens("e0") == before
    protect = t.match(AB).nodes()  # A and B are on the request's path
    assert [(len(n), k) for n, k in t.eviction_victims("e0", 60, protect)] == [(30, 30)]


def test_uncached_nodes_are_kept_for_their_window_then_pruned():
    t = GlobalRadixTree(window_seconds=10.0)
    t.insert(AB, "e0", 0.0)
    t.evict("e0", 150, now=1.0)
    assert t.cached_tokens("e0") == 0
    assert t.num_nodes == 1  # hit within the window: kept, but matches nothing
    assert t.match(AB).matched == 0
    assert t.prune(5.0) == 0
    assert t.prune(20.0) == 1
    assert t.num_nodes == 0
    t.check()


def test_remove_endpoint_and_the_size_bound():
    t = GlobalRadixTree(max_nodes=8)
    for i in range(20):
        t.insert((i,) * 5 + (100 + i,) * 5, f"e{i % 3}", float(i))
        assert t.num_nodes <= 8
    t.check()
    t.remove_endpoint("e1", 100.0)
    assert t.cached_tokens("e1") == 0
    assert "e1" not in t.endpoints()
    t.check()


def test_random_operations_keep_the_invariants():
    rng = random.Random(3)
    t = GlobalRadixTree(window_seconds=5.0, max_nodes=60)
    prefixes = [tuple(rng.randrange(5) for _ in range(rng.randint(1, 30))) for _ in range(12)]
    for step in range(400):
        seq = rng.choice(prefixes) + tuple(rng.randrange(5) for _ in range(rng.randint(0, 20)))
        endpoint = f"e{rng.randrange(4)}"
        t.insert(seq, endpoint, step * 0.1, capacity=rng.choice([None, 80, 200]))
        if step % 37 == 0:
            t.evict(f"e{rng.randrange(4)}", rng.randint(1, 50), step * 0.1)
        if step % 50 == 0:
            t.check()
        assert t.num_nodes <= 60
    t.check()


def test_an_inserted_prompt_is_cached_whole_on_its_endpoint_even_at_capacity():
    rng = random.Random(4)
    t = GlobalRadixTree()
    for step in range(200):
        seq = tuple(rng.randrange(3) for _ in range(rng.randint(1, 60)))
        t.insert(seq, "e0", float(step), capacity=100)
        assert t.match(seq).cached_on("e0") == len(seq)
        assert t.cached_tokens("e0") <= 100
    t.check()
