"""Requests the gateway has in flight, per endpoint: what it knows before the worker's next heartbeat.

Workers publish their queue once a second; between heartbeats the gateway's own ledger is the fresher
view of what it sent where (and the only one of each request's adapter, rank and SLO). A request counts
as prefilling until its first streamed byte came back (for a whole answer: until its predicted prefill
time passed), then as decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..routing.policy import ActiveRequest, RequestView


@dataclass(slots=True)
class InFlight:
    request: RequestView
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    prefill_done_at: float | None = None
    """Monotonic time its prefill is known (first byte) or estimated to be done."""
    closed: bool = False
    """Its end was accounted (ledger, router, metrics): ending it again is a no-op."""

    def active(self, now: float) -> ActiveRequest:
        r = self.request
        prefilling = self.prefill_done_at is None or now < self.prefill_done_at
        return ActiveRequest(
            rank=r.rank,
            adapter=r.adapter,
            tpot_slo=r.tpot_slo,
            prefill_left=r.prompt_len if prefilling else 0,
        )


class Ledger:
    def __init__(self) -> None:
        self._by_endpoint: dict[str, dict[str, InFlight]] = {}

    def add(self, request: RequestView, endpoint: str, prefill_estimate_s: float | None = None) -> InFlight:
        entry = InFlight(request, endpoint)
        if prefill_estimate_s is not None:
            entry.prefill_done_at = entry.started + prefill_estimate_s
        self._by_endpoint.setdefault(endpoint, {})[request.id] = entry
        return entry

    def first_byte(self, entry: InFlight) -> None:
        entry.prefill_done_at = time.monotonic()

    def remove(self, entry: InFlight) -> None:
        requests = self._by_endpoint.get(entry.endpoint)
        if requests is not None:
            requests.pop(entry.request.id, None)
            if not requests:
                del self._by_endpoint[entry.endpoint]

    def count(self, endpoint: str) -> int:
        return len(self._by_endpoint.get(endpoint, ()))

    def active(self, endpoint: str) -> tuple[ActiveRequest, ...]:
        now = time.monotonic()
        return tuple(e.active(now) for e in self._by_endpoint.get(endpoint, {}).values())

    def total(self) -> int:
        return sum(len(r) for r in self._by_endpoint.values())
