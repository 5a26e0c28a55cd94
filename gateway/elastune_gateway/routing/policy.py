"""The interface every routing policy implements, and the views of requests and endpoints it reads.

The implementations (``basic.py``, ``preble.py``, ``rank_aware.py``, ``combined.py``) and the factory
that picks one by name (``factory.py``) sit beside this module; this one imports none of them.

A policy sees a request (``RequestView``) and the warm endpoints of its pool (``EndpointView``, one per
worker pod), and answers with an endpoint id. The gateway builds the endpoint views from what workers
publish (their ``/metrics`` — the ``vllm:`` gauges routers already scrape — plus Elastune's load report
and cost model) and from its own ledger of requests it routed; the simulator builds them from its
model of each engine. Stateful policies (round-robin's cursor, Preble's global radix tree and load
history) learn through ``on_routed`` / ``on_finished``; ``pick`` itself changes only cursors and random
state, so a pick that the gateway cannot deliver (the pod went away) may simply be asked again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, get_args

from elastune_contract.api.warmpool import RoutingPolicyName

from .cost import AdapterTier, CostModel

# The typed setting that chooses a pool's routing policy: WarmPool.spec.serving.routingPolicy in the contract.
ROUTING_POLICY_NAMES: tuple[RoutingPolicyName, ...] = get_args(RoutingPolicyName)


class NoEndpointError(LookupError):
    """No endpoint to route to (the pool has no warm pod): the gateway holds the request or answers 503."""


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a policy knows of one request when it routes it."""

    id: str
    tokens: tuple[int, ...] = ()
    """The prompt's token ids (for prefix matching); may be empty when only its length is known."""
    length: int | None = None
    """Prompt length in tokens; None means ``len(tokens)``."""
    adapter: str | None = None
    """The LoRA adapter's id (``protocol.adapter_id``: namespace/name, the name alone for one of no
    namespace), as the gateway resolved the request's ``model`` (``KnownModel.adapter``); None for the
    base model. ``EndpointView``'s adapter sets use the same ids."""
    rank: int = 0
    """The adapter's LoRA rank (0 for the base model): from the resolved model, which has it from the
    worker records and pool record that publish it."""
    predicted_output_tokens: int | None = None
    """Output length predicted by the gateway (SSJF proxy model), or None when there is no prediction."""
    ttft_slo: float | None = None
    """Time-to-first-token SLO in seconds (request header, else the pool's), or None."""
    tpot_slo: float | None = None
    """Time-per-output-token SLO in seconds (request header, else the pool's), or None."""

    def __post_init__(self) -> None:
        if self.length is not None and self.length < len(self.tokens):
            raise ValueError(f"request {self.id}: length {self.length} < {len(self.tokens)} tokens given")
        if self.rank < 0 or (self.adapter is None and self.rank != 0):
            raise ValueError(f"request {self.id}: a rank needs an adapter and must be >= 0")

    @property
    def prompt_len(self) -> int:
        return len(self.tokens) if self.length is None else self.length


@dataclass(frozen=True, slots=True)
class ActiveRequest:
    """One request an endpoint is serving or has queued: what rank-aware costs need of it."""

    rank: int = 0
    """Its adapter's rank (0: base model)."""
    adapter: str | None = None
    tpot_slo: float | None = None
    """Its TPOT SLO in seconds (None: none)."""
    prefill_left: int = 0
    """Prompt tokens not yet computed (0: it is decoding, a decode-phase unit in Preble's terms)."""


