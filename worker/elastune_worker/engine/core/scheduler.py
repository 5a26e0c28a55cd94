"""Iteration-level scheduling with continuous batching and chunked prefill (pure: no torch).

Every step gets a token budget. Running requests go first, in admission order: a decoding request
needs one token, a request still prefilling its prompt the rest of it (or a chunk, when the budget or
``long_prefill_token_threshold`` is smaller). Then waiting requests are admitted in the queue policy's
order while the budget, ``max_num_seqs`` and free KV blocks allow: each first takes the cached blocks of
its longest cached prefix, then blocks for the chunk it computes now.

When a running request needs a block and none is free, the most recently admitted running request is
preempted by recompute (vLLM's policy): its blocks are freed, its computed tokens forgotten, and it
goes back to the front of the waiting queue; its generated tokens are kept and recomputed with the
prompt. A step that preempted admits nobody new. Each step ends asserting its invariants.

With the ``fair`` queue policy (VTC across tenants) the scheduler reports the service each tenant gets:
a request's prompt tokens when it is first admitted (not again after a preemption: the recompute is the
engine's doing), and each output token as it is sampled.

``batching`` picks when waiting requests may join (the three settings the SSJF paper compares):
continuous admits in every step as above; none runs one request at a time; dynamic forms a batch of
up to ``max_num_seqs`` requests only when the running set is empty, and nobody joins it until all of
it has finished (no batch-wait timeout: a batch forms as soon as the engine is idle). A dynamic batch
whose admissions the step's token budget cut short keeps forming in the next steps, so long prompts
do not shrink it; it closes at the first step whose admissions stopped for another reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from elastune_worker.engine.core.block_manager import BlockManager
from elastune_worker.engine.core.queue_policy import RequestQueue, VTCQueue, create_request_queue
from elastune_worker.engine.core.scheduler_config import SchedulerConfig
from elastune_worker.engine.core.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int
    """Position of the chunk's first token (= tokens already computed)."""
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token: its logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler's gauges and counters, as the engine reports them."""

    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    lora_running: dict[str, int]
    """Running requests per LoRA adapter (its key)."""
    lora_waiting: dict[str, int]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, max_model_len: int, queue: RequestQueue | None = None
    ) -> None:
        """``queue`` replaces the waiting queue that ``config.queue_policy`` names (the routing simulator
        brings Preble's priority groups)."""
        self.config = config
        self.max_model_len = max_model_len
        self._steps_checked = 0
        self.blocks = BlockManager(
            config.num_kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.waiting = (
            queue
            if queue is not None  # (an empty queue is falsy)
            else create_request_queue(
                config.queue_policy,
                sjf_max_bypass=config.sjf_max_bypass,
                sjf_max_wait_s=config.sjf_max_wait_s,
            )
        )
        self._fair = self.waiting if isinstance(self.waiting, VTCQueue) else None
        """The waiting queue when it shares service across tenants: told what each request is served."""
        self.running: list[Sequence] = []
        self._batch_forming = False
        """dynamic batching: the current batch still takes requests."""
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._held_loras: Container[str] = frozenset()
        """LoRA adapters whose requests may not start yet (their load is not finished: S-LoRA-like async)."""

    # -- requests -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        max_blocks = -(-self.max_model_len // self.config.block_size)
        if max_blocks > self.blocks.num_blocks:
            raise ValueError(
                f"the KV cache holds {self.blocks.num_blocks} blocks, fewer than one full context needs "
                f"({max_blocks}); raise kv_cache_tokens"
            )
        seq.status = Status.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.push(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Done (stop, length) or aborted: its blocks go back at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.blocks.free_blocks(seq)
        self.requests.pop(seq.request_id, None)

    def reached_length(self, seq: Sequence) -> bool:
        """After a new token: ``seq`` has its ``max_tokens`` or fills the context (finish reason length)."""
        return len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished request with this id, if any."""
        return self.requests.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def adapter_users(self, key: str) -> int:
        """Unfinished requests served with the adapter (LoRA or soft prompt) of this key."""
        return sum(1 for s in self.requests.values() if s.adapter is not None and s.adapter.key == key)

    # -- LoRA adapters ------------------------------------------------------------------------------
    def running_loras(self) -> set[str]:
        """The LoRA adapters of the running requests (an adapter in use keeps its device slot)."""
        return {s.lora for s in self.running if s.lora is not None}

    def waiting_loras(self, head: int) -> list[str]:
        """The LoRA adapters of the first ``head`` waiting requests, in queue order (repeats kept)."""
        return [s.lora for s in itertools.islice(self.waiting, head) if s.lora is not None]

    def hold_loras(self, keys: Container[str]) -> None:
        """Until the next call, requests of these LoRA adapters are not admitted (their load is in
        flight); later requests go ahead."""
        self._held_loras = keys

    # -- counters -----------------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        b = self.blocks
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_cache_usage=b.usage(),
            prefix_cache_queried_tokens=b.queried_tokens,
            prefix_cache_hit_tokens=b.hit_tokens,
            preemptions=self.num_preemptions,
            lora_running=_count_loras(self.running),
            lora_waiting=_count_loras(self.waiting),
        )

    def reset_counters(self) -> None:
        """Forget start-up work (profiling): its cached blocks and the counters."""
        self.blocks.reset_prefix_cache()
        self.blocks.queried_tokens = self.blocks.hit_tokens = 0
        self.num_preemptions = 0

    # -- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        cap = self.config.long_prefill_token_threshold or budget
        scheduled: set[int] = set()
        if not self.running:  # dynamic batching: an idle engine forms a new batch
            self._batch_forming = True
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget, cap)
            while not self.blocks.allocate(seq, n):
                # The victim is the last running request: never one already scheduled this step.
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                scheduled.add(id(seq))
                budget -= n
                i += 1
                continue
            # seq itself was preempted (it was the last running one): nothing more fits this step
            break
        mode = self.config.batching
        limit = 1 if mode == "none" else self.config.max_num_seqs
        if out.preempted:
            self._batch_forming = False
        elif mode != "dynamic" or self._batch_forming:
            skipped: list[Sequence] = []
            loras = self.running_loras() if len(self.waiting) else set()
            while len(self.waiting) and budget > 0 and len(self.running) < limit:
                seq = self.waiting.peek()
                lora = seq.lora  # a soft prompt takes no adapter slot: only LoRAs count
                if lora is not None and (
                    lora in self._held_loras or (lora not in loras and len(loras) >= self.config.max_loras)
                ):
                    # Its adapter would exceed the device's adapter slots (or is still loading): it
                    # waits, later requests go ahead (vLLM's scheduler does the same).
                    skipped.append(self.waiting.pop())
                    continue
                if not seq.block_table:
                    self.blocks.match_prefix(seq)
                    seq.num_cached_tokens = seq.num_computed_tokens
                n = min(seq.num_uncomputed, budget, cap)
                if not self.blocks.allocate(seq, n):
                    self.blocks.free_blocks(seq)  # give the prefix hits back; retry next step
                    seq.num_computed_tokens = 0
                    break
                self.waiting.pop()
                if self._fair is not None and not seq.num_preemptions:
                    self._fair.served(seq, input_tokens=len(seq.prompt_token_ids))
                self.blocks.count_admission(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                if seq.lora is not None:
                    loras.add(seq.lora)
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
            for seq in reversed(skipped):
                self.waiting.push_front(seq)
            # Only the budget may carry a dynamic batch's forming over to the next step.
            self._batch_forming = budget <= 0 and len(self.waiting) > 0 and len(self.running) < limit
        if self.config.check_invariants:
            self._check(out)
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)
        out.preempted.append(seq)

    # -- after the forward --------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Advance each scheduled chunk; append the sampled token of chunks that reached the end.
        Returns the sequences that got a new token."""
        grew = []
        for c in out.chunks:
            seq = c.seq
            seq.num_computed_tokens += c.num_tokens
            self.blocks.register_full_blocks(seq)
            if c.samples:
                seq.output_token_ids.append(sampled[seq.request_id])
                grew.append(seq)
                if self._fair is not None:
                    self._fair.served(seq, output_tokens=1)
        return grew

    # -- invariants ---------------------------------------------------------------------------------
    def _check(self, out: SchedulerOutput) -> None:
        assert out.num_tokens <= self.config.max_num_batched_tokens, "token budget exceeded"
        assert len(self.running) <= self.config.max_num_seqs, "too many running requests"
        assert len(self.running_loras()) <= self.config.max_loras, "more adapters running than device slots"
        assert self.config.batching != "none" or len(self.running) <= 1, "batching none ran a batch"
        ids = [id(c.seq) for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request was scheduled twice"
        for c in out.chunks:
            seq = c.seq
            assert c.num_tokens >= 1 and seq.status is Status.RUNNING
            assert c.start == seq.num_computed_tokens and c.start + c.num_tokens <= seq.num_tokens
            need = -(-(c.start + c.num_tokens) // self.config.block_size)
            assert len(seq.block_table) >= need, "a chunk has no KV slots"
        self._steps_checked += 1
        if not self.running or self._steps_checked % self.config.block_check_interval == 0:
            self.check_blocks()

    def check_blocks(self) -> None:
        """The block manager's invariants over every sequence that holds blocks."""
        self.blocks.check(list(self.running) + [s for s in self.waiting if s.block_table])


def _count_loras(seqs: Iterable[Sequence]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in seqs:
        if s.lora is not None:
            out[s.lora] = out.get(s.lora, 0) + 1
    return out
