"""Preble's E2 global scheduler ("Preble: Efficient Distributed Prompt Scheduling for LLM Serving",
§4.2, Algorithms 1 and 2).

Per request: match the prompt in the global radix tree (``radix.py``).
- Exploit when the matched (cached somewhere) tokens outnumber the missed ones: among the endpoints
  caching the key portion — the matched node with the most tokens — the one with the lowest load cost.
  Post-assignment rebalancing: if that endpoint's load is more than Th_bal = 1.5 times the lightest
  endpoint's, the request goes to the lightest one instead (future exploit requests are steered from
  heavy to light; running ones are never moved).
- Explore otherwise: prefill/decode balancing first — an endpoint heavy with decode-phase requests gets
  this (prefill-phase) request — else the lowest load cost over all endpoints.

Load cost (Alg. 2) of endpoint i for request k: L_i + M_i + P_i, in seconds of that endpoint's own
regressions (its published ``CostModel``):
- L_i = Σ over the last H requests routed to i within the window W of PREFILLTIME(their missed tokens
  there) + DECODETIME(the average decode length of those requests);
- M_i = Σ over the nodes i would evict (LRU) to make room for k's missed tokens of
  PREFILLTIME(evicted tokens of the node) × its hits by i within W;
- P_i = PREFILLTIME(k's tokens not cached on i).

Interpretations (stated intent kept; each also marked where it is coded):
- Exploit test: the text's "matched > missed" is used, not Alg. 1's ``missed_len < prompt_len`` (any
  match), which contradicts the text and would exploit a one-token match (docs/design.md §5 agrees).
- M_i charges the recomputation of the evicted tokens, not the whole missed prompt of every request
  hitting them (Alg. 2's loop body); the text's M = PT_j × N_j is what is coded, with N_j the hits within
  W. "Room" is the endpoint's KV capacity minus what the tree believes it caches (``radix.py`` models
  each endpoint's LRU cache from its published capacity, since engines do not report evictions).
- The history is both bounded (the last H requests) and windowed (within W): the text names both.
  The average decode length uses the finished requests' real lengths, else the gateway's predictions,
  else a default (before anything finished).
- Rebalancing compares L_i (the load of Alg. 2's first part, "maintained in the same way"), strictly:
  at exactly Th_bal nothing moves. It applies to exploit picks only, as the paper says. The lightest
  endpoint is the one with the lowest L_i (earliest on ties).
- Prefill/decode balance: DECODERATIO(i) = decode-phase requests / requests there (running or waiting);
  "heavily loaded with decoding" needs the ratio above IMBALR and at least ``decode_heavy_min``
  decode-phase requests (a lone decoding request is not heavy). The highest ratio wins (Alg. 1's
  "return max"); ties — common: every endpoint without a prefill in flight has ratio 1 — go to the
  lowest load cost (Alg. 2), then the earlier endpoint, not to the busiest.
- Not implemented: the second post-assignment adjustment (replicating a prefix and splitting its subtree
  when queueing time doubles over H) — rebalancing already replicates a hot prefix onto the light
  endpoint it steers requests to.
- The local side (P = 10 priority groups, 512-token chunked prefill) is the engine's: ``priority.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .cost import CostModel
from .policy import EndpointView, RequestView, RoutingPolicyName, require_endpoints
from .prefix_cache import PrefixCacheModel
from .radix import WINDOW_SECONDS, Match

BALANCE_THRESHOLD = 1.5
"""Th_bal (docs/design.md §5)."""

DecisionKind = Literal["exploit", "rebalance", "explore", "pd-balance"]


@dataclass(frozen=True, slots=True)
class PrebleConfig:
    window_seconds: float = WINDOW_SECONDS
    """W: hit counts and the load history cover this many seconds (3 min)."""
    history_requests: int = 1000
    """H: at most this many recent requests per endpoint in its load (the paper sets H statically)."""
    balance_threshold: float = BALANCE_THRESHOLD
    """Th_bal: rebalance when the heaviest load is more than this times the lightest."""
    rebalance: bool = True
    decode_ratio_threshold: float = 0.8
    """IMBALR: an endpoint whose share of decode-phase requests is above this is decode-heavy."""
    decode_heavy_min: int = 8
    """… and has at least this many decode-phase requests."""
    pd_balance: bool = True
    default_output_tokens: int = 64
    """Decode length assumed before any request routed to an endpoint has finished or was predicted."""
    max_nodes: int = 200_000
    """Bound on the radix tree's size."""

    def __post_init__(self) -> None:
        if self.window_seconds <= 0 or self.history_requests < 1 or self.balance_threshold < 1.0:
            raise ValueError("window_seconds > 0, history_requests >= 1 and balance_threshold >= 1 needed")


