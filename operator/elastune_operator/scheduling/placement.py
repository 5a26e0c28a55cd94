"""Adapter placement: which serving pods hold which LoRAAdapters, on the device and in host memory.

Pure (no I/O): the control plane feeds it the pods' reported residency and capacities and the adapters'
specs and popularity, and writes each pod's share to the registry, where the worker applies it.

Rules (CaraServe keeps adapters in host memory and loads them to the device on demand; AIBrix users ask
for placement by rank and capacity, #2579, and more than one replica of a popular adapter, #1675):
- Replicas: ``spec.replicas`` when given, else ceil(share of the pool's requests in the window × ready
  pods), at least 1; clamped to the pods whose max rank admits the adapter.
- Order: pinned adapters first, then by popularity (requests per window), then by name (deterministic).
- Pods for an adapter: those already holding it first (a move costs a load), then pods where it keeps
  the device's rank mix cheapest — CaraServe's observation that a high-rank adapter in a batch slows
  the low-rank requests beside it (padded cost ∝ batch × max rank), read here as: prefer the pod whose
  max rank stays lowest with it, then the pod with the most free slots, then by name.
- Tiers: every replica holds a host copy (maxCpuLoras); the device tier (maxLoras) goes to pinned
  adapters and then the most popular, so the engine's LRU starts from the right set. An adapter that
  does not fit a pod's host capacity goes to another pod; one that fits nowhere is reported.
- An adapter in use on a pod (running requests) is never taken from it, even over capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PodView:
    name: str
    max_loras: int
    """Device slots."""
    max_cpu_loras: int
    """Host-memory slots (at least max_loras)."""
    max_lora_rank: int
    device: frozenset[str] = frozenset()
    host: frozenset[str] = frozenset()
    in_use: frozenset[str] = frozenset()
    ready: bool = True


@dataclass(frozen=True)
class AdapterDemand:
    name: str
    rank: int
    """LoRA rank (0 for a soft prompt: it needs no LoRA slot and fits every pod)."""
    replicas: int | None = None
    pinned: bool = False
    requests_per_window: float = 0.0


@dataclass(frozen=True)
class PlacementConfig:
    min_replicas: int = 1


@dataclass
class Placement:
    device: dict[str, set[str]] = field(default_factory=dict)
    """pod -> adapters to keep on the device (each also in host memory)."""
    host: dict[str, set[str]] = field(default_factory=dict)
    """pod -> adapters to keep in host memory (the device ones included)."""
    unplaced: dict[str, str] = field(default_factory=dict)
    """adapter -> why it is on no pod."""

    def pods_of(self, adapter: str) -> list[str]:
        return sorted(pod for pod, names in self.host.items() if adapter in names)


def replicas_wanted(a: AdapterDemand, total_requests: float, pods: int, config: PlacementConfig) -> int:
    if a.replicas is not None:
        return a.replicas
    share = a.requests_per_window / total_requests if total_requests > 0 else 0.0
    return max(config.min_replicas, math.ceil(share * pods))


def place(pods: list[PodView], adapters: list[AdapterDemand], config: PlacementConfig) -> Placement:
    ready = sorted((p for p in pods if p.ready), key=lambda p: p.name)
    out = Placement(
        device={p.name: set() for p in ready},
        host={p.name: set(p.in_use & (p.device | p.host)) for p in ready},
    )
    ranks = {a.name: a.rank for a in adapters}
    order = sorted(adapters, key=lambda a: (not a.pinned, -a.requests_per_window, a.name))
    total = sum(a.requests_per_window for a in adapters)
    for a in order:
        fits = [p for p in ready if a.rank <= p.max_lora_rank and (a.rank == 0 or p.max_loras > 0)]
        if not fits:
            out.unplaced[a.name] = (
                "no ready pod in the pool" if not ready else f"rank {a.rank} is above every pod's maximum"
            )
            continue
        want = min(replicas_wanted(a, total, len(ready), config), len(fits))
        holding = [p for p in fits if a.name in out.host[p.name]]  # in use: stays
        chosen = [p.name for p in holding]

        def preference(p: PodView, name: str = a.name, rank: int = a.rank) -> tuple[int, int, int, str]:
            resident = name in p.device or name in p.host
            mix = max([rank, *(ranks.get(n, 0) for n in out.host[p.name])])
            free = p.max_cpu_loras - len(out.host[p.name])
            return (0 if resident else 1, mix, -free, p.name)

        for p in sorted((p for p in fits if p.name not in chosen), key=preference):
            if len(chosen) >= want:
                break
            if len(out.host[p.name]) < p.max_cpu_loras:
                chosen.append(p.name)
        if not chosen:
            out.unplaced[a.name] = "every pod that admits its rank is full (maxCpuLoras)"
            continue
        for name in chosen:
            out.host[name].add(a.name)
    by_pod = {p.name: p for p in ready}
    for pod, names in out.host.items():  # device tier: pinned, then popular, within maxLoras
        p = by_pod[pod]
        lora = [n for n in (a.name for a in order) if n in names and ranks.get(n, 0) > 0]
        out.device[pod] = set(lora[: p.max_loras]) | (p.in_use & p.device)
    return out
