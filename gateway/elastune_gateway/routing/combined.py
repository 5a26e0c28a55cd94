"""Elastune's combined policy: prefix reuse, rank cost and queue length scored together.

Neither paper's policy sees the other's cost: E2 ignores LoRA ranks and adapter residency, CaraServe
ignores prefix caches and prefill backlogs. This policy predicts, for each endpoint, the seconds the
request adds to the pool if sent there, from the endpoint's published cost model and the gateway's
global radix tree (``radix.py``, kept exactly as Preble's policy keeps it), and takes the minimum:

    score = w_prefix · (PREFILLTIME(tokens not cached there) + eviction cost M_i, as Preble's Alg. 2)
          + w_rank   · (CaraServe's added per-token latency × predicted output tokens
                        + the request's own decode time at the new batch latency
                        + penalty × TPOT-SLO violations)
          + w_queue  · (time to clear the prefill backlog ahead of it
                        + one average request's decode time per request it must wait behind for a slot)
          + w_load   · adapter load time from the tier the adapter is in there

All terms are seconds, so the default weights are 1. The output length is the gateway's prediction when
there is one (SSJF), else ``default_output_tokens``. Ties go to the earlier endpoint.

Interpretation: this uses the current backlog (what the workers publish now) where E2 uses a history
window; a latency estimate is what an SLO-aware gateway needs, and the prefix term keeps placements
sticky the way E2's exploit does. Not a paper's algorithm: our own, measured in the simulator against
both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .policy import EndpointView, RequestView, RoutingPolicyName, require_endpoints
from .prefix_cache import PrefixCacheModel
from .radix import WINDOW_SECONDS, Match
from .rank_aware import rank_cost


@dataclass(frozen=True, slots=True)
class CombinedConfig:
    w_prefix: float = 1.0
    w_rank: float = 1.0
    w_queue: float = 1.0
    w_load: float = 1.0
    violation_penalty: float = 1000.0
    """Seconds per request whose TPOT SLO would be violated (CaraServe's large penalty)."""
    default_tpot_slo: float | None = None
    default_output_tokens: int = 64
    """Output length when the gateway has no prediction for the request."""
    window_seconds: float = WINDOW_SECONDS
    """W of the radix tree's hit counts (used by the eviction cost)."""
    max_nodes: int = 200_000


@dataclass(frozen=True, slots=True)
class Score:
    prefix: float
    rank: float
    queue: float
    load: float
    total: float


class CombinedRouter:
    name: RoutingPolicyName = "combined"

    def __init__(self, config: CombinedConfig | None = None) -> None:
        self.config = config or CombinedConfig()
        self.caches = PrefixCacheModel(self.config.window_seconds, self.config.max_nodes)
        self.tree = self.caches.tree
        self.last_scores: dict[str, Score] = {}

    def score(self, request: RequestView, e: EndpointView, match: Match, now: float) -> Score:
        c = self.config
        out = request.predicted_output_tokens or c.default_output_tokens
        missed = request.prompt_len - match.cached_on(e.id)
        prefix = e.cost.prefill_seconds(missed, request.rank) + self._eviction_cost(e, missed, match, now)
        rc = rank_cost(request, e, c.violation_penalty, c.default_tpot_slo)
        rank = rc.added_latency * out + rc.iteration_after * out + rc.penalty * rc.violations
        waiting_for_slot = max(0, e.outstanding + 1 - e.max_running)
        queue = e.cost.prefill_token_seconds(e.prefill_pending) + waiting_for_slot * e.cost.decode_seconds(
            out
        )
        load = e.cost.adapter_load_seconds(request.rank, e.adapter_tier(request.adapter))
        total = c.w_prefix * prefix + c.w_rank * rank + c.w_queue * queue + c.w_load * load
        return Score(prefix, rank, queue, load, total)

    def _eviction_cost(self, e: EndpointView, missed: int, match: Match, now: float) -> float:
        need = missed - max(e.kv_capacity_tokens - self.tree.cached_tokens(e.id), 0)
        if need <= 0:
            return 0.0
        return sum(
            e.cost.prefill_seconds(tokens) * self.tree.hits(node, e.id, now)
            for node, tokens in self.tree.eviction_victims(e.id, need, protect=match.nodes())
        )

    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        require_endpoints(endpoints)
        self.caches.observe(endpoints)
        match = self.tree.match(request.tokens)
        self.last_scores = {e.id: self.score(request, e, match, now) for e in endpoints}
        return min(endpoints, key=lambda e: self.last_scores[e.id].total).id

    def on_routed(self, request: RequestView, endpoint: str, now: float) -> None:
        self.caches.routed(request, endpoint, now)

    def on_finished(
        self,
        request: RequestView,
        endpoint: str,
        output_tokens: int,
        now: float,
        output_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.caches.finished(request, endpoint, now, output_token_ids)

    def forget_endpoint(self, endpoint: str, now: float) -> None:
        self.caches.forget(endpoint, now)