@dataclass(slots=True, eq=False)
class _Routed:
    time: float
    missed: int
    """Prompt tokens it had to compute there (not cached when it was routed)."""
    rank_tokens: int
    """missed × its LoRA rank (the prefill's LoRA term)."""
    decode_tokens: float | None
    expired: bool = False


@dataclass(slots=True)
class _History:
    """One endpoint's last H routed requests within W, with running sums (no rescans per pick).

    Sums of tokens, not seconds: PREFILLTIME is linear (a fixed part per request that computes
    anything, plus per token), so L_i is computed with the endpoint's current cost model."""

    entries: deque[_Routed] = field(default_factory=deque)
    missed: int = 0
    rank_tokens: int = 0
    computing: int = 0
    """Entries with missed > 0 (each pays PREFILLTIME's fixed part)."""
    decode_sum: float = 0.0
    decode_known: int = 0

    def add(self, entry: _Routed) -> None:
        self.entries.append(entry)
        self._count(entry, +1)

    def _count(self, entry: _Routed, sign: int) -> None:
        self.missed += sign * entry.missed
        self.rank_tokens += sign * entry.rank_tokens
        self.computing += sign * (entry.missed > 0)
        if entry.decode_tokens is not None:
            self.decode_sum += sign * entry.decode_tokens
            self.decode_known += sign

    def set_decode(self, entry: _Routed, tokens: float) -> None:
        self._count(entry, -1)
        entry.decode_tokens = tokens
        self._count(entry, +1)

    def expire(self, now: float, window: float, limit: int) -> None:
        while self.entries and (len(self.entries) > limit or self.entries[0].time < now - window):
            old = self.entries.popleft()
            old.expired = True
            self._count(old, -1)
        if not self.entries:  # no float drift from a long run of additions and subtractions
            self.decode_sum = 0.0

    def prefill_seconds(self, cost: CostModel) -> float:
        """Σ PREFILLTIME(missed) over the entries."""
        return self.computing * cost.iteration_base + cost.prefill_token_seconds(
            self.missed, self.rank_tokens
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """Why the last pick went where it went (tests, simulator statistics)."""

    kind: DecisionKind
    endpoint: str
    matched: int
    missed: int
    costs: dict[str, float]
    """LOADCOST of the endpoints compared (empty for pd-balance)."""


class PrebleRouter:
    name: RoutingPolicyName = "preble"

    def __init__(self, config: PrebleConfig | None = None) -> None:
        self.config = config or PrebleConfig()
        self.caches = PrefixCacheModel(self.config.window_seconds, self.config.max_nodes)
        self.tree = self.caches.tree
        self._history: dict[str, _History] = {}
        self._inflight: dict[tuple[str, str], _Routed] = {}
        self._costs: dict[str, CostModel] = {}
        self.last_decision: Decision | None = None
        self.decisions: dict[DecisionKind, int] = {
            "exploit": 0,
            "rebalance": 0,
            "explore": 0,
            "pd-balance": 0,
        }

    # -- Alg. 2 --------------------------------------------------------------------------------------
    def load(self, endpoint: str, now: float) -> float:
        """L_i: the endpoint's recent history load (seconds)."""
        h = self._history.get(endpoint)
        if h is None:
            return 0.0
        h.expire(now, self.config.window_seconds, self.config.history_requests)
        if not h.entries:
            return 0.0
        avg_decode = h.decode_sum / h.decode_known if h.decode_known else self.config.default_output_tokens
        cost = self._costs.get(endpoint, CostModel())
        return h.prefill_seconds(cost) + len(h.entries) * cost.decode_seconds(avg_decode)

    def eviction_cost(self, e: EndpointView, missed: int, match: Match, now: float) -> float:
        """M_i: recomputation of what ``e`` would evict to fit ``missed`` new tokens, × hits in W."""
        free = e.kv_capacity_tokens - self.tree.cached_tokens(e.id)
        need = missed - max(free, 0)
        if need <= 0:
            return 0.0
        total = 0.0
        for node, tokens in self.tree.eviction_victims(e.id, need, protect=match.nodes()):
            # The text's M = PT_j × N_j (recompute the evicted tokens for each request sharing them),
            # not Alg. 2's loop over each hitting request's whole missed prompt.
            total += e.cost.prefill_seconds(tokens) * self.tree.hits(node, e.id, now)
        return total

    def load_cost(self, e: EndpointView, request: RequestView, match: Match, now: float) -> float:
        missed = request.prompt_len - match.cached_on(e.id)
        return (
            self.load(e.id, now) + self.eviction_cost(e, missed, match, now) + e.cost.prefill_seconds(missed)
        )

    # -- Alg. 1 --------------------------------------------------------------------------------------
    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        require_endpoints(endpoints)
        self.caches.observe(endpoints)
        for e in endpoints:
            self._costs[e.id] = e.cost
        match = self.tree.match(request.tokens)
        matched = match.matched
        missed = request.prompt_len - matched
        decision = None
        # The text's test (recomputation saved > new computation), not Alg. 1's "missed < prompt".
        if matched > missed:
            decision = self._exploit(request, endpoints, match, now)
        if decision is None:
            decision = self._explore(request, endpoints, match, now)
        self.last_decision = decision
        self.decisions[decision.kind] += 1
        return decision.endpoint

    def _exploit(
        self, request: RequestView, endpoints: Sequence[EndpointView], match: Match, now: float
    ) -> Decision | None:
        key = match.key_portion()
        assert key is not None
        holders = [e for e in endpoints if e.id in key[0].endpoints]
        if not holders:
            return None  # the key portion's endpoints left the pool: nothing to exploit
        costs = {e.id: self.load_cost(e, request, match, now) for e in holders}
        best = min(holders, key=lambda e: costs[e.id])
        if self.config.rebalance:
            loads = {e.id: self.load(e.id, now) for e in endpoints}
            lightest = min(endpoints, key=lambda e: loads[e.id])
            # Strictly "more than Th_bal times higher" (§4.2): at exactly 1.5× nothing moves.
            if loads[best.id] > self.config.balance_threshold * loads[lightest.id]:
                return Decision("rebalance", lightest.id, match.matched, match.missed, loads)
        return Decision("exploit", best.id, match.matched, match.missed, costs)

    def _explore(
        self, request: RequestView, endpoints: Sequence[EndpointView], match: Match, now: float
    ) -> Decision:
        if self.config.pd_balance:
            heavy = self._decode_heavy(endpoints)
            if heavy:
                costs = {e.id: self.load_cost(e, request, match, now) for e in heavy}
                best = min(heavy, key=lambda e: costs[e.id])
                return Decision("pd-balance", best.id, match.matched, match.missed, costs)
        costs = {e.id: self.load_cost(e, request, match, now) for e in endpoints}
        best = min(endpoints, key=lambda e: costs[e.id])
        return Decision("explore", best.id, match.matched, match.missed, costs)

    def _decode_heavy(self, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        """The endpoints with the highest DECODERATIO above IMBALR (and enough decode-phase requests)."""
        top = self.config.decode_ratio_threshold
        heavy: list[EndpointView] = []
        for e in endpoints:
            active = len(e.active)
            decoding = e.decoding
            if not active or decoding < self.config.decode_heavy_min:
                continue
            ratio = decoding / active
            if ratio > top:
                top, heavy = ratio, [e]
            elif ratio == top and heavy:
                heavy.append(e)
        return heavy

    # -- hooks ---------------------------------------------------------------------------------------
    def on_routed(self, request: RequestView, endpoint: str, now: float) -> None:
        cached = self.tree.match(request.tokens).cached_on(endpoint) if request.tokens else 0
        missed = request.prompt_len - cached
        entry = _Routed(now, missed, missed * request.rank, request.predicted_output_tokens)
        history = self._history.setdefault(endpoint, _History())
        history.add(entry)
        history.expire(now, self.config.window_seconds, self.config.history_requests)
        self._inflight[(request.id, endpoint)] = entry
        self.caches.routed(request, endpoint, now)

    def on_finished(
        self,
        request: RequestView,
        endpoint: str,
        output_tokens: int,
        now: float,
        output_token_ids: tuple[int, ...] = (),
    ) -> None:
        entry = self._inflight.pop((request.id, endpoint), None)
        history = self._history.get(endpoint)
        if entry is not None and history is not None and not entry.expired:
            history.set_decode(entry, output_tokens)
        self.caches.finished(request, endpoint, now, output_token_ids)

    def forget_endpoint(self, endpoint: str, now: float) -> None:
        """The endpoint left the pool: drop what it cached and its history."""
        self.caches.forget(endpoint, now)
        self._history.pop(endpoint, None)
        self._costs.pop(endpoint, None)
