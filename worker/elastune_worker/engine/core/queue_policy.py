"""Waiting-queue policies behind one interface, and the factory that picks one by name (pure).

FCFS, priority (vLLM's), SSJF's speculative shortest-job-first (``sjf``: ``priority`` holds the
predicted output length), and VTC fair sharing across tenants (``fair``). Preble's priority groups may
join later.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from elastune_worker.engine.core.scheduler_config import QueuePolicyName
from elastune_worker.engine.core.sequence import Sequence


class RequestQueue(Protocol):
    def push(self, seq: Sequence) -> None:
        """A new request."""

    def push_front(self, seq: Sequence) -> None:
        """A preempted request: it goes ahead of everything it was ahead of before."""

    def peek(self) -> Sequence: ...

    def pop(self) -> Sequence: ...

    def remove(self, seq: Sequence) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSQueue:
    """First come, first served; preempted requests first."""

    def __init__(self) -> None:
        self._q: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._q.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._q.appendleft(seq)

    def peek(self) -> Sequence:
        return self._q[0]

    def pop(self) -> Sequence:
        return self._q.popleft()

    def remove(self, seq: Sequence) -> None:
        self._q.remove(seq)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._q)


class PriorityQueue:
    """Lower ``priority`` first (vLLM's convention), then arrival; preempted requests keep their rank."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._count = itertools.count()
        self._removed: set[int] = set()

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.priority, seq.arrival, next(self._count), seq))

    push_front = push  # (priority, arrival) already puts it where it was

    def _clean(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Sequence:
        self._clean()
        return self._heap[0][3]

    def pop(self) -> Sequence:
        self._clean()
        return heapq.heappop(self._heap)[3]

    def remove(self, seq: Sequence) -> None:
        self._removed.add(id(seq))

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Sequence]:
        return (e[3] for e in sorted(self._heap) if id(e[3]) not in self._removed)