@dataclass(frozen=True, slots=True)
class EndpointView:
    """One warm endpoint (worker pod) of the pool, as its worker publishes it.

    Published by the worker (``/metrics`` and the load report): ``num_running`` and ``num_waiting``
    (``vllm:num_requests_running``/``_waiting``), ``kv_usage`` (``vllm:kv_cache_usage_perc``),
    ``kv_capacity_tokens``, ``device_adapters``/``host_adapters``/``max_adapters``
    (``vllm:lora_requests_info`` and ``maxLoras``), ``max_running`` (``max_num_seqs``),
    ``context_tokens`` and ``cost`` (its fitted performance model). ``active`` — rank, adapter, TPOT
    SLO and prefill progress of each running or waiting request — comes from the worker's load report,
    or from the gateway's own ledger of what it routed there (adapter, rank and SLO are the gateway's
    own knowledge; prefill progress then is an estimate).
    """

    id: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of the KV cache in use by running requests (0–1)."""
    kv_capacity_tokens: int = 65_536
    """KV-cache size in tokens: what its prefix cache can hold at most."""
    device_adapters: frozenset[str] = frozenset()
    host_adapters: frozenset[str] = frozenset()
    max_adapters: int = 8
    """Adapters the device holds at once (WarmPool serving.maxLoras)."""
    max_running: int = 128
    """Requests in the running batch at most (the engine's max_num_seqs)."""
    context_tokens: int = 0
    """Tokens in the KV cache of its running requests (what their decode attends to)."""
    active: tuple[ActiveRequest, ...] = ()
    cost: CostModel = field(default_factory=CostModel)

    @property
    def outstanding(self) -> int:
        """Requests running or waiting there."""
        return self.num_running + self.num_waiting

    @property
    def decoding(self) -> int:
        return sum(1 for a in self.active if a.prefill_left == 0)

    @property
    def prefill_pending(self) -> int:
        """Prompt tokens still to compute there (its prefill backlog)."""
        return sum(a.prefill_left for a in self.active)

    def adapter_tier(self, adapter: str | None) -> AdapterTier:
        if adapter is None or adapter in self.device_adapters:
            return "device"
        return "host" if adapter in self.host_adapters else "storage"

    def can_serve_adapter(self, adapter: str | None) -> bool:
        """Holds the adapter on the device, or can load it now: a free slot, or a resident adapter that
        no active request uses (it would be evicted; CaraServe Alg. 1's candidates)."""
        if adapter is None or adapter in self.device_adapters:
            return True
        if len(self.device_adapters) < self.max_adapters:
            return True
        busy = {a.adapter for a in self.active}
        return any(d not in busy for d in self.device_adapters)


class Router(Protocol):
    name: RoutingPolicyName

    def pick(self, request: RequestView, endpoints: Sequence[EndpointView], now: float) -> str:
        """The id of the endpoint ``request`` goes to. ``endpoints`` are the pool's warm ones in a
        stable order (ties go to the earlier one); raises NoEndpointError when there is none."""
        ...

    def on_routed(self, request: RequestView, endpoint: str, now: float) -> None:
        """``request`` was sent to ``endpoint`` at ``now``."""
        ...

    def on_finished(
        self,
        request: RequestView,
        endpoint: str,
        output_tokens: int,
        now: float,
        output_token_ids: tuple[int, ...] = (),
    ) -> None:
        """``request`` finished on ``endpoint`` after generating ``output_tokens`` tokens (their ids when
        the gateway kept them: the engine caches prompt + output, so a next turn can reuse both)."""
        ...


class StatelessRouter:
    """Hooks for policies that learn nothing from routed and finished requests."""

    def on_routed(self, request: RequestView, endpoint: str, now: float) -> None:
        return None

    def on_finished(
        self,
        request: RequestView,
        endpoint: str,
        output_tokens: int,
        now: float,
        output_token_ids: tuple[int, ...] = (),
    ) -> None:
        return None


def require_endpoints(endpoints: Sequence[EndpointView]) -> None:
    if not endpoints:
        raise NoEndpointError("no warm endpoint in the pool")
    ids = [e.id for e in endpoints]
    if len(set(ids)) != len(ids):
        raise ValueError(f"endpoint ids must be unique, got {ids}")


def argmin(endpoints: Sequence[EndpointView], key: dict[str, float] | None = None) -> EndpointView:
    """The endpoint with the lowest ``key[id]``; the earliest one among ties."""
    if key is None:
        return endpoints[0]
    return min(endpoints, key=lambda e: key[e.id])
