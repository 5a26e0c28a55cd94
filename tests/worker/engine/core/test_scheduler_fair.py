"""The ``fair`` queue policy in the pure scheduler (no torch): virtual token counters across tenants
(VTC, Sheng et al. OSDI'24), fed by the scheduler with the prompt tokens it admits and the output tokens
it samples. A tenant flooding the engine cannot starve another: the other's requests are admitted in
turn with the flood's, not after it; a preempted request keeps its place and is not charged twice; a
tenant back from idleness is lifted to the smallest backlogged counter (it banks no credit). Exact
orders, no timings."""

from __future__ import annotations

from elastune_worker.engine.core.queue_policy import (
    VTC_INPUT_WEIGHT,
    VTC_OUTPUT_WEIGHT,
    FCFSQueue,
    VTCQueue,
    create_request_queue,
)
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.core.scheduler import Scheduler, SchedulerOutput
from elastune_worker.engine.core.scheduler_config import SchedulerConfig
from elastune_worker.engine.core.sequence import Sequence, Status

_ids = iter(range(10**6))


def make_scheduler(max_model_len: int = 64, **config: object) -> Scheduler:
    defaults: dict[str, object] = {"block_size": 4, "num_kv_blocks": 256, "max_num_batched_tokens": 64}
    settings = {"queue_policy": "fair", **defaults, **config}
    return Scheduler(SchedulerConfig(**settings), max_model_len)  # type: ignore[arg-type]


