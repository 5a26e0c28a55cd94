"""CaraServe's rank-aware routing ("CaraServe: CPU-Assisted and Rank-Aware LoRA Serving for Generative
LLM Inference", §5, Algorithm 1).

Candidates: the endpoints that hold the request's adapter on the device or can load it now (a free
adapter slot, or a resident adapter no active request uses). For each candidate, the published
performance model (``CostModel.decode_iteration``: a·(batch × max rank) + b padded, a'·Σ ranks + b'
unpadded) predicts the decode-iteration latency of its batch without and with the new request; the
cost is the latency added to every ongoing request, plus a large penalty for each request — the new
one included — whose TPOT SLO the new iteration latency would exceed. The minimum cost wins.

Interpretations (stated intent kept):
- "Ongoing requests" are those running or waiting there (``EndpointView.active``): waiting ones join
  the batch within an iteration or two under continuous batching, so they are part of the batch the new
  request meets. The added latency is per token: Σ over ongoing requests of (t' − t), the growth of each
  one's time per output token (the quantity the TPOT SLO bounds), in seconds.
- A request's TPOT is its batch's decode-iteration latency (CaraServe's model); prefill chunks that
  share iterations are not in it. Context tokens of the batch enter through ``decode_per_kv_token``
  (0 in CaraServe's model; the worker publishes its fitted value).
- A request or active request without a TPOT SLO is never counted as violated; the pool's SLO is
  ``RankAwareConfig.default_tpot_slo``.
- Ties (e.g. idle endpoints, where nothing is added): the adapter already on the device, then in host
  memory, then the fewest outstanding requests, then the earlier endpoint. The paper names no tie-break;
  these avoid a needless adapter load and spread load.
- "GPU memory availability" among the candidate criteria is the adapter slot check; KV space is left
  to the engine's queue (a full KV cache delays admission, it does not refuse the request).
- With no candidate (every adapter slot busy everywhere) all endpoints are costed (the engine queues
  the request until a slot frees, as vLLM does with max_loras).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .basic import adapter_candidates
from .policy import EndpointView, RequestView, RoutingPolicyName, StatelessRouter, require_endpoints

_TIER_ORDER = {"device": 0, "host": 1, "storage": 2}


@dataclass(frozen=True, slots=True)
class RankAwareConfig:
    violation_penalty: float = 1000.0
    """Seconds added to a candidate's cost per request whose TPOT SLO it would violate ("large")."""
    default_tpot_slo: float | None = None
    """TPOT SLO (seconds) for requests that carry none (the pool's serving SLO)."""

    def __post_init__(self) -> None:
        if self.violation_penalty < 0:
            raise ValueError("violation_penalty must be >= 0")


@dataclass(frozen=True, slots=True)
class RankCost:
    added_latency: float
    """Σ over ongoing requests of the growth of their per-token latency (seconds)."""
    violations: int
    """Requests (the new one included) whose TPOT SLO the new iteration latency exceeds."""
    iteration_after: float
    """The predicted decode-iteration latency with the new request."""
    penalty: float

    @property
    def total(self) -> float:
        return self.added_latency + self.penalty * self.violations


def rank_cost(
    request: RequestView, e: EndpointView, penalty: float, default_tpot_slo: float | None = None
) -> RankCost:
    """CaraServe's cost of sending ``request`` to ``e`` (Alg. 1's score)."""
    ranks = [a.rank for a in e.active]
    context = e.context_tokens
    before = e.cost.decode_iteration(ranks, context)
    after = e.cost.decode_iteration([*ranks, request.rank], context + request.prompt_len)
    added = len(ranks) * (after - before)
    slos = [a.tpot_slo for a in e.active] + [request.tpot_slo]
    violations = 0
    for slo in slos:
        slo = default_tpot_slo if slo is None else slo
        if slo is not None and after > slo:
            violations += 1
    return RankCost(added, violations, after, penalty)


class RankAwareRouter(StatelessRouter):
    name: RoutingPolicyName = "rankAware"

    def __init__(self, config: RankAwareConfig | None = None) -> None:
        self.config = config or RankAwareConfig()
        self.last_costs: dict[str, RankCost] = {}

    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        require_endpoints(endpoints)
        candidates = adapter_candidates(request, endpoints)
        self.last_costs = {
            e.id: rank_cost(request, e, self.config.violation_penalty, self.config.default_tpot_slo)
            for e in candidates
        }
        return min(
            candidates,
            key=lambda e: (
                self.last_costs[e.id].total,
                _TIER_ORDER[e.adapter_tier(request.adapter)],
                e.outstanding,
            ),
        ).id
