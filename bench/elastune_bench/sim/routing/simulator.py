"""A discrete-event simulator that drives the gateway's routing policies (the very objects the gateway
uses, through ``Router.pick``/``on_routed``/``on_finished``) over many simulated endpoints.

Events: arrivals (routed at once, queued at the chosen endpoint), iteration ends (each endpoint runs
iterations back to back while it has work, ``engine.SimEndpoint``), and wake-ups of an idle endpoint
whose queued request waits for an adapter load. At equal times iteration ends go first, then wake-ups,
then arrivals. A finished turn of a conversation schedules the next one after its think time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from elastune_gateway.routing.policy import RequestView, Router

from .engine import EngineSpec, SimEndpoint
from .metrics import Summary, summarize
from .workloads import SimRequest

_ITER_END, _WAKE, _ARRIVAL = 0, 1, 2
OutputPrediction = Literal["none", "oracle"]


@dataclass(slots=True)
class SimResult:
    summary: Summary
    requests: list[SimRequest]
    """Every request that arrived (later turns included), in arrival order."""
    endpoints: list[SimEndpoint]


class Simulator:
    def __init__(
        self,
        router: Router,
        specs: Sequence[EngineSpec],
        adapter_ranks: dict[str, int] | None = None,
        predict_output: OutputPrediction = "none",
        check: bool = False,
    ) -> None:
        """One endpoint per spec (``e0``, ``e1``, …). ``predict_output`` "oracle" hands policies the true
        output length as the gateway's prediction (SSJF's oracle); "none" gives them none. ``check``
        asserts every endpoint's invariants after each iteration (tests)."""
        if not specs:
            raise ValueError("at least one endpoint")
        self.router = router
        self.endpoints = [SimEndpoint(f"e{i}", spec, adapter_ranks, check) for i, spec in enumerate(specs)]
        self._by_id = {e.id: e for e in self.endpoints}
        self.predict_output = predict_output
        self.check = check
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._views: dict[int, RequestView] = {}
        self._wake_at: dict[str, float] = {}
        self.now = 0.0

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), payload))

    def run(self, requests: Sequence[SimRequest], label: str | None = None, warmup: float = 0.0) -> SimResult:
        """Simulate until every request (and every later turn) finished; statistics leave out the
        first ``warmup`` fraction of requests by arrival."""
        arrived: list[SimRequest] = []
        for r in requests:
            if math.isnan(r.arrival):
                raise ValueError(f"request {r.id} has no arrival time")
            self._push(r.arrival, _ARRIVAL, r)
        while self._events:
            t, kind, _, payload = heapq.heappop(self._events)
            self.now = t
            if kind == _ARRIVAL:
                assert isinstance(payload, SimRequest)
                arrived.append(payload)
                self._arrive(payload, t)
            elif kind == _ITER_END:
                assert isinstance(payload, SimEndpoint)
                self._iteration_end(payload, t)
            else:
                assert isinstance(payload, SimEndpoint)
                if self._wake_at.get(payload.id) == t:
                    del self._wake_at[payload.id]
                if payload.plan is None:
                    self._kick(payload, t)
        unfinished = [r.id for r in arrived if r.finished is None]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} requests never finished, e.g. {unfinished[:5]}")
        name = label or str(getattr(self.router, "name", type(self.router).__name__))
        summary = summarize(name, len(self.endpoints), arrived, self.endpoints, warmup)
        return SimResult(summary, arrived, self.endpoints)

    def _arrive(self, req: SimRequest, now: float) -> None:
        view = RequestView(
            req.id,
            req.tokens,
            adapter=req.adapter,
            rank=req.rank,
            predicted_output_tokens=req.output_tokens if self.predict_output == "oracle" else None,
            ttft_slo=req.ttft_slo,
            tpot_slo=req.tpot_slo,
        )
        endpoint = self._by_id[self.router.pick(view, [e.view(now) for e in self.endpoints], now)]
        endpoint.enqueue(req, now)
        self.router.on_routed(view, endpoint.id, now)
        self._views[id(req)] = view
        if endpoint.plan is None:
            self._kick(endpoint, now)

    def _kick(self, endpoint: SimEndpoint, now: float) -> None:
        end, wake = endpoint.start_iteration(now)
        if end is not None:
            self._push(end, _ITER_END, endpoint)
        elif wake is not None and wake > now:
            pending = self._wake_at.get(endpoint.id)
            if pending is None or wake < pending:
                self._wake_at[endpoint.id] = wake
                self._push(wake, _WAKE, endpoint)

    def _iteration_end(self, endpoint: SimEndpoint, now: float) -> None:
        _, done = endpoint.finish_iteration(now)
        if self.check:
            endpoint.check()
        for req in done:
            view = self._views.pop(id(req))
            self.router.on_finished(view, endpoint.id, req.output_tokens, now, req.output_ids)
            req.release_tokens()
            nxt = req.next_turn
            if nxt is not None:
                nxt.arrival = now + req.think_time
                self._push(nxt.arrival, _ARRIVAL, nxt)
        self._kick(endpoint, now)
