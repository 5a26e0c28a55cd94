"""One serving endpoint in the simulator: the engine's own scheduler and KV block manager
(``elastune_worker.engine.core``, the objects the worker's engine steps), with the model's forward replaced by
the endpoint's cost model.

An iteration is the engine's step: ``Scheduler.schedule`` picks the chunks (running requests first,
decodes one token, prefills in chunks of at most ``chunk_tokens`` — Preble's 512 — within the token
budget; then waiting requests in the local queue's order while the budget, ``max_running``, the KV
blocks and the adapter slots allow; preemption by recompute when blocks run out). The iteration lasts
``CostModel.iteration_seconds`` of its decode batch (ranks, context) and prefill chunks. At its end the
sequences advance as in the engine (``Scheduler.update`` with the next token of every chunk that
reached its sequence's end; the full blocks enter the prefix cache), and a request that reached its
output length finishes (``Scheduler.finish``: its blocks freed, the full ones kept cached, LRU). A
request whose prompt completes in an iteration emits its first token at that iteration's end. Token ids
of an answer are the workload's (``SimRequest.output_ids``, so a conversation's next turn finds them
cached) or ``FILLER_TOKEN``.

Adapters live in three tiers (CaraServe §3–4, docs/design.md §5): storage → host memory (LRU,
``max_host_adapters``) → device (LRU, ``max_adapters``). Before each iteration, as the engine's async
loading does (``LoRAManager.prefetch``), the adapters of the first ``PREFETCH_HEAD`` waiting requests
start loading (from host or storage, ``CostModel.adapter_load_seconds``) into a free slot or the slot of
a loaded adapter no running request uses; requests whose adapter is not on the device yet are held
(``Scheduler.hold_loras``) while the others go on (S-LoRA-like; CaraServe's CPU-assisted prefill is the
engine's business and not modelled), and the scheduler's ``max_loras`` rule keeps the running adapters
within the slots.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from elastune_gateway.routing.cost import AdapterTier, CostModel
from elastune_gateway.routing.policy import ActiveRequest, EndpointView
from elastune_gateway.routing.priority import CHUNKED_PREFILL_TOKENS, PRIORITY_GROUPS
from elastune_worker.engine.core.adapter_ref import DEFAULT_NAMESPACE, AdapterRef
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from elastune_worker.engine.core.scheduler_config import SchedulerConfig
from elastune_worker.engine.core.sequence import Sequence, Status

from .local_queue import PriorityGroupQueue
from .workloads import SimRequest

LocalQueue = Literal["fcfs", "priority"]
PREFETCH_HEAD = 32
"""Waiting requests whose adapters start loading before a step (the engine's ``waiting_loras(32)``)."""
FILLER_TOKEN = 0
"""The token id of a generated token the workload does not give (only equality matters to the cache)."""


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

    @property
    def num_kv_blocks(self) -> int:
        return max(1, self.kv_cache_tokens // self.block_size)

    def scheduler_config(self, check_invariants: bool = False) -> SchedulerConfig:
        return SchedulerConfig(
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_num_batched_tokens=self.max_batched_tokens,
            max_num_seqs=self.max_running,
            long_prefill_token_threshold=self.chunk_tokens,
            max_loras=self.max_adapters,
            check_invariants=check_invariants,
        )


class _NotReady:
    """The adapters whose requests must wait now: not on the device, or their copy still in flight."""

    def __init__(self, device: OrderedDict[str, float], now: float) -> None:
        self._device, self._now = device, now

    def __contains__(self, name: object) -> bool:
        ready = self._device.get(name) if isinstance(name, str) else None
        return ready is None or ready > self._now


def _decodes(c: ScheduledChunk) -> bool:
    """A decode: one token, the last, of a sequence that has generated before."""
    out = c.seq.output_token_ids
    return c.num_tokens == 1 and bool(out) and c.start + 1 == len(c.seq.prompt_token_ids) + len(out)


def _prefill_left(seq: Sequence) -> int:
    """Tokens it has still to prefill: 0 once it decodes (a preempted one recomputes its output too)."""
    left = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens
    return 0 if left == 1 and seq.output_token_ids else left


class SimEndpoint:
    def __init__(
        self, id: str, spec: EngineSpec, adapter_ranks: dict[str, int] | None = None, check: bool = False
    ) -> None:
        """``check`` asserts the scheduler's invariants after every step (tests)."""
        self.id = id
        self.spec = spec
        self.cost = spec.cost
        self._local: PriorityGroupQueue | None = None
        if spec.queue == "priority":
            self._local = PriorityGroupQueue(self._cached_tokens, spec.priority_groups)
        self.scheduler = Scheduler(
            spec.scheduler_config(check), spec.num_kv_blocks * spec.block_size, queue=self._local
        )
        self.adapter_ranks = dict(adapter_ranks or {})
        self._requests: dict[str, SimRequest] = {}
        """The unfinished requests by id (a sequence's request)."""
        self._active: dict[str, ActiveRequest] = {}
        self.device: OrderedDict[str, float] = OrderedDict()
        """Adapters on the device (LRU order) → the time their load completes."""
        self.host: OrderedDict[str, None] = OrderedDict()
        self.plan: SchedulerOutput | None = None
        """The iteration in progress."""
        self.busy_until: float | None = None
        self.iterations = 0
        self.busy_seconds = 0.0
        self.adapter_loads = 0
        self._view: EndpointView | None = None

    # -- the queue -------------------------------------------------------------------------------------
    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def enqueue(self, req: SimRequest, now: float) -> None:
        """A request routed here."""
        total = math.ceil((req.prompt_len + req.output_tokens) / self.spec.block_size)
        if total > self.spec.num_kv_blocks:
            raise ValueError(
                f"request {req.id} needs {total} KV blocks, more than endpoint {self.id} has "
                f"({self.spec.num_kv_blocks}); raise kv_cache_tokens"
            )
        req.endpoint = self.id
        adapter = None
        if req.adapter is not None:
            adapter = AdapterRef("lora", DEFAULT_NAMESPACE, req.adapter, 0)
            self.adapter_ranks.setdefault(req.adapter, req.rank)
        seq = Sequence(
            req.id,
            list(req.tokens),
            SamplingParams(max_tokens=max(1, req.output_tokens)),
            arrival=req.arrival,
            extra_key=req.adapter,  # the KV of the same tokens differs per adapter
            adapter=adapter,
        )
        self._requests[req.id] = req
        self.scheduler.add(seq)
        self._view = None

    def _cached_tokens(self, seq: Sequence) -> int:
        return self.scheduler.blocks.cached_prefix_tokens(seq)

    # -- adapters --------------------------------------------------------------------------------------
    def _prefetch(self, now: float) -> None:
        """Start loading the adapters the queue's head needs, in queue order, while a slot is free or
        holds an adapter that no running request and no request ahead needs (and is not in flight)."""
        busy = self.scheduler.running_loras()
        for name in dict.fromkeys(self.scheduler.waiting_loras(PREFETCH_HEAD)):
            if name in self.device:
                # Kept for the requests ahead: evicting it for a later one livelocks a full device
                # (each load would evict the adapter the head waits for).
                self.device.move_to_end(name)
                busy.add(name)
                continue
            if len(self.device) >= self.spec.max_adapters:
                victim = next((a for a, t in self.device.items() if a not in busy and t <= now), None)
                if victim is None:
                    return
                del self.device[victim]
            tier: AdapterTier = "host" if name in self.host else "storage"
            self.device[name] = now + self.cost.adapter_load_seconds(self.adapter_ranks.get(name, 0), tier)
            self.host[name] = None
            self.host.move_to_end(name)
            while len(self.host) > self.spec.max_host_adapters:
                self.host.popitem(last=False)
            self.adapter_loads += 1
            self._view = None
            busy.add(name)

    # -- iterations ------------------------------------------------------------------------------------
    def start_iteration(self, now: float) -> tuple[float | None, float | None]:
        """Plan the next iteration at ``now``. Returns (its end, or None when there is nothing to run;
        the earliest time an adapter load completes, for a wake-up when idle)."""
        assert self.plan is None
        if self.adapter_ranks and len(self.scheduler.waiting):
            self._prefetch(now)
            self.scheduler.hold_loras(_NotReady(self.device, now))
        out = self.scheduler.schedule()
        if not out.chunks:
            return None, min((t for t in self.device.values() if t > now), default=None)
        decode_ranks: list[int] = []
        context = prefill = prefill_rank = 0
        for c in out.chunks:
            req = self._requests[c.seq.request_id]
            if req.admitted is None:
                req.admitted = now
                req.cached_tokens = c.seq.num_cached_tokens
                req.service_floor = self._floor(req, req.cached_tokens)
            if _decodes(c):
                decode_ranks.append(req.rank)
                context += c.seq.num_tokens
            else:
                prefill += c.num_tokens
                prefill_rank += c.num_tokens * req.rank
        seconds = self.cost.iteration_seconds(decode_ranks, context, prefill, prefill_rank)
        self.plan = out
        self.busy_until = now + seconds
        self.iterations += 1
        self.busy_seconds += seconds
        self._view = None
        return self.busy_until, None

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
        out = self.plan
        assert out is not None and self.busy_until is not None and abs(self.busy_until - now) < 1e-9
        self.plan = self.busy_until = None
        sampled = {c.seq.request_id: self._next_token(c.seq) for c in out.chunks if c.samples}
        first: list[SimRequest] = []
        done: list[SimRequest] = []
        for seq in self.scheduler.update(out, sampled):
            req = self._requests[seq.request_id]
            if len(seq.output_token_ids) == 1:
                req.first_token = now
                first.append(req)
            if self.scheduler.reached_length(seq):
                self.scheduler.finish(seq, "length")
                del self._requests[seq.request_id]
                self._active.pop(seq.request_id, None)
                if self._local is not None:
                    self._local.forget(seq.request_id)
                req.finished = now
                done.append(req)
        self._view = None
        return first, done

    def _next_token(self, seq: Sequence) -> int:
        answer = self._requests[seq.request_id].output_ids
        i = len(seq.output_token_ids)
        return answer[i] if i < len(answer) else FILLER_TOKEN

    # -- what the worker publishes -----------------------------------------------------------------------
    def _active_request(self, seq: Sequence) -> ActiveRequest:
        left = _prefill_left(seq)
        view = self._active.get(seq.request_id)
        if view is None or view.prefill_left != left:
            r = self._requests[seq.request_id]
            view = self._active[seq.request_id] = ActiveRequest(r.rank, r.adapter, r.tpot_slo, left)
        return view

    def view(self, now: float) -> EndpointView:
        if self._view is None:
            s = self.scheduler
            running = s.running
            waiting = [q for q in s.requests.values() if q.status is Status.WAITING]
            self._view = EndpointView(
                id=self.id,
                num_running=len(running),
                num_waiting=len(waiting),
                kv_usage=s.blocks.usage(),
                kv_capacity_tokens=s.blocks.num_blocks * self.spec.block_size,
                device_adapters=frozenset(self.device),
                host_adapters=frozenset(self.host),
                max_adapters=self.spec.max_adapters,
                max_running=self.spec.max_running,
                context_tokens=sum(q.num_computed_tokens + (_prefill_left(q) == 0) for q in running),
                active=tuple(self._active_request(q) for q in running + waiting),
                cost=self.cost,
            )
        return self._view

    def check(self) -> None:
        self.scheduler.check_blocks()
        assert len(self.running) <= self.spec.max_running
        assert len(self.scheduler.running_loras()) <= self.spec.max_adapters
        assert len(self.device) <= self.spec.max_adapters
        assert set(self._requests) == set(self.scheduler.requests), "every unfinished request scheduled"