class SJFQueue:
    """Speculative shortest-job-first (SSJF, docs/design.md §5): the shortest predicted output first.

    ``priority`` is the request's predicted output length in tokens (the gateway's proxy model, or
    the client's); ties go to the earlier arrival, then to the earlier push. The order only decides who
    is admitted next: it is non-preemptive, as in the paper, so a running request is never preempted to
    make room for a shorter one, and a request preempted by the scheduler for KV memory comes back
    ahead of every waiting request (it had already started; ``push_front``).

    Starvation guard. The paper only says "one can adopt aging" (§6), so the rule is ours: a waiting
    request that has been *bypassed* ``max_bypass`` times (a request that arrived after it was admitted
    before it) or has waited ``max_wait_s`` seconds is starved, and the oldest starved request goes
    before any shorter one. Counting bypasses makes the bound independent of the model's speed and
    exact to test; the wall-clock bound is there for deployments that state a waiting-time SLO. Both
    counts only grow with age, so only the oldest waiting request has to be checked. 0 disables a
    bound; both 0 is plain SJF. A preempted request resuming from the front bypasses nobody.

    Costs: push, peek O(log n); pop O(n) (it counts the bypasses of the older waiting requests).
    """

    def __init__(
        self, max_bypass: int = 64, max_wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bypass = max_bypass
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._count = itertools.count()
        self._front: deque[Sequence] = deque()
        """Preempted requests, in the order they go back in."""
        self._by_length: list[tuple[int, float, int, Sequence]] = []
        self._by_age: list[tuple[float, int, Sequence]] = []
        self._live: dict[int, tuple[float, int]] = {}
        """id(seq) -> (arrival, push number): the waiting requests in the heaps (lazy deletion)."""
        self.bypassed: dict[int, int] = {}
        """id(seq) -> times a later arrival was admitted before it."""
        self.num_starved_admissions = 0
        """Admissions that the starvation guard decided (a shorter request was waiting)."""
        self._next: Sequence | None = None
        """What the latest ``peek`` chose, so that the ``pop`` after it takes the same request even
        when the clock crossed ``max_wait_s`` in between; every change of the queue forgets it."""

    def push(self, seq: Sequence) -> None:
        n = next(self._count)
        self._live[id(seq)] = (seq.arrival, n)
        self.bypassed.setdefault(id(seq), 0)
        heapq.heappush(self._by_length, (seq.priority, seq.arrival, n, seq))
        heapq.heappush(self._by_age, (seq.arrival, n, seq))
        self._next = None

    def push_front(self, seq: Sequence) -> None:
        self._front.appendleft(seq)
        self._next = None

    def _is_live(self, seq: Sequence, n: int) -> bool:
        entry = self._live.get(id(seq))
        return entry is not None and entry[1] == n

    def _starved(self, seq: Sequence) -> bool:
        if self.max_bypass and self.bypassed.get(id(seq), 0) >= self.max_bypass:
            return True
        return bool(self.max_wait_s) and self._clock() - seq.arrival >= self.max_wait_s

    def peek(self) -> Sequence:
        """Chosen afresh each time (the clock moves); the next ``pop`` takes this same request."""
        if self._front:
            self._next = self._front[0]
            return self._next
        while not self._is_live(self._by_age[0][2], self._by_age[0][1]):
            heapq.heappop(self._by_age)
        while not self._is_live(self._by_length[0][3], self._by_length[0][2]):
            heapq.heappop(self._by_length)
        oldest, shortest = self._by_age[0][2], self._by_length[0][3]
        self._next = oldest if oldest is not shortest and self._starved(oldest) else shortest
        return self._next

    def pop(self) -> Sequence:
        seq = self._next if self._next is not None else self.peek()
        self._next = None
        if self._front and seq is self._front[0]:
            self._front.popleft()
            return seq
        if seq is self._by_age[0][2] and seq is not self._by_length[0][3]:
            self.num_starved_admissions += 1
        key = self._live.pop(id(seq))
        del self.bypassed[id(seq)]
        for other, other_key in self._live.items():
            if other_key < key:
                self.bypassed[other] += 1
        return seq

    def remove(self, seq: Sequence) -> None:
        self._next = None
        if id(seq) in self._live:
            del self._live[id(seq)]
            del self.bypassed[id(seq)]
        else:
            self._front.remove(seq)

    def __len__(self) -> int:
        return len(self._front) + len(self._live)

    def __iter__(self) -> Iterator[Sequence]:
        """Preempted requests, then by predicted length (the guard's pick is not reflected here)."""
        rest = (e[3] for e in sorted(self._by_length) if self._is_live(e[3], e[2]))
        return itertools.chain(list(self._front), rest)


VTC_INPUT_WEIGHT = 1.0
VTC_OUTPUT_WEIGHT = 2.0
"""VTC's weights (Sheng et al., w_p = 1, w_q = 2): a decoded token costs twice a prefilled one. The
gateway's fair line uses the same ones (``elastune_gateway.server.fair_queue``; a test keeps them equal)."""


class VTCQueue:
    """Fair sharing across tenants with virtual token counters (VTC: Sheng et al., "Fairness in Serving
    Large Language Models", OSDI'24), the engine's side of the gateway's fair line.

    Each tenant (``Sequence.tenant``: the API key the gateway authenticated) has a counter of the service
    it received in weighted tokens: the scheduler charges a request's prompt when it is first admitted
    and each output token as it is sampled (``served``; ``VTC_INPUT_WEIGHT``, ``VTC_OUTPUT_WEIGHT``).
    The next request admitted is the oldest of the backlogged tenant (one with requests waiting) whose
    counter is smallest, so one tenant flooding the engine cannot starve another: their requests are
    admitted in turn, by service, not by arrival. Ties go to the tenant with fewer requests waiting, then
    by name. A tenant that becomes backlogged after having nothing waiting has its counter lifted to the
    smallest counter among the backlogged tenants (with nobody waiting, to that of the tenant that left
    the queue last), so idleness banks no credit (the paper's rule).

    A request put back (``push_front``: preempted for KV memory, or passed over for an adapter slot)
    goes ahead of every waiting request, as in the other policies: it had already been admitted, and
    its prompt is not charged again when it is readmitted. Within a tenant, requests go in arrival order.
    With one tenant (every request's is "" without a gateway) this is FCFS.

    Costs: push, pop O(tenants); the counter table holds the tenants seen (pruned of idle ones beyond
    ``max_idle_tenants``).
    """

    def __init__(
        self,
        input_weight: float = VTC_INPUT_WEIGHT,
        output_weight: float = VTC_OUTPUT_WEIGHT,
        max_idle_tenants: int = 4096,
    ) -> None:
        self.input_weight, self.output_weight = input_weight, output_weight
        self.max_idle_tenants = max_idle_tenants
        self.counters: dict[str, float] = {}
        """tenant -> weighted tokens served (lifted on return from idle)."""
        self._front: deque[Sequence] = deque()
        self._queues: dict[str, deque[Sequence]] = {}
        """tenant -> its new requests, oldest first (only tenants with some)."""
        self._waiting: dict[str, int] = {}
        """tenant -> its requests waiting (front included; only tenants with some): the backlogged."""
        self._last_left: str | None = None

    # -- service ------------------------------------------------------------------------------------
    def cost(self, input_tokens: float, output_tokens: float) -> float:
        return self.input_weight * input_tokens + self.output_weight * output_tokens

    def served(self, seq: Sequence, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """The scheduler served ``seq`` this much: its tenant's counter advances."""
        t = seq.tenant
        self.counters[t] = self.counters.get(t, 0.0) + self.cost(input_tokens, output_tokens)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    # -- the queue ----------------------------------------------------------------------------------
    def _floor(self) -> float:
        if self._waiting:
            return min(self.counters.get(t, 0.0) for t in self._waiting)
        return self.counters.get(self._last_left, 0.0) if self._last_left is not None else 0.0

    def push(self, seq: Sequence) -> None:
        t = seq.tenant
        if t not in self._waiting:  # becomes backlogged: lifted, no credit banked while idle
            floor = self._floor()
            if len(self.counters) > len(self._waiting) + self.max_idle_tenants:
                self._forget_idle(floor)
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        self._queues.setdefault(t, deque()).append(seq)
        self._waiting[t] = self._waiting.get(t, 0) + 1

    def push_front(self, seq: Sequence) -> None:
        self._front.appendleft(seq)
        self._waiting[seq.tenant] = self._waiting.get(seq.tenant, 0) + 1

    def _tenant(self) -> str:
        """The backlogged tenant with new requests whose counter is smallest."""
        counters, queues = self.counters, self._queues
        return min(queues, key=lambda t: (counters.get(t, 0.0), len(queues[t]), t))

    def peek(self) -> Sequence:
        if self._front:
            return self._front[0]
        return self._queues[self._tenant()][0]

    def pop(self) -> Sequence:
        if self._front:
            seq = self._front.popleft()
        else:
            t = self._tenant()
            queue = self._queues[t]
            seq = queue.popleft()
            if not queue:
                del self._queues[t]
        self._left(seq.tenant)
        return seq

    def _left(self, tenant: str) -> None:
        n = self._waiting[tenant] - 1
        if n:
            self._waiting[tenant] = n
        else:
            del self._waiting[tenant]
            self._last_left = tenant

    def remove(self, seq: Sequence) -> None:
        queue = self._queues.get(seq.tenant)
        if queue is not None and any(s is seq for s in queue):
            queue.remove(seq)
            if not queue:
                del self._queues[seq.tenant]
        else:
            self._front.remove(seq)
        self._left(seq.tenant)

    def _forget_idle(self, floor: float) -> None:
        """Counters of tenants with nothing waiting at or below ``floor`` (a returning one is lifted to
        at least that anyway): dropping them changes no decision."""
        keep = self._last_left
        for t in [t for t, c in self.counters.items() if t not in self._waiting and t != keep and c <= floor]:
            del self.counters[t]

    def __len__(self) -> int:
        return len(self._front) + sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Sequence]:
        """Put-back requests, then the order VTC would admit the rest in if each were charged its prompt
        and nothing else changed (the output charged later is not foreseen)."""
        return itertools.chain(list(self._front), self._projected(self._queues.items()))

    def _projected(self, queues: Iterable[tuple[str, deque[Sequence]]]) -> Iterator[Sequence]:
        # (counter, requests left, tenant, its requests): tenants are distinct, so iterators never compare
        heap = [(self.counters.get(t, 0.0), len(q), t, iter(list(q))) for t, q in queues]
        heapq.heapify(heap)
        while heap:
            counter, n, t, seqs = heapq.heappop(heap)
            seq = next(seqs)
            yield seq
            if n > 1:
                heapq.heappush(heap, (counter + self.cost(len(seq.prompt_token_ids), 0), n - 1, t, seqs))


def create_request_queue(
    policy: QueuePolicyName,
    *,
    sjf_max_bypass: int = 64,
    sjf_max_wait_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "sjf":
        return SJFQueue(sjf_max_bypass, sjf_max_wait_s, clock)
    if policy == "fair":
        return VTCQueue()
    raise ValueError(f"unknown queue policy {policy!r}; choose fcfs, priority, sjf or fair")
