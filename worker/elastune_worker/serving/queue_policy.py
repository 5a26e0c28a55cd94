"""Waiting-queue policies behind one interface, and the factory that picks one by name (pure).

FCFS now; the gateway issue adds Preble's priority groups and SSJF's predicted-length order here.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from elastune_worker.serving.config import QueuePolicyName
from elastune_worker.serving.sequence import Sequence


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


def create_request_queue(policy: QueuePolicyName) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown queue policy {policy!r}; choose fcfs or priority")
