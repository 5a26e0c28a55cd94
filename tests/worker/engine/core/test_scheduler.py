"""The engine's scheduler, pure (no torch): exact orders, token counts, chunking, preemption."""

from __future__ import annotations

import pytest

from elastune_worker.engine.core.adapter_ref import AdapterRef
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.core.scheduler import Scheduler, SchedulerOutput
from elastune_worker.engine.core.scheduler_config import SchedulerConfig
from elastune_worker.engine.core.sequence import Sequence, Status


def make_scheduler(max_model_len: int = 64, **config: object) -> Scheduler:
    defaults: dict[str, object] = {"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 16}
    return Scheduler(SchedulerConfig(**{**defaults, **config}), max_model_len)  # type: ignore[arg-type]


def make_requests(*lengths: int, max_tokens: int = 4, priority: int = 0, base: int = 0) -> list[Sequence]:
    """Requests r0, r1, ... with prompts of the given lengths (distinct tokens: no shared prefixes)."""
    return [
        Sequence(f"r{base + i}", [100 * (base + i) + t for t in range(n)],
                 SamplingParams(max_tokens=max_tokens), arrival=float(base + i), priority=priority)
        for i, n in enumerate(lengths)
    ]  # fmt: skip


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def run_step(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """Pretend the model ran: every chunk that reached its end samples ``token``."""
    s.update(out, {c.seq.request_id: token for c in out.chunks if c.samples})


def test_prefills_are_admitted_in_order_under_the_budget_then_chunked():
    s = make_scheduler()
    for r in make_requests(6, 5, 9):
        s.add(r)
    out = s.schedule()
    assert plan(out) == [("r0", 0, 6), ("r1", 0, 5), ("r2", 0, 5)]  # 16 tokens: r2 gets a 5-token chunk
    assert [c.samples for c in out.chunks] == [True, True, False]
    run_step(s, out)
    out = s.schedule()
    # decodes first (r0, r1), then the rest of r2's prompt
    assert plan(out) == [("r0", 6, 1), ("r1", 5, 1), ("r2", 5, 4)]


def test_decodes_go_before_new_prefills_and_max_num_seqs_holds():
    s = make_scheduler(max_num_seqs=2)
    for r in make_requests(3, 3, 3):
        s.add(r)
    out = s.schedule()
    assert plan(out) == [("r0", 0, 3), ("r1", 0, 3)]  # r2 waits: two running at most
    run_step(s, out)
    assert plan(s.schedule()) == [("r0", 3, 1), ("r1", 3, 1)]


def test_long_prefill_threshold_caps_a_chunk():
    s = make_scheduler(long_prefill_token_threshold=4)
    for r in make_requests(10, 2):
        s.add(r)
    assert plan(s.schedule()) == [("r0", 0, 4), ("r1", 0, 2)]


def test_priority_queue_admits_lower_priority_values_first():
    s = make_scheduler(queue_policy="priority", max_num_batched_tokens=4)
    late_urgent = make_requests(4, priority=-1, base=5)
    for r in [*make_requests(4, 4), *late_urgent]:
        s.add(r)
    assert plan(s.schedule()) == [("r5", 0, 4)]


def test_prefix_cache_hits_skip_shared_full_blocks_and_never_the_last_token():
    s = make_scheduler()
    shared = list(range(1, 9))  # two full blocks
    a = Sequence("a", [*shared, 50, 51], SamplingParams(max_tokens=2))
    s.add(a)
    run_step(s, s.schedule())
    b = Sequence("b", [*shared, 60], SamplingParams(max_tokens=2))
    c = Sequence("c", list(shared), SamplingParams(max_tokens=2))  # prompt = exactly the cached blocks
    s.add(b)
    s.add(c)
    out = s.schedule()
    assert plan(out) == [("a", 10, 1), ("b", 8, 1), ("c", 4, 4)]  # c recomputes its last block
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 4)
    assert b.block_table[:2] == a.block_table[:2] and c.block_table[0] == a.block_table[0]


def test_preemption_by_recompute_when_blocks_run_out_and_the_victim_finishes_later():
    s = make_scheduler(16, num_kv_blocks=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    r0, r1 = make_requests(8, 8, max_tokens=8)
    s.add(r0)
    s.add(r1)
    out = s.schedule()
    assert plan(out) == [("r0", 0, 8), ("r1", 0, 8)]  # 2 blocks each: the cache is full
    run_step(s, out)
    out = s.schedule()  # both need a third block for their 9th token: r1 (last admitted) is preempted
    assert plan(out) == [("r0", 8, 1)] and out.preempted == [r1]
    assert r1.status is Status.WAITING and r1.num_computed_tokens == 0 and r1.output_token_ids == [7]
    assert s.num_preemptions == 1
    while r0.status is not Status.FINISHED:
        run_step(s, out)
        if len(r0.output_token_ids) >= 8:
            s.finish(r0, "length")
        out = s.schedule()
    # r1 comes back and recomputes prompt + its generated token in one chunk
    assert plan(out) == [("r1", 0, 9)]


def test_abort_frees_blocks_at_once():
    s = make_scheduler()
    (r,) = make_requests(9)
    s.add(r)
    run_step(s, s.schedule())
    assert s.blocks.num_free == 64 - 3
    s.finish(r, "abort")
    assert s.blocks.num_free == 64 and not s.has_unfinished() and r.finish_reason == "abort"


def test_duplicate_ids_and_too_small_caches_are_refused():
    s = make_scheduler()
    (r,) = make_requests(3)
    s.add(r)
    with pytest.raises(ValueError, match="already in the engine"):
        s.add(make_requests(3)[0])
    with pytest.raises(ValueError, match="fewer than one full context"):
        make_scheduler(num_kv_blocks=2).add(make_requests(3, base=9)[0])


def test_block_hashes_are_sha256_chains_that_separate_adapters_and_prefixes():
    from elastune_worker.engine.core.block_manager import block_hash

    a = block_hash(None, (1, 2, 3, 4), None)
    assert len(a) == 32 and a == block_hash(None, (1, 2, 3, 4), None)
    assert block_hash(a, (5, 6, 7, 8), None) != block_hash(None, (5, 6, 7, 8), None)  # the prefix counts
    assert block_hash(None, (1, 2, 3, 4), "lora-a") != a != block_hash(None, (1, 2, 3, 4), "")
    # hash((-1,)) == hash((-2,)) in CPython: a tuple hash would let these two blocks share KV
    assert block_hash(None, (-1,), None) != block_hash(None, (-2,), None)


def test_max_loras_counts_lora_references_only_never_soft_prompts():
    """Two device adapter slots: two LoRAs run, the third LoRA's requests wait; soft prompts (even
    several, even one named like a LoRA) take no slot and run beside them, also while a LoRA is held
    back for its load."""
    s = make_scheduler(max_loras=2, max_num_seqs=16, max_num_batched_tokens=64)
    lora = {n: AdapterRef("lora", "", n, i) for i, n in enumerate(("a", "b", "c"), 1)}
    soft = {n: AdapterRef("soft_prompt", "", n, i) for i, n in enumerate(("p", "q", "c"), 4)}
    plan_ = [lora["a"], soft["p"], lora["b"], soft["q"], lora["c"], soft["c"], None, lora["c"]]
    for r, adapter in zip(make_requests(*[3] * len(plan_)), plan_, strict=True):
        r.adapter = adapter
        s.add(r)
    s.hold_loras({"b"})  # b's load is in flight: its request waits, the rest go ahead
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["r0", "r1", "r3", "r4", "r5", "r6", "r7"]
    assert s.running_loras() == {"a", "c"}  # the soft prompt "c" is not the LoRA "c"
    assert [q.request_id for q in s.waiting] == ["r2"]
    assert s.waiting_loras(8) == ["b"]
    stats = s.stats()
    assert stats.lora_running == {"a": 1, "c": 2} and stats.lora_waiting == {"b": 1}
    assert s.adapter_users("a") == 1 and s.adapter_users("p") == 1 and s.adapter_users("x") == 0
    run_step(s, out)
    s.hold_loras(set())  # loaded: b now waits for a slot (a and c hold both)
    assert plan(s.schedule()) == [(f"r{i}", 3, 1) for i in (0, 1, 3, 4, 5, 6, 7)]
    assert [q.request_id for q in s.waiting] == ["r2"]


def test_the_block_check_runs_every_nth_step_and_whenever_nothing_runs():
    """A reference count off by one (a leaked block): with block_check_interval 4 the check finds it at
    the 4th step, not the 1st-3rd; and at once at a step that leaves nothing running."""
    s = make_scheduler(block_check_interval=4)
    for r in make_requests(3, 3, max_tokens=20):
        s.add(r)
    run_step(s, s.schedule())  # step 1: prefills, checked (nothing wrong yet)
    leaked = s.running[0].block_table[0]
    s.blocks.ref_count[leaked] += 1
    run_step(s, s.schedule())  # steps 2 and 3 pass unchecked
    run_step(s, s.schedule())
    with pytest.raises(AssertionError, match=f"block {leaked}: ref count"):
        s.schedule()  # step 4
    idle = make_scheduler(block_check_interval=1000)
    del idle.blocks.free[5]  # a block neither free nor referenced: leaked
    with pytest.raises(AssertionError, match="neither free nor referenced"):
        idle.schedule()  # nothing running: checked whatever the interval
    with pytest.raises(ValueError, match="block_check_interval"):
        make_scheduler(block_check_interval=0)


def test_the_block_check_finds_a_free_block_with_a_reference_count():
    """A free block whose count was raised without taking it out of the free queue: a later allocation
    would leave it queued, and the next one could hand it to a second request. Missed by the check
    before (the blocks still added up)."""
    s = make_scheduler(block_check_interval=1)
    (r,) = make_requests(3, max_tokens=20)
    s.add(r)
    run_step(s, s.schedule())
    free_block = next(iter(s.blocks.free))
    s.blocks.ref_count[free_block] += 1
    with pytest.raises(AssertionError, match="a free block has a ref count"):
        s.schedule()
