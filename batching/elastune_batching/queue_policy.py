"""Waiting-queue policies behind one interface, and the factory that picks one by name (pure).

FCFS, priority (vLLM's), and SSJF's speculative shortest-job-first (``sjf``: ``priority`` holds the
predicted output length). Preble's priority groups may join later.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from elastune_batching.config import QueuePolicyName
from elastune_batching.sequence import Sequence


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
    """Speculative shortest-job-first (SSJF, DESIGN.md §5): the shortest predicted output first.

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
    raise ValueError(f"unknown queue policy {policy!r}; choose fcfs, priority or sjf")
