"""A virtual-token-counter fair queue (VTC: Sheng et al., "Fairness in Serving Large Language Models",
OSDI'24), as pure policy: no I/O, no clock, no asyncio.

Every client (an API key) has a counter of the service it received, in weighted tokens (input tokens
count ``input_weight`` each, output tokens ``output_weight``: a decoded token costs more than a
prefilled one). The next item served is the oldest of the backlogged client with the smallest counter,
so a client that was served less goes first whatever the order of arrival. A client that becomes
backlogged after being idle has its counter lifted to the smallest counter among the backlogged ones
(or, with nobody backlogged, to the counter of the client served last), so idleness banks no credit:
it cannot then take the server for itself to catch up.

Service is charged when an item is served, as the caller's estimate of its cost; the caller corrects the
estimate with ``charge`` once the real token counts are known (a negative correction is allowed). The
queue is bounded per client and overall: ``push`` raises ``LineFull`` naming which bound was hit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

DEFAULT_INPUT_WEIGHT = 1.0
DEFAULT_OUTPUT_WEIGHT = 2.0
"""The paper's weights (w_p = 1, w_q = 2)."""


class LineFull(Exception):
    """``push`` refused an item: its client's queue (``bound == "client"``) or the whole line is full."""

    def __init__(self, bound: Literal["client", "total"], limit: int) -> None:
        super().__init__(f"{bound} bound of {limit} queued items reached")
        self.bound: Literal["client", "total"] = bound
        self.limit = limit


@dataclass(slots=True)
class _Queued(Generic[T]):
    item: T
    cost: float


@dataclass(slots=True)
class _Client(Generic[T]):
    counter: float = 0.0
    queue: deque[_Queued[T]] = field(default_factory=deque)


class FairQueue(Generic[T]):
    """Per-client FIFO queues served by the smallest virtual token counter."""

    def __init__(
        self,
        max_per_client: int,
        max_total: int,
        input_weight: float = DEFAULT_INPUT_WEIGHT,
        output_weight: float = DEFAULT_OUTPUT_WEIGHT,
    ) -> None:
        if max_per_client < 1 or max_total < 1:
            raise ValueError("the bounds must be at least 1")
        self.max_per_client, self.max_total = max_per_client, max_total
        self.input_weight, self.output_weight = input_weight, output_weight
        self._clients: dict[str, _Client[T]] = {}
        self._backlogged: set[str] = set()
        self._size = 0
        self._last_served = 0.0
        """The counter of the client served last: the floor of a client arriving when nobody waits."""

    def cost(self, input_tokens: float, output_tokens: float) -> float:
        """Weighted tokens: what serving this much costs a client's counter."""
        return self.input_weight * input_tokens + self.output_weight * output_tokens

    def __len__(self) -> int:
        return self._size

    def queued(self, client: str) -> int:
        held = self._clients.get(client)
        return 0 if held is None else len(held.queue)

    def counter(self, client: str) -> float:
        held = self._clients.get(client)
        return 0.0 if held is None else held.counter

    def push(self, client: str, item: T, cost: float) -> None:
        """Queue ``item`` of ``client``, to be charged ``cost`` (weighted tokens) when served."""
        held = self._clients.get(client)
        if held is not None and len(held.queue) >= self.max_per_client:
            raise LineFull("client", self.max_per_client)
        if self._size >= self.max_total:
            raise LineFull("total", self.max_total)
        if held is None:
            held = self._clients[client] = _Client()
        if not held.queue:  # becomes backlogged: no credit banked while idle
            floor = min((self._clients[c].counter for c in self._backlogged), default=self._last_served)
            held.counter = max(held.counter, floor)
            self._backlogged.add(client)
        held.queue.append(_Queued(item, cost))
        self._size += 1

    def peek(self, eligible: Callable[[str], bool] | None = None) -> str | None:
        """The client whose item ``pop`` would serve next (among the ``eligible`` ones). Ties (a client
        just lifted to the smallest counter ties with its owner) go to the client with fewer items
        queued, then by name: the light client goes first rather than one more of the backlog's items."""
        candidates = self._backlogged if eligible is None else [c for c in self._backlogged if eligible(c)]
        if not candidates:
            return None
        clients = self._clients
        return min(candidates, key=lambda c: (clients[c].counter, len(clients[c].queue), c))

    def pop(self, eligible: Callable[[str], bool] | None = None) -> tuple[str, T, float] | None:
        """The next item to serve (of an ``eligible`` client), its client and the cost charged for it;
        None when nothing (eligible) is queued."""
        client = self.peek(eligible)
        if client is None:
            return None
        held = self._clients[client]
        queued = held.queue.popleft()
        self._size -= 1
        held.counter += queued.cost
        self._last_served = held.counter
        if not held.queue:
            self._backlogged.discard(client)
        return client, queued.item, queued.cost

    def remove(self, client: str, item: T) -> bool:
        """Take ``item`` out unserved (its waiter gave up); False when it is not queued."""
        held = self._clients.get(client)
        if held is None:
            return False
        for queued in held.queue:
            if queued.item is item:
                held.queue.remove(queued)
                self._size -= 1
                if not held.queue:
                    self._backlogged.discard(client)
                return True
        return False

    def charge(self, client: str, amount: float) -> None:
        """Add ``amount`` weighted tokens to ``client``'s counter (negative: an estimate corrected down)."""
        held = self._clients.get(client)
        if held is None:
            held = self._clients[client] = _Client()
        held.counter += amount

    def forget_idle(self) -> None:
        """Drop the counters of clients with nothing queued that sit at or below the floor a returning
        client would be lifted to anyway (keeps the table to the clients that matter)."""
        floor = min((self._clients[c].counter for c in self._backlogged), default=self._last_served)
        for name in [n for n, c in self._clients.items() if not c.queue and c.counter <= floor]:
            del self._clients[name]
