"""One serving endpoint in the simulator: a continuous-batching engine modelled by its cost functions.

Each iteration (as in ``worker/elastune_worker/serving/core/scheduler.py``): running requests first — a
decoding request takes one token, a request still prefilling takes a chunk of at most
``chunk_tokens`` (Preble's 512) within the iteration's token budget — then waiting requests are
admitted in the local queue's order (FCFS, or Preble's P = 10 priority groups) while the budget,
``max_running``, the KV cache and the adapter slots allow. The iteration lasts
``CostModel.iteration_seconds`` of its decode batch (ranks, context) and prefill chunks; a request
whose prompt completes in an iteration emits its first token at that iteration's end.

Adapters live in three tiers (CaraServe §3–4, DESIGN.md §5): storage → host memory (LRU,
``max_host_adapters``) → device (LRU, ``max_adapters``). A waiting request whose adapter is not on
the device starts its load (from host or storage, ``CostModel.adapter_load_seconds``) into a free
slot or the slot of an adapter no running request uses, and is skipped until the load completes while
the others go on (S-LoRA-like asynchronous loading; CaraServe's CPU-assisted prefill is the engine's
business and not modelled). A request whose adapter finds no slot is skipped and re-queued (vLLM's
max_loras rule).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from elastune_gateway.routing.cost import AdapterTier, CostModel
from elastune_gateway.routing.policy import ActiveRequest, EndpointView
from elastune_gateway.routing.priority import CHUNKED_PREFILL_TOKENS, PRIORITY_GROUPS, PriorityGroups

from .prefix_cache import PrefixCache, block_hashes
from .workloads import SimRequest

LocalQueue = Literal["fcfs", "priority"]


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One endpoint's engine settings (the WarmPool's serving block) and its performance model."""

    cost: CostModel = field(default_factory=CostModel)
    kv_cache_tokens: int = 65_536
    block_size: int = 16
    max_batched_tokens: int = 2048
    """Token budget of one iteration (decodes + prefill chunks)."""
    chunk_tokens: int = CHUNKED_PREFILL_TOKENS
    """Largest prefill chunk of one request in one iteration (Preble: 512)."""
    max_running: int = 128
    max_adapters: int = 8
    max_host_adapters: int = 10_000
    queue: LocalQueue = "fcfs"
    priority_groups: int = PRIORITY_GROUPS


@dataclass(eq=False, slots=True)
class _Running:
    req: SimRequest
    hashes: list[int]
    """The prompt's full-block hashes."""
    registered: int
    """Leading prompt blocks referenced in the cache (hit at admission, then computed)."""
    private: int
    """Blocks held outside the cache."""
    computed: int
    """Prompt tokens computed (cached ones included)."""
    generated: int = 0
    view: ActiveRequest | None = None

    @property
    def prefill_left(self) -> int:
        return self.req.prompt_len - self.computed

    def active(self) -> ActiveRequest:
        left = self.prefill_left
        if self.view is None or self.view.prefill_left != left:
            r = self.req
            self.view = ActiveRequest(r.rank, r.adapter, r.tpot_slo, left)
        return self.view


@dataclass(slots=True)
class _Plan:
    """What the iteration in progress computes."""

    decode: list[_Running]
    prefill: list[tuple[_Running, int]]
    seconds: float


