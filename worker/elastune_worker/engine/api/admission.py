"""The bound on requests a worker holds before they start: a request is *queued* from the moment the API
accepts it until its first output comes back from the engine (waiting in the engine's queue, or in its
prefill). Past ``--max-queued-requests`` a new request gets 503 with ``Retry-After`` (OpenAI-shaped)
instead of joining an unbounded queue: a flood reaching a worker directly, or through a gateway without
its fair line, costs memory and a place in line for every later request. (Behind the gateway's fair line
a worker never holds more than its batch; the gateway passes this 503 on, it does not retry it on another
endpoint.) Ollama bounds its queue the same way (``OLLAMA_MAX_QUEUE``, 503 past it).

Counted by the API, not read from the engine's stats: those are updated once per engine step, so a
burst arriving within one step would pass the bound whole.
"""

from __future__ import annotations

import weakref

from elastune_worker.engine.client import EngineBusy

DEFAULT_MAX_QUEUED_REQUESTS = 1024


class QueueBound:
    """Tickets for queued requests, at most ``max_queued`` at once (one event loop: no lock needed)."""

    def __init__(self, max_queued: int = DEFAULT_MAX_QUEUED_REQUESTS) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self.queued = 0

    def admit(self, holder: object) -> QueueTicket:
        """A ticket for a new request (released by the holder's first output, its end, or its garbage
        collection: a stream whose client left before it began never runs its own cleanup);
        EngineBusy (503) when the queue is full."""
        if self.queued >= self.max_queued:
            raise EngineBusy(
                f"the worker's queue is full ({self.queued} requests wait for the engine; "
                f"--max-queued-requests {self.max_queued}); retry shortly or on another endpoint"
            )
        self.queued += 1
        ticket = QueueTicket(self)
        weakref.finalize(holder, ticket.release)
        return ticket


class QueueTicket:
    def __init__(self, bound: QueueBound) -> None:
        self._bound: QueueBound | None = bound

    def release(self) -> None:
        """Idempotent: the first call frees the place."""
        if self._bound is not None:
            self._bound.queued -= 1
            self._bound = None
