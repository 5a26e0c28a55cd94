"""Preble's local scheduler wait queue (§4.3): P priority groups by cached-token fraction.

A waiting request joins group ``floor(cached / prompt × P)`` (P = 10: 63 of 100 tokens cached → group
6; a fully cached prompt joins the top group, P − 1). When a batch is formed the scheduler takes
requests from every non-empty group in proportion to its weight, the higher group more: group g weighs
g + 1, so a batch that takes 55 requests from ten full groups takes 10 from the top, 9 from the next,
… 1 from the bottom. Within a group, first come first served. Prefix sharing is favoured and no group
starves.

This module is pure (no torch, no engine types; items are any objects) so that the engine's queue-policy
factory (``worker/elastune_worker/engine/queue_policy.py``, ``create_request_queue``) can wrap
``PriorityGroups`` as its ``priority groups`` policy later; the gateway's simulator uses it today.

Interpretations (the paper is ambiguous; its stated intent is kept):
- Groups are numbered 0 … P − 1 and the top one also takes 100 % hits; the example "63 of 100 → six"
  fixes floor(), and "ten from group 10, nine from 9" fixes weights g + 1 (our groups 9 … 0).
- The example's "100 requests … ten from group 10, nine from 9, etc." adds up to 55, not 100: we read it
  as proportions, not counts. Quotas are realised by smooth weighted round-robin (nginx's) over the
  non-empty groups, which hands out exactly g + 1 of every Σ(g + 1) picks and keeps its state from one
  batch to the next, so proportions hold across batches and a lone pick is fair too. Ties go to the
  higher group. Groups with fewer requests than their share leave the rest to the others.
- The fraction is taken when the request is queued (``update`` re-files it when the engine's cache
  changed, e.g. after another request filled the prefix).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

PRIORITY_GROUPS = 10
"""P of Preble §4.3 (docs/design.md §5)."""
CHUNKED_PREFILL_TOKENS = 512
"""Preble's chunked-prefill size (docs/design.md §5): the engine's long_prefill_token_threshold."""

T = TypeVar("T")


def priority_group(cached_tokens: int, prompt_tokens: int, groups: int = PRIORITY_GROUPS) -> int:
    """The group of a request with ``cached_tokens`` of its ``prompt_tokens`` cached (0 … groups − 1)."""
    if groups < 1:
        raise ValueError("groups must be >= 1")
    if prompt_tokens <= 0:
        return groups - 1
    cached = min(max(cached_tokens, 0), prompt_tokens)
    return min(groups - 1, cached * groups // prompt_tokens)  # integers: no 5.999… at 60 %


class PriorityGroups(Generic[T]):
    """A waiting queue of P groups; ``pop`` takes from the groups in proportion to their weights."""

    def __init__(self, groups: int = PRIORITY_GROUPS) -> None:
        if groups < 1:
            raise ValueError("groups must be >= 1")
        self.groups = groups
        self._queues: list[deque[T]] = [deque() for _ in range(groups)]
        self._group_of: dict[int, int] = {}
        self._current = [0] * groups

    @staticmethod
    def weight(group: int) -> int:
        return group + 1

    def push(self, item: T, cached_tokens: int, prompt_tokens: int) -> int:
        """Queue ``item`` at the back of its group; returns the group."""
        return self._file(item, priority_group(cached_tokens, prompt_tokens, self.groups), front=False)

    def push_front(self, item: T, cached_tokens: int, prompt_tokens: int) -> int:
        """A preempted request: the front of its group."""
        return self._file(item, priority_group(cached_tokens, prompt_tokens, self.groups), front=True)

    def update(self, item: T, cached_tokens: int, prompt_tokens: int) -> int:
        """Re-file a queued request whose cached fraction changed (it keeps its arrival order only
        within its old group: it goes to the back of the new one when the group changes)."""
        group = priority_group(cached_tokens, prompt_tokens, self.groups)
        if self._group_of[id(item)] != group:
            self.remove(item)
            self._file(item, group, front=False)
        return group

    def _file(self, item: T, group: int, front: bool) -> int:
        if id(item) in self._group_of:
            raise ValueError("item is already queued")
        if front:
            self._queues[group].appendleft(item)
        else:
            self._queues[group].append(item)
        self._group_of[id(item)] = group
        return group

    def _next_group(self, commit: bool) -> int:
        live = [g for g in range(self.groups) if self._queues[g]]
        if not live:
            raise IndexError("pop from an empty queue")
        current = list(self._current)
        total = 0
        for g in live:
            current[g] += self.weight(g)
            total += self.weight(g)
        best = max(reversed(live), key=lambda g: current[g])  # ties: the higher group
        current[best] -= total
        if commit:
            self._current = current
        return best

    def peek(self) -> T:
        return self._queues[self._next_group(commit=False)][0]

    def pop(self) -> T:
        item = self._queues[self._next_group(commit=True)].popleft()
        del self._group_of[id(item)]
        return item

    def remove(self, item: T) -> None:
        group = self._group_of.pop(id(item))
        self._queues[group].remove(item)

    def group_of(self, item: T) -> int:
        return self._group_of[id(item)]

    def __len__(self) -> int:
        return len(self._group_of)

    def __contains__(self, item: object) -> bool:
        return id(item) in self._group_of

    def __iter__(self) -> Iterator[T]:
        """The order ``pop`` would hand the requests out in (nothing is popped)."""
        saved_current = list(self._current)
        saved_queues = [deque(q) for q in self._queues]
        try:
            order: list[T] = []
            while any(self._queues):
                order.append(self._queues[self._next_group(commit=True)].popleft())
            return iter(order)
        finally:
            self._current, self._queues = saved_current, saved_queues


def select_batch(
    items: Iterable[T],
    n: int,
    cached_fraction: Callable[[T], float],
    groups: int = PRIORITY_GROUPS,
) -> list[T]:
    """The first ``n`` of ``items`` (in arrival order) a fresh queue of P groups hands out."""
    queue: PriorityGroups[T] = PriorityGroups(groups)
    for item in items:
        queue.push(item, round(cached_fraction(item) * 1_000_000), 1_000_000)
    return [queue.pop() for _ in range(min(n, len(queue)))]


def group_counts(
    batch: Sequence[T], group_of: Callable[[T], int], groups: int = PRIORITY_GROUPS
) -> list[int]:
    """How many of ``batch`` come from each group (index = group)."""
    counts = [0] * groups
    for item in batch:
        counts[group_of(item)] += 1
    return counts
