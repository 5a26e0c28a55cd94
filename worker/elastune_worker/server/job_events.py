"""An assignment's events on its job's stream (started, progress, succeeded, failed, cancelled): what the
control plane reads to follow the attempt (docs/design.md §5)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastune_common.bus import Bus
from elastune_contract.protocol import Assignment, Event
from elastune_worker.server.metrics import WorkerMetrics
from elastune_worker.server.outcomes import Cancelled

if TYPE_CHECKING:
    from elastune_worker.tuning.trainer import StepInfo

log = logging.getLogger("elastune.worker")

RESULT_POST_SECONDS = 60.0
"""How long a worker keeps trying to post an attempt's result (succeeded or failed) through a Redis
blip, staying BUSY on the attempt meanwhile; then it gives up and the control plane, seeing the worker
READY without a result, retries the attempt (ResultLost). Below the control plane's stall floor."""


class JobReporter:
    """Posts the events of one assignment, stamped with its job, attempt, rank and this worker."""

    def __init__(self, bus: Bus, worker_id: str, assignment: Assignment, stopping: threading.Event) -> None:
        self.bus, self.worker_id, self.assignment = bus, worker_id, assignment
        self._stopping = stopping

    def report(self, type_: str, **fields: object) -> None:
        a = self.assignment
        event = Event(
            type=type_, job=a.job, attempt=a.attempt, rank=a.rank, worker=self.worker_id, proof=a.proof,
            **fields,  # type: ignore[arg-type]
        )  # fmt: skip
        self.post(event)

    def post(self, event: Event) -> None:
        """Progress may be lost (the next event says more); a result is retried with backoff for up to
        RESULT_POST_SECONDS, so a Redis blip does not lose it."""
        final = event.type in ("succeeded", "failed")
        deadline = time.monotonic() + (RESULT_POST_SECONDS if final else 0.0)
        delay = 0.2
        while True:
            try:
                self.bus.post(event)
                return
            except Exception as exc:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping.is_set():
                    log.error("cannot post %s event of %s: %s", event.type, event.job, exc)
                    return
                log.warning("cannot post %s event of %s (%s); retrying", event.type, event.job, exc)
                self._stopping.wait(min(delay, left))
                delay = min(2 * delay, 5.0)


class StepProgress:
    """The dedicated trainer's per-step callback: the worker's step metrics, the cancellation check, and
    on the lead rank a progress event at each evaluation or every ``progress_every`` steps, with the mean
    time per iteration since the last one."""

    def __init__(
        self,
        reporter: JobReporter,
        metrics: WorkerMetrics,
        cancelled: Callable[[], bool],
        checkpoint_every: int,
    ) -> None:
        self.reporter, self.metrics, self.cancelled = reporter, metrics, cancelled
        self.checkpoint_every = checkpoint_every
        self.lead = reporter.assignment.rank == 0
        self.progress_every = reporter.assignment.progress_every
        self._window: list[float] = []  # seconds of each step since the last progress event

    def __call__(self, info: StepInfo) -> None:
        self.metrics.steps.inc()
        self.metrics.compute.observe(info.seconds)
        self.metrics.sync.observe(info.sync_seconds)
        self._window.append(info.seconds + info.sync_seconds)
        if self.cancelled():
            raise Cancelled()
        if self.lead and (info.value is not None or len(self._window) >= self.progress_every):
            self.reporter.report(
                "progress",
                iterations=info.iterations,
                checkpointed=info.iterations - info.iterations % self.checkpoint_every,
                loss=info.loss,
                metric=info.metric,
                value=info.value,
                seconds_per_iteration=sum(self._window) / len(self._window),
                sync_seconds=info.sync_seconds,
            )
            self._window.clear()