def req(name: str, tenant: str, prompt: int = 4, max_tokens: int = 4) -> Sequence:
    base = 100 * next(_ids)  # distinct tokens per request: no shared prefixes
    return Sequence(
        name, [base + t for t in range(prompt)], SamplingParams(max_tokens=max_tokens), tenant=tenant
    )


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, sample token 7, finish requests that reached max_tokens."""
    out = s.schedule()
    for q in s.update(out, {c.seq.request_id: 7 for c in out.chunks if c.samples}):
        if len(q.output_token_ids) >= q.params.max_tokens:
            s.finish(q, "length")
    return out


def admissions(s: Scheduler, steps: int = 500) -> list[str]:
    """Step until idle; the order requests were first admitted in."""
    order: list[str] = []
    for _ in range(steps):
        if not s.has_unfinished():
            return order
        out = step(s)
        order += [c.seq.request_id for c in out.chunks if c.start == 0 and c.seq.num_preemptions == 0]
    raise AssertionError("did not drain")


def test_the_policy_is_selectable_by_name_and_the_weights_are_the_gateways() -> None:
    assert isinstance(create_request_queue("fair"), VTCQueue)
    assert (VTC_INPUT_WEIGHT, VTC_OUTPUT_WEIGHT) == (1.0, 2.0)
    try:
        from elastune_gateway.server.fair_queue import DEFAULT_INPUT_WEIGHT, DEFAULT_OUTPUT_WEIGHT
    except ImportError:  # the gateway is not installed with the pure package
        return
    assert (VTC_INPUT_WEIGHT, VTC_OUTPUT_WEIGHT) == (DEFAULT_INPUT_WEIGHT, DEFAULT_OUTPUT_WEIGHT)


def test_a_flooding_tenant_does_not_starve_another_whose_requests_are_admitted_in_turn() -> None:
    s = make_scheduler(max_num_seqs=1)  # one at a time: the admission order is the whole story
    for i in range(10):
        s.add(req(f"flood{i}", "team-a/flood"))
    for i in range(3):
        s.add(req(f"victim{i}", "team-b/victim"))
    order = admissions(s)
    # Both start at 0 (the victim lifted to the flood's counter on arrival); a tie goes to the tenant with
    # fewer requests waiting. Then they alternate while both are backlogged: equal requests, equal
    # service (4 prompt tokens + 2 x 4 output tokens each).
    assert order[:6] == ["victim0", "flood0", "victim1", "flood1", "victim2", "flood2"]
    assert order[6:] == [f"flood{i}" for i in range(3, 10)]
    # FCFS, for contrast: the victim waits for the whole flood.
    fcfs = Scheduler(SchedulerConfig(num_kv_blocks=256, block_size=4, max_num_seqs=1), 64)
    for r in [req(f"flood{i}", "a") for i in range(10)] + [req(f"victim{i}", "b") for i in range(3)]:
        fcfs.add(r)
    assert admissions(fcfs)[10:] == ["victim0", "victim1", "victim2"]


def test_service_not_request_count_decides_a_long_flood_request_counts_for_several_short_ones() -> None:
    s = make_scheduler(max_num_seqs=1)
    for i in range(3):
        s.add(req(f"long{i}", "a", prompt=8, max_tokens=8))  # 8 + 2 x 8 = 24 weighted tokens each
    for i in range(8):
        s.add(req(f"short{i}", "b", prompt=4, max_tokens=2))  # 4 + 2 x 2 = 8 each
    order = admissions(s)
    assert order[0] == "long0"  # the tie at 0 goes to the tenant with fewer waiting
    # long0's 24 tokens buy b three shorts before a's next request.
    assert order[1:5] == ["short0", "short1", "short2", "long1"]
    q = s.waiting
    assert isinstance(q, VTCQueue)
    assert q.counter("a") == 3 * 24 and q.counter("b") == 8 * 8


def test_batched_admissions_alternate_tenants_within_one_step() -> None:
    s = make_scheduler(max_num_seqs=4)
    for i in range(6):
        s.add(req(f"f{i}", "flood"))
    s.add(req("v0", "victim"))
    s.add(req("v1", "victim"))
    out = s.schedule()
    # Each admission charges its prompt at once, so the next pick within the same step sees it.
    assert [c.seq.request_id for c in out.chunks] == ["v0", "f0", "v1", "f1"]


def test_a_preempted_request_keeps_its_place_and_is_not_charged_its_prompt_again() -> None:
    s = make_scheduler(16, num_kv_blocks=4, max_num_seqs=4, enable_prefix_caching=False)
    a, b = req("a0", "a", prompt=8, max_tokens=8), req("b0", "b", prompt=8, max_tokens=8)
    s.add(a)
    s.add(b)
    q = s.waiting
    assert isinstance(q, VTCQueue)
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["a0", "b0"]  # 2 blocks each: the cache is full
    assert q.counter("a") == q.counter("b") == 8
    b1 = req("b1", "b")
    s.add(b1)  # will wait behind the preempted b0
    s.update(out, {"a0": 7, "b0": 7})
    out = s.schedule()  # both need a third block: b0 (admitted last) is preempted
    assert out.preempted == [b] and b.status is Status.WAITING
    assert list(q) == [b, b1] and q.peek() is b
    for _ in range(50):  # run a0 out; b0 comes back first and recomputes its prompt and token
        if b.status is Status.RUNNING:
            break
        for done in s.update(out, {c.seq.request_id: 7 for c in out.chunks if c.samples}):
            if len(done.output_token_ids) >= done.params.max_tokens:
                s.finish(done, "length")
        out = s.schedule()
    first = out.chunks[0]
    assert (first.seq, first.start, first.num_tokens) == (b, 0, 9)
    # Charged: a0 its prompt and 8 tokens; b0 its prompt once and its one token (the recompute is free),
    # b1 its prompt if it was admitted in the same step.
    assert q.counter("a") == 8 + 8 * VTC_OUTPUT_WEIGHT
    b1_prompt = len(b1.prompt_token_ids) if b1.status is Status.RUNNING else 0
    assert q.counter("b") == 8 + 1 * VTC_OUTPUT_WEIGHT + b1_prompt


def test_a_tenant_back_from_idle_is_lifted_to_the_smallest_backlogged_counter() -> None:
    q = VTCQueue()
    a = [req(f"a{i}", "a") for i in range(4)]
    for r in a:
        q.push(r)
    q.served(q.pop(), input_tokens=100)  # a has been served 100, b nothing so far
    q.push(req("c0", "c"))  # new while a is backlogged: lifted to a's 100, not 0
    assert q.counter("c") == 100
    b = req("b0", "b")
    q.served(b, input_tokens=10)  # b was served 10 long ago (idle since): no credit banked
    q.push(b)
    assert q.counter("b") == 100
    q.served(b, output_tokens=500)  # b now far ahead of the others
    popped = [q.pop().request_id for _ in range(len(q))]
    assert popped == ["c0", "a1", "a2", "a3", "b0"]  # by counter: c and a at 100 (c fewer waiting), b
    q.push(req("a4", "a"))  # nobody waits: lifted to the last tenant to leave (b, 1100)
    assert q.counter("a") == 1100
    q.push(req("b1", "b"))  # a lift never lowers a counter
    assert q.counter("b") == 1100


def test_with_nobody_waiting_a_returning_tenant_is_lifted_to_the_last_one_to_leave() -> None:
    q = VTCQueue()
    a0 = req("a0", "a")
    q.push(a0)
    q.served(q.pop(), input_tokens=50, output_tokens=10)  # a: 70, and nobody waits now
    q.push(req("b0", "b"))
    assert q.counter("b") == 70  # not 0: it would otherwise take the engine until it caught up


def test_removal_iteration_and_length_and_one_tenant_is_fcfs() -> None:
    q = VTCQueue()
    rs = [req(f"r{i}", "") for i in range(5)]
    for r in rs:
        q.push(r)
    q.remove(rs[2])
    assert len(q) == 4 and list(q) == [rs[0], rs[1], rs[3], rs[4]]
    fcfs = FCFSQueue()
    for r in rs[:2] + rs[3:]:
        fcfs.push(r)
    assert [q.pop() for _ in range(4)] == [fcfs.pop() for _ in range(4)]
    assert len(q) == 0
    # iteration projects the admissions: two tenants, equal prompts, alternate
    x = [req(f"x{i}", "x") for i in range(3)]
    y = [req(f"y{i}", "y") for i in range(2)]
    for r in x + y:
        q.push(r)
    assert [r.request_id for r in q] == ["y0", "x0", "y1", "x1", "x2"]
    assert len(q) == 5  # iterating consumes nothing


def test_idle_tenants_are_forgotten_beyond_the_bound_without_changing_decisions() -> None:
    q = VTCQueue(max_idle_tenants=2)
    for i in range(5):
        r = req(f"t{i}", f"t{i}")
        q.push(r)
        q.served(q.pop(), input_tokens=1)
    hog = req("hog", "hog")
    q.push(hog)
    q.served(hog, input_tokens=1000)
    q.push(req("late", "late"))
    assert set(q.counters) <= {"hog", "late", "t4"}  # the backlogged, and the last to leave
    assert q.counter("late") == q.counter("hog")
