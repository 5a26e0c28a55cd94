"""The gateway's fair waiting line (issue 25 item 3): a bounded number of requests in flight per endpoint,
and in front of it per-key queues served by virtual token counters (``fair_queue.py``).

Why here: without a bound the gateway forwards every request at once and they queue first-come-first-
served in the engine, so a key that floods (within its per-minute limits) delays every other key's
requests behind its own. With the bound, requests beyond what the endpoints run at once wait in the
gateway, where the next one to go is the backlogged key's that was served fewest weighted tokens; a
key with little traffic is served next whatever the flooder has queued. The line is bounded per key
(429 + Retry-After: the flooder is throttled, not the others) and overall (503 + Retry-After), and a
request waits in it at most ``timeout_s`` (503).

Headroom: while more than one key has sent requests within ``active_window_s``, one key holds at most
the capacity less one slot per other such key. Requests of the same length started together end
together, so with every slot held by the flood a light key's request would wait for the next batch to
end (measured: `elastune bench tenancy`); with the headroom it finds a free slot. The price: a flooding
key gets (capacity - 1) / capacity of the endpoints while another key is active, all of them otherwise.

One line per group of endpoints that share load (a base model and its adapters): the group's capacity
is what its endpoints take at once (the caller computes it from the endpoints it knows, each endpoint's
own cap summed; None: unbounded).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from elastune_contract.openai_api.errors import APIError

from .fair_queue import FairQueue, LineFull

Capacity = Callable[[], int | None]
"""Requests the group's endpoints take at once now (None: no bound)."""


@dataclass(slots=True)
class Ticket:
    """A request's place among the group's requests in flight: released once its answer is over (a
    second release is a no-op); ``settle`` corrects the estimated cost charged to its key."""

    line: FairLine
    group: str
    client: str
    estimate: float
    waited_s: float = 0.0
    released: bool = False
    settled: bool = False

    def settle(self, input_tokens: int, output_tokens: int) -> None:
        if self.settled or not (input_tokens or output_tokens):
            return
        self.settled = True
        queue = self.line.queue(self.group)
        queue.charge(self.client, queue.cost(input_tokens, output_tokens) - self.estimate)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.line.release(self)


ACTIVE_WINDOW_S = 10.0
"""A key that sent a request this recently counts as active for the headroom."""


@dataclass(slots=True)
class _Group:
    queue: FairQueue[asyncio.Future[Ticket]]
    capacity: Capacity
    active: int = 0
    held: dict[str, int] = field(default_factory=dict)
    """Slots held per key."""
    seen: dict[str, float] = field(default_factory=dict)
    """Loop time of each key's latest request."""


class FairLine:
    def __init__(
        self,
        max_per_key: int,
        max_total: int,
        timeout_s: float,
        retry_after_s: int,
        active_window_s: float = ACTIVE_WINDOW_S,
    ) -> None:
        self.max_per_key, self.max_total = max_per_key, max_total
        self.active_window_s = active_window_s
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._groups: dict[str, _Group] = {}

    def queue(self, group: str) -> FairQueue[asyncio.Future[Ticket]]:
        return self._groups[group].queue

    def queued(self) -> int:
        return sum(len(g.queue) for g in self._groups.values())

    def active(self, group: str) -> int:
        held = self._groups.get(group)
        return 0 if held is None else held.active

    async def enter(
        self, group: str, client: str, input_tokens: float, output_tokens: float, capacity: Capacity
    ) -> Ticket:
        """A ticket once the group has room and this request is the fair next one; 429 / 503 when the
        line is full for this key / overall, 503 after ``timeout_s`` in it."""
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group(FairQueue(self.max_per_key, self.max_total), capacity)
        g.capacity = capacity  # the latest caller knows the latest endpoints
        cost = g.queue.cost(input_tokens, output_tokens)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Ticket] = loop.create_future()
        try:
            g.queue.push(client, waiter, cost)
        except LineFull as full:
            raise self._refusal(full, client, group) from None
        entered = g.seen[client] = loop.time()
        self._dispatch(group, g)
        if not waiter.done():
            try:
                await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
            except TimeoutError:
                if not waiter.done():
                    g.queue.remove(client, waiter)
                    waiter.cancel()
                    raise APIError(
                        503, f"No free slot for model `{group}` within {self.timeout_s:g} s (its endpoints "
                        "are busy with other requests); retry later",
                        headers={"Retry-After": str(self.retry_after_s)},
                    ) from None  # fmt: skip
            except asyncio.CancelledError:  # the client went away while queued
                if waiter.done() and not waiter.cancelled():
                    waiter.result().release()
                else:
                    g.queue.remove(client, waiter)
                    waiter.cancel()
                raise
        ticket = waiter.result()
        ticket.waited_s = loop.time() - entered
        return ticket

    def release(self, ticket: Ticket) -> None:
        g = self._groups.get(ticket.group)
        if g is None:
            return
        g.active -= 1
        g.held[ticket.client] -= 1
        if not g.held[ticket.client]:
            del g.held[ticket.client]
        self._dispatch(ticket.group, g)

    def refresh(self) -> None:
        """The endpoints changed (or may have): let in what the groups' capacities now allow."""
        for name, g in list(self._groups.items()):
            self._dispatch(name, g)
            if not len(g.queue) and not g.active:
                del self._groups[name]
            else:
                g.queue.forget_idle()
                horizon = asyncio.get_running_loop().time() - self.active_window_s
                g.seen = {c: t for c, t in g.seen.items() if t >= horizon}

    def _dispatch(self, name: str, g: _Group) -> None:
        if not len(g.queue):
            return
        capacity = g.capacity()
        eligible = None
        if capacity is not None:
            horizon = asyncio.get_running_loop().time() - self.active_window_s
            others = sum(t >= horizon for t in g.seen.values()) - 1  # besides the key asking

            def eligible(client: str) -> bool:
                return g.held.get(client, 0) < max(1, capacity - others)

        while len(g.queue) and (capacity is None or g.active < capacity):
            served = g.queue.pop(eligible)
            if served is None:  # only keys at their share are waiting: the headroom stays free
                break
            client, waiter, charged = served
            if waiter.done():  # given up (never normally here: a waiter leaving removes itself)
                g.queue.charge(client, -charged)
                continue
            g.active += 1
            g.held[client] = g.held.get(client, 0) + 1
            waiter.set_result(Ticket(self, name, client, charged))

    def _refusal(self, full: LineFull, client: str, group: str) -> APIError:
        retry = {"Retry-After": str(self.retry_after_s)}
        if full.bound == "client":
            return APIError(
                429, f"Too many requests of API key {client} are queued for model `{group}` (at most "
                f"{full.limit}); retry later",
                headers=retry,
            )  # fmt: skip
        return APIError(
            503, f"The gateway's queue for busy endpoints is full ({full.limit} requests); retry later",
            headers=retry,
        )  # fmt: skip