class SimEndpoint:
    def __init__(self, id: str, spec: EngineSpec, adapter_ranks: dict[str, int] | None = None) -> None:
        self.id = id
        self.spec = spec
        self.cost = spec.cost
        self.cache = PrefixCache(max(1, spec.kv_cache_tokens // spec.block_size), spec.block_size)
        self.adapter_ranks = adapter_ranks or {}
        self.running: list[_Running] = []
        self._fcfs: deque[SimRequest] = deque()
        self._groups: PriorityGroups[SimRequest] = PriorityGroups(spec.priority_groups)
        self._waiting_view: dict[int, ActiveRequest] = {}
        self._queued_cached: dict[int, int] = {}
        """Cached prompt tokens of a queued request when it was queued (its priority group)."""
        self.device: OrderedDict[str, float] = OrderedDict()
        """Adapters on the device (LRU order) → the time their load completes."""
        self.host: OrderedDict[str, None] = OrderedDict()
        self.plan: _Plan | None = None
        self.busy_until: float | None = None
        self.iterations = 0
        self.busy_seconds = 0.0
        self.adapter_loads = 0
        self._view: EndpointView | None = None

    # -- the queue -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._fcfs) if self.spec.queue == "fcfs" else len(self._groups)

    def _waiting(self) -> Iterator[SimRequest]:
        return iter(self._fcfs) if self.spec.queue == "fcfs" else iter(self._groups)

    def enqueue(self, req: SimRequest, now: float) -> None:
        """A request routed here."""
        total = self._blocks_needed(req)
        if total > self.cache.num_blocks:
            raise ValueError(
                f"request {req.id} needs {total} KV blocks, more than endpoint {self.id} has "
                f"({self.cache.num_blocks}); raise kv_cache_tokens"
            )
        req.endpoint = self.id
        if self.spec.queue == "fcfs":
            self._fcfs.append(req)
        else:
            # Preble §4.3: the group of its cached-token fraction here, taken when it is queued.
            hashes = self._hashes(req)
            cached = min(self.cache.cached_prefix(hashes) * self.spec.block_size, req.prompt_len - 1)
            self._queued_cached[id(req)] = cached
            self._groups.push(req, cached, req.prompt_len)
        self._waiting_view[id(req)] = ActiveRequest(req.rank, req.adapter, req.tpot_slo, req.prompt_len)
        self._view = None

    def _hashes(self, req: SimRequest) -> list[int]:
        return block_hashes(req.tokens, self.spec.block_size, salt=req.adapter)

    def _blocks_needed(self, req: SimRequest) -> int:
        return math.ceil((req.prompt_len + req.output_tokens) / self.spec.block_size)

    # -- adapters --------------------------------------------------------------------------------------
    def _adapter_ready(self, req: SimRequest, now: float) -> tuple[bool, float | None]:
        """Whether ``req``'s adapter is usable now; else starts its load when a slot allows and returns
        when it will be ready (None: no slot now)."""
        name = req.adapter
        if name is None:
            return True, None
        ready = self.device.get(name)
        if ready is not None:
            self.device.move_to_end(name)
            return ready <= now, ready
        if len(self.device) >= self.spec.max_adapters:
            busy = {r.req.adapter for r in self.running}
            victim = next((a for a, t in self.device.items() if a not in busy and t <= now), None)
            if victim is None:
                return False, None
            del self.device[victim]
        tier: AdapterTier = "host" if name in self.host else "storage"
        ready = now + self.cost.adapter_load_seconds(req.rank, tier)
        self.device[name] = ready
        self.host[name] = None
        self.host.move_to_end(name)
        while len(self.host) > self.spec.max_host_adapters:
            self.host.popitem(last=False)
        self.adapter_loads += 1
        self._view = None
        return ready <= now, ready

    # -- iterations ------------------------------------------------------------------------------------
    def start_iteration(self, now: float) -> tuple[float | None, float | None]:
        """Plan the next iteration at ``now``. Returns (its end, or None when there is nothing to run;
        the earliest adapter-ready time of a skipped request, for a wake-up when idle)."""
        assert self.plan is None
        budget = self.spec.max_batched_tokens
        decode: list[_Running] = []
        prefill: list[tuple[_Running, int]] = []
        for run in self.running:
            if run.prefill_left == 0:
                decode.append(run)
                budget -= 1
        for run in self.running:
            left = run.prefill_left
            if left > 0 and budget > 0:
                chunk = min(left, self.spec.chunk_tokens, budget)
                prefill.append((run, chunk))
                budget -= chunk
        wake = self._admit(now, budget, prefill)
        if not decode and not prefill:
            return None, wake
        ctx = sum(r.computed + r.generated for r in decode)
        seconds = self.cost.iteration_seconds(
            [r.req.rank for r in decode],
            ctx,
            sum(c for _, c in prefill),
            sum(c * r.req.rank for r, c in prefill),
        )
        self.plan = _Plan(decode, prefill, seconds)
        self.busy_until = now + seconds
        self.iterations += 1
        self.busy_seconds += seconds
        return self.busy_until, wake

    def _admit(self, now: float, budget: int, prefill: list[tuple[_Running, int]]) -> float | None:
        wake: float | None = None
        skipped: list[SimRequest] = []
        admitted_any = False
        while budget > 0 and len(self.running) < self.spec.max_running and self.num_waiting:
            req = self._fcfs[0] if self.spec.queue == "fcfs" else self._groups.peek()
            ready, when = self._adapter_ready(req, now)
            if not ready:
                if when is not None:
                    wake = when if wake is None else min(wake, when)
                skipped.append(self._pop())
                continue
            hashes = self._hashes(req)
            hit = self.cache.admit(hashes, self._blocks_needed(req))
            if hit is None:
                break  # the KV cache is full: the head of the queue waits (no overtaking)
            self._pop()
            cached = min(hit * self.spec.block_size, req.prompt_len - 1)
            run = _Running(
                req, hashes, registered=hit, private=self._blocks_needed(req) - hit, computed=cached
            )
            req.admitted = now
            req.cached_tokens = cached
            req.service_floor = self._floor(req, cached)
            self.running.append(run)
            del self._waiting_view[id(req)]
            self._queued_cached.pop(id(req), None)
            chunk = min(run.prefill_left, self.spec.chunk_tokens, budget)
            prefill.append((run, chunk))
            budget -= chunk
            admitted_any = True
        for req in reversed(skipped):  # back in front, in their order
            if self.spec.queue == "fcfs":
                self._fcfs.appendleft(req)
            else:
                self._groups.push_front(req, self._queued_cached[id(req)], req.prompt_len)
        if admitted_any or skipped:
            self._view = None
        return wake

    def _pop(self) -> SimRequest:
        return self._fcfs.popleft() if self.spec.queue == "fcfs" else self._groups.pop()

    def _floor(self, req: SimRequest, cached: int) -> float:
        """A lower bound of its latency given this cache hit: its prefill chunks alone, then output − 1
        decode iterations alone (any batch only makes an iteration longer)."""
        uncached = req.prompt_len - cached
        chunks, rest = divmod(uncached, self.spec.chunk_tokens)
        prefill = chunks * (
            self.cost.iteration_base + self.cost.prefill_token_seconds(self.spec.chunk_tokens)
        )
        if rest:
            prefill += self.cost.iteration_base + self.cost.prefill_token_seconds(rest)
        decode = (req.output_tokens - 1) * self.cost.decode_iteration((req.rank,))
        return prefill + decode

    def finish_iteration(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """The iteration in progress ended at ``now``: returns (requests that got their first token,
        requests that finished)."""
        plan = self.plan
        assert plan is not None and self.busy_until is not None and abs(self.busy_until - now) < 1e-9
        self.plan = self.busy_until = None
        first: list[SimRequest] = []
        done: list[_Running] = []
        bs = self.spec.block_size
        for run in plan.decode:
            run.generated += 1
            if run.generated >= run.req.output_tokens:
                done.append(run)
        for run, chunk in plan.prefill:
            run.computed += chunk
            full = min(run.computed // bs, len(run.hashes))
            if full > run.registered:
                self.cache.register(run.hashes[run.registered : full])
                run.private -= full - run.registered
                run.registered = full
            if run.prefill_left == 0:
                run.generated = 1
                run.req.first_token = now
                first.append(run.req)
                if run.generated >= run.req.output_tokens:
                    done.append(run)
        for run in done:
            self._release(run)
            run.req.finished = now
        self._view = None
        return first, [r.req for r in done]

    def _release(self, run: _Running) -> None:
        self.running.remove(run)
        req = run.req
        hashes = run.hashes[: run.registered]
        if req.output_ids:
            # The engine keeps the KV of prompt + output: a next turn of the conversation reuses both.
            full = block_hashes(req.tokens + req.output_ids, self.spec.block_size, salt=req.adapter)
            extra = full[run.registered :][: run.private]
            self.cache.register(extra)
            run.private -= len(extra)
            hashes = hashes + extra
        self.cache.release(hashes, run.private)
        run.private = 0

    # -- what the worker publishes -----------------------------------------------------------------------
    def view(self, now: float) -> EndpointView:
        if self._view is None:
            active = tuple(r.active() for r in self.running) + tuple(self._waiting_view.values())
            self._view = EndpointView(
                id=self.id,
                num_running=len(self.running),
                num_waiting=self.num_waiting,
                kv_usage=self.cache.referenced / self.cache.num_blocks,
                kv_capacity_tokens=self.cache.num_blocks * self.spec.block_size,
                device_adapters=frozenset(self.device),
                host_adapters=frozenset(self.host),
                max_adapters=self.spec.max_adapters,
                max_running=self.spec.max_running,
                context_tokens=sum(r.computed + r.generated for r in self.running),
                active=active,
                cost=self.cost,
            )
        return self._view

    def check(self) -> None:
        self.cache.check()
        assert len(self.running) <= self.spec.max_running
        assert len(self.device) <= self.spec.max_adapters
        assert self.cache.private == sum(r.private for r in self.running), "private blocks accounted"
