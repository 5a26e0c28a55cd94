"""SSJF in the pure scheduler (no torch): the sjf queue policy (shortest predicted output first,
arrival tie-break, non-preemptive, starvation guard) and the three batching settings, as exact orders."""

from __future__ import annotations

import pytest

from elastune_worker.engine.core.queue_policy import SJFQueue, create_request_queue
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.core.scheduler import Scheduler, SchedulerOutput
from elastune_worker.engine.core.scheduler_config import SchedulerConfig
from elastune_worker.engine.core.sequence import Sequence, Status


def make_scheduler(**config: object) -> Scheduler:
    defaults: dict[str, object] = {"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 16}
    return Scheduler(SchedulerConfig(**{**defaults, **config}), 64)  # type: ignore[arg-type]


def req(name: str, predicted: int, arrival: float, prompt: int = 2, max_tokens: int = 2) -> Sequence:
    """A request whose ``priority`` is its predicted output length (what the gateway attaches)."""
    base = 1000 * (hash(name) % 97)  # distinct tokens per request: no shared prefixes
    return Sequence(name, [base + t for t in range(prompt)], SamplingParams(max_tokens=max_tokens),
                    arrival=arrival, priority=predicted)  # fmt: skip


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def step(s: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """One step as the engine runs it: schedule, sample token 7, finish requests at max_tokens.
    Returns the plan and the requests that finished in it."""
    out = s.schedule()
    grew = s.update(out, {c.seq.request_id: 7 for c in out.chunks if c.samples})
    done = [q for q in grew if len(q.output_token_ids) >= q.params.max_tokens]
    for q in done:
        s.finish(q, "length")
    return out, [q.request_id for q in done]


def drain(s: Scheduler, arrivals: dict[int, list[Sequence]] | None = None, steps: int = 200) -> list[str]:
    """Step until idle, adding ``arrivals[k]`` before step k; the order in which requests were admitted."""
    arrivals = arrivals or {}
    admitted: list[str] = []
    for k in range(steps):
        for r in arrivals.get(k, []):
            s.add(r)
        if not s.has_unfinished() and k > max(arrivals, default=-1):
            return admitted
        out, _ = step(s)
        admitted += [c.seq.request_id for c in out.chunks if c.start == 0]
    raise AssertionError("did not drain")


# -- the sjf queue ------------------------------------------------------------------------------------
def test_sjf_admits_shortest_predicted_first_and_breaks_ties_by_arrival():
    s = make_scheduler(queue_policy="sjf", max_num_seqs=1)
    # pushed out of arrival order on purpose: b and d tie on 10 tokens, d arrived first
    for r in (req("a", 50, 0.0), req("b", 10, 2.0), req("c", 30, 1.0), req("d", 10, 1.5)):
        s.add(r)
    assert drain(s) == ["d", "b", "c", "a"]


def test_sjf_is_non_preemptive_a_shorter_arrival_waits_for_the_running_request():
    s = make_scheduler(queue_policy="sjf", max_num_seqs=1)
    s.add(req("long", 500, 0.0, max_tokens=4))
    out, _ = step(s)
    assert plan(out) == [("long", 0, 2)]
    s.add(req("short", 1, 1.0))
    for pos in (2, 3, 4):  # long decodes to its end; short never displaces it
        out, _ = step(s)
        assert plan(out) == [("long", pos, 1)]
    assert s.requests["short"].status is Status.WAITING
    assert s.num_preemptions == 0
    out, _ = step(s)
    assert plan(out) == [("short", 0, 2)]


def test_sjf_starvation_guard_admits_a_request_bypassed_max_bypass_times():
    s = make_scheduler(queue_policy="sjf", max_num_seqs=1, sjf_max_bypass=2)
    # one long request waits while short ones keep arriving; each short one admitted ahead of it is
    # a bypass, and after two the long one goes first although shorter ones are still waiting
    arrivals = {0: [req("long", 900, 0.0), req("s1", 10, 1.0)], 1: [req("s2", 10, 2.0)],
                3: [req("s3", 10, 3.0), req("s4", 10, 4.0)], 5: [req("s5", 10, 5.0)]}  # fmt: skip
    assert drain(s, arrivals) == ["s1", "s2", "long", "s3", "s4", "s5"]
    assert isinstance(s.waiting, SJFQueue) and s.waiting.num_starved_admissions == 1


def test_sjf_without_the_guard_starves_the_long_request_until_the_end():
    s = make_scheduler(queue_policy="sjf", max_num_seqs=1, sjf_max_bypass=0)
    arrivals = {0: [req("long", 900, 0.0), req("s1", 10, 1.0)], 1: [req("s2", 10, 2.0)],
                3: [req("s3", 10, 3.0), req("s4", 10, 4.0)], 5: [req("s5", 10, 5.0)]}  # fmt: skip
    assert drain(s, arrivals) == ["s1", "s2", "s3", "s4", "s5", "long"]


def test_sjf_queue_bypass_counts_only_later_arrivals_admitted_first():
    q = SJFQueue(max_bypass=2)
    old, mid, new = req("old", 30, 0.0), req("mid", 20, 1.0), req("new", 10, 2.0)
    for r in (old, mid, new):
        q.push(r)
    assert q.pop() is new  # bypasses old and mid
    assert q.bypassed == {id(old): 1, id(mid): 1}
    early = req("early", 5, -1.0)  # arrived before everyone: admitting it bypasses nobody
    q.push(early)
    assert q.pop() is early
    assert q.bypassed == {id(old): 1, id(mid): 1}
    assert q.pop() is mid  # old's second bypass
    assert q.bypassed == {id(old): 2}
    q.push(req("short", 1, 3.0))
    assert q.peek() is old and q.pop() is old  # starved: ahead of the shorter newcomer
    assert q.num_starved_admissions == 1


def test_sjf_queue_wall_clock_guard_and_peek_pop_agree_across_the_deadline():
    now = [0.0]
    q = SJFQueue(max_bypass=0, max_wait_s=5.0, clock=lambda: now[0])
    old, new = req("old", 100, 0.0), req("new", 10, 1.0)
    q.push(old)
    q.push(new)
    now[0] = 4.9
    assert q.peek() is new
    now[0] = 5.0  # the deadline passes between the scheduler's peek and its pop
    assert q.pop() is new  # pop takes what peek chose
    q.push(req("newer", 10, 4.0))
    assert q.peek() is old  # waited 5 s: starved
    now[0] = 0.0
    assert q.peek().request_id == "newer"  # peek always decides afresh


def test_sjf_queue_preempted_requests_go_first_and_remove_and_iter():
    q = create_request_queue("sjf")
    a, b, c = req("a", 10, 0.0), req("b", 20, 1.0), req("c", 5, 2.0)
    q.push(a)
    q.push(b)
    q.push(c)
    assert [x.request_id for x in q] == ["c", "a", "b"]
    q.remove(a)
    assert len(q) == 2 and [x.request_id for x in q] == ["c", "b"]
    pre = req("pre", 900, 3.0)
    q.push_front(pre)  # a preempted request resumes before any shorter waiting one
    assert [x.request_id for x in q] == ["pre", "c", "b"]
    assert q.pop() is pre and q.pop() is c
    q.remove(b)
    assert len(q) == 0 and list(q) == []


def test_sjf_scheduler_abort_of_a_waiting_request():
    s = make_scheduler(queue_policy="sjf", max_num_seqs=1)
    for r in (req("a", 1, 0.0), req("b", 2, 1.0), req("c", 3, 2.0)):
        s.add(r)
    step(s)
    s.finish(s.requests["b"], "abort")
    assert drain(s) == ["c"]


# -- batching settings ------------------------------------------------------------------------------
ARRIVALS = {0: [req("a", 0, 0.0, max_tokens=3), req("b", 0, 1.0, max_tokens=1)], 1: [req("c", 0, 2.0)]}


def fresh_arrivals() -> dict[int, list[Sequence]]:
    return {k: [req(r.request_id, r.priority, r.arrival, max_tokens=r.params.max_tokens) for r in v]
            for k, v in ARRIVALS.items()}  # fmt: skip


def test_batching_continuous_admits_an_arrival_into_the_running_batch():
    s = make_scheduler(batching="continuous", max_num_seqs=4)
    arrivals = fresh_arrivals()
    s.add(arrivals[0][0])
    s.add(arrivals[0][1])
    out, done = step(s)
    assert plan(out) == [("a", 0, 2), ("b", 0, 2)] and done == ["b"]
    s.add(arrivals[1][0])
    out, _ = step(s)
    assert plan(out) == [("a", 2, 1), ("c", 0, 2)]  # c joins while a is still decoding


def test_batching_dynamic_forms_a_batch_only_when_the_running_set_is_empty():
    s = make_scheduler(batching="dynamic", max_num_seqs=4)
    arrivals = fresh_arrivals()
    s.add(arrivals[0][0])
    s.add(arrivals[0][1])
    out, done = step(s)
    assert plan(out) == [("a", 0, 2), ("b", 0, 2)] and done == ["b"]
    s.add(arrivals[1][0])
    out, _ = step(s)
    assert plan(out) == [("a", 2, 1)]  # c waits although a slot is free: the batch is closed
    out, done = step(s)
    assert plan(out) == [("a", 3, 1)] and done == ["a"]
    out, _ = step(s)
    assert plan(out) == [("c", 0, 2)]  # the next batch


def test_batching_dynamic_batch_keeps_forming_while_the_token_budget_cut_it_short():
    s = make_scheduler(batching="dynamic", max_num_seqs=3, max_num_batched_tokens=8)
    for r in (req("a", 0, 0.0, prompt=6, max_tokens=5), req("b", 0, 1.0, prompt=6, max_tokens=5),
              req("c", 0, 2.0, prompt=6, max_tokens=5)):  # fmt: skip
        s.add(r)
    out, _ = step(s)
    assert plan(out) == [("a", 0, 6), ("b", 0, 2)]  # the budget stops admission: still forming
    out, _ = step(s)
    assert plan(out) == [("a", 6, 1), ("b", 2, 4), ("c", 0, 3)]
    s.add(req("late", 0, 3.0))
    out, _ = step(s)
    assert [p[0] for p in plan(out)] == ["a", "b", "c"]  # c got in, the batch is full and closed
    assert s.requests["late"].status is Status.WAITING


def test_batching_none_serves_one_request_at_a_time_in_queue_order():
    s = make_scheduler(batching="none", max_num_seqs=4, queue_policy="sjf")
    for r in (req("a", 30, 0.0), req("b", 10, 1.0), req("c", 20, 2.0)):
        s.add(r)
    seen = []
    while s.has_unfinished():
        out, _ = step(s)
        assert len(out.chunks) == 1
        seen.append(out.chunks[0].seq.request_id)
    assert seen == ["b", "b", "c", "c", "a", "a"]


@pytest.mark.parametrize("batching", ["continuous", "dynamic", "none"])
def test_fcfs_and_sjf_admission_orders_under_each_batching(batching):
    def order(policy: str) -> list[str]:
        s = make_scheduler(batching=batching, max_num_seqs=2, queue_policy=policy)
        for r in (req("a", 40, 0.0), req("b", 30, 1.0), req("c", 20, 2.0), req("d", 10, 3.0)):
            s.add(r)
        return drain(s)

    assert order("fcfs") == ["a", "b", "c", "d"]
    assert order("sjf") == ["d", "c", "b", "a"]


def test_config_rejects_negative_guards():
    with pytest.raises(ValueError, match="sjf_max_bypass"):
        SchedulerConfig(num_kv_blocks=1, sjf_max_bypass=-1)
    with pytest.raises(ValueError, match="sjf_max_wait_s"):
        SchedulerConfig(num_kv_blocks=1, sjf_max_wait_s=-0.5)
