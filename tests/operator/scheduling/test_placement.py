"""Adapter placement (scheduling/placement.py): exact placements from capacities, ranks, pins,
popularity and current residency."""

from __future__ import annotations

from elastune_operator.scheduling.placement import AdapterDemand, PlacementConfig, PodView, place

CFG = PlacementConfig()


def pod(name: str, loras: int = 2, cpu: int = 4, rank: int = 64, **kw: frozenset[str]) -> PodView:
    return PodView(name, loras, cpu, rank, **kw)


def test_one_replica_each_on_the_cheapest_rank_mix_and_device_tier_by_popularity() -> None:
    pods = [pod("a"), pod("b")]
    adapters = [
        AdapterDemand("hi", 64, requests_per_window=1),
        AdapterDemand("lo1", 8, requests_per_window=5),
        AdapterDemand("lo2", 8, requests_per_window=3),
    ]
    p = place(pods, adapters, CFG)
    # Most popular first: lo1 (5 of 9 requests: ceil(5/9 x 2) = 2 replicas) on both; lo2 -> a (ties
    # broken by name); hi goes where more slots are free, b: a's max rank would jump from 8 to 64 either way.
    assert p.host == {"a": {"lo1", "lo2"}, "b": {"lo1", "hi"}}
    assert p.device == {"a": {"lo1", "lo2"}, "b": {"lo1", "hi"}}
    assert p.unplaced == {}


def test_popular_adapters_get_replicas_and_explicit_replicas_win() -> None:
    pods = [pod("a"), pod("b"), pod("c")]
    adapters = [
        AdapterDemand("hot", 8, requests_per_window=90),  # ceil(0.9 x 3) = 3 replicas
        AdapterDemand("cold", 8, requests_per_window=10),  # 1
        AdapterDemand("two", 16, replicas=2),
    ]
    p = place(pods, adapters, CFG)
    assert p.pods_of("hot") == ["a", "b", "c"]
    assert len(p.pods_of("cold")) == 1
    assert len(p.pods_of("two")) == 2


def test_rank_limit_capacity_and_no_pods_are_reported() -> None:
    adapters = [AdapterDemand("big", 128), AdapterDemand("x", 8), AdapterDemand("y", 8)]
    p = place([pod("a", cpu=1, rank=64)], adapters, CFG)
    assert p.host == {"a": {"x"}}
    assert "above every pod's maximum" in p.unplaced["big"]
    assert "full" in p.unplaced["y"]
    assert place([], [AdapterDemand("x", 8)], CFG).unplaced == {"x": "no ready pod in the pool"}


def test_pinned_first_and_residency_is_sticky() -> None:
    pods = [pod("a", loras=1), pod("b", loras=1, host=frozenset({"p"}))]
    adapters = [AdapterDemand("q", 8, requests_per_window=100), AdapterDemand("p", 8, pinned=True)]
    p = place(pods, adapters, CFG)
    assert p.pods_of("p") == ["b"]  # it stays where it is
    assert p.device["b"] == {"p"}  # pinned holds the device slot
    again = place(
        [pod("a", loras=1, host=frozenset(p.host["a"])), pod("b", loras=1, host=frozenset(p.host["b"]))],
        adapters,
        CFG,
    )
    assert again.host == p.host and again.device == p.device  # applied placement: no churn


def test_in_use_adapters_are_never_taken_away() -> None:
    busy = pod("a", loras=1, cpu=1, device=frozenset({"old"}), in_use=frozenset({"old"}))
    p = place([busy], [AdapterDemand("new", 8, requests_per_window=100)], CFG)
    assert "old" in p.host["a"] and "old" in p.device["a"]
    assert "new" in p.unplaced


def test_soft_prompts_need_no_lora_slot() -> None:
    p = place([pod("a", loras=0)], [AdapterDemand("prompt", 0), AdapterDemand("lora", 8)], CFG)
    assert p.host == {"a": {"prompt"}} and p.device == {"a": set()}
    assert "lora" in p.unplaced
