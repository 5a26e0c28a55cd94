"""Preble's local scheduler as the engine's waiting queue: the ``RequestQueue`` the simulated endpoint
hands the real scheduler (``elastune_worker.engine.core``) when its local queue is ``priority``.

A request is filed in the priority group of the fraction of its prompt cached on this endpoint when it
is queued (Preble §4.3, ``routing.priority``); a request that goes back (skipped for its adapter, or
preempted) returns to the front of the group it was filed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from elastune_gateway.routing.priority import PRIORITY_GROUPS, PriorityGroups
from elastune_worker.engine.core.sequence import Sequence


class PriorityGroupQueue:
    def __init__(self, cached_tokens: Callable[[Sequence], int], groups: int = PRIORITY_GROUPS) -> None:
        self._groups: PriorityGroups[Sequence] = PriorityGroups(groups)
        self._cached_tokens = cached_tokens
        self._filed: dict[str, int] = {}
        """Request id -> cached prompt tokens when it was queued (until ``forget``)."""

    def push(self, seq: Sequence) -> None:
        cached = self._cached_tokens(seq)
        self._filed[seq.request_id] = cached
        self._groups.push(seq, cached, len(seq.prompt_token_ids))

    def push_front(self, seq: Sequence) -> None:
        cached = self._filed.get(seq.request_id)
        if cached is None:
            cached = self._filed[seq.request_id] = self._cached_tokens(seq)
        self._groups.push_front(seq, cached, len(seq.prompt_token_ids))

    def forget(self, request_id: str) -> None:
        """The request finished: drop what it was filed with."""
        self._filed.pop(request_id, None)

    def peek(self) -> Sequence:
        return self._groups.peek()

    def pop(self) -> Sequence:
        return self._groups.pop()

    def remove(self, seq: Sequence) -> None:
        self._groups.remove(seq)

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._groups)
