"""The simple policies: the baselines both papers compare against.

- ``roundRobin`` and ``leastLoad`` — Preble §5.2's baseline (a load balancer in front of engines with
  their own prefix caches, SGLang/vLLM-like) and the usual Kubernetes defaults.
- ``mostIdle``, ``firstFit``, ``random`` — CaraServe §7.5's baselines for rank-aware routing.

Interpretations (stated intent kept):
- The CaraServe baselines choose among the same candidates as rank-aware routing (endpoints holding the
  adapter or able to load it now, ``EndpointView.can_serve_adapter``), so that the comparison isolates
  the choice; when no endpoint qualifies they choose among all (the engine queues the request until a
  slot frees, as vLLM does with max_loras).
- MostIdle's "least workload" is the fewest requests running or waiting, ties to the earlier endpoint.
- FirstFit (Punica's first-fit bin packing) is the first endpoint, in the pool's stable order, whose
  running batch still has room (outstanding < max_running); when none has room, the most idle one.
- leastLoad is the fewest requests running or waiting, then the lower KV usage (the Gateway API
  Inference Extension's queue and KV scorers), then the earlier endpoint; it ignores adapters.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .policy import EndpointView, RequestView, RoutingPolicyName, StatelessRouter, require_endpoints


def adapter_candidates(request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
    """Endpoints holding the request's adapter or able to load it now; all of them if none can."""
    fit = [e for e in endpoints if e.can_serve_adapter(request.adapter)]
    return fit or list(endpoints)


class RoundRobinRouter(StatelessRouter):
    """Each request to the next endpoint in the pool's order (the cursor wraps; a pool that grew or
    shrank is indexed modulo its new size)."""

    name: RoutingPolicyName = "roundRobin"

    def __init__(self) -> None:
        self._cursor = 0

    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        require_endpoints(endpoints)
        chosen = endpoints[self._cursor % len(endpoints)]
        self._cursor += 1
        return chosen.id


class LeastLoadRouter(StatelessRouter):
    name: RoutingPolicyName = "leastLoad"

    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        require_endpoints(endpoints)
        return min(endpoints, key=lambda e: (e.outstanding, e.kv_usage)).id


class MostIdleRouter(StatelessRouter):
    name: RoutingPolicyName = "mostIdle"

    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        require_endpoints(endpoints)
        return min(adapter_candidates(request, endpoints), key=lambda e: e.outstanding).id


class FirstFitRouter(StatelessRouter):
    name: RoutingPolicyName = "firstFit"

    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        require_endpoints(endpoints)
        candidates = adapter_candidates(request, endpoints)
        for e in candidates:
            if e.outstanding < e.max_running:
                return e.id
        return min(candidates, key=lambda e: e.outstanding).id


@dataclass(frozen=True, slots=True)
class RandomConfig:
    seed: int = 0
    """Seed of the policy's own generator (reproducible picks)."""


class RandomRouter(StatelessRouter):
    name: RoutingPolicyName = "random"

    def __init__(self, config: RandomConfig | None = None) -> None:
        self.config = config or RandomConfig()
        self._rng = random.Random(self.config.seed)

    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        require_endpoints(endpoints)
        return self._rng.choice(adapter_candidates(request, endpoints)).id
