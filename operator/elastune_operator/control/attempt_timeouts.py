"""Attempt timeouts: bounded waits for tuning attempts (docs/design.md §6 bounds every wait).

These bound one attempt's waits; they are not the TuningJob's deadline (spec.deadline, its SLO, read
once into ``records.JobDeadline``). An attempt is watched from its dispatch until its result is in:

- it must start within ``start_timeout_s``: an event of the attempt, or its rank-0 worker's registry
  record running it (a worker that never popped the assignment, or whose events never arrive);
- once started it must keep making progress: the gap since its last event may not exceed
  max(stall_factor × progress_every × its own measured seconds per iteration, stall_floor_s);
- once its rank-0 worker no longer runs it (back READY, or on another attempt) its result must be in the
  event stream within ``result_grace_s``: else the result event was lost (a Redis blip while the
  worker posted it).

The core cancels an attempt that missed one of these and retries it from its checkpoint, or fails the
job with the reason after the retry limit. Pure policy: no I/O, unit-testable with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastune_contract.protocol import WorkerRecord, WorkerState
from elastune_contract.vocabulary import Reason


@dataclass
class AttemptTimeouts:
    """How long an attempt may wait at each stage (the operator reads the first two from
    ELASTUNE_ATTEMPT_START_DEADLINE and ELASTUNE_ATTEMPT_STALL_FLOOR, names kept for compatibility)."""

    start_timeout_s: float = 120.0
    """Seconds from dispatch until the attempt must have started. Its workers are warm and idle when
    it is dispatched, so a start takes a round trip through Redis; two minutes leave room for a slow
    pop (a Redis failover) without leaving a job stuck for long."""
    stall_factor: float = 10.0
    """A started attempt may go this many of its own progress intervals (progress_every iterations at
    its measured seconds per iteration) without an event."""
    stall_floor_s: float = 300.0
    """...but never less than this many seconds: the first evaluation, a Prompt Bank lookup, a
    checkpoint or an artifact upload report nothing while they run."""
    result_grace_s: float = 10.0
    """Seconds the result may take to appear after the attempt's rank-0 worker stopped running it (the
    worker posts the result before its record says READY; its post retries a blip for a while)."""


@dataclass
class AttemptWatch:
    """What the core knows of the attempt in flight."""

    attempt: int
    dispatched_at: float
    last_event_at: float
    started: bool = False
    seconds_per_iteration: float | None = None
    """The attempt's own measured step time (progress events)."""
    off_since: float | None = None
    """When its rank-0 worker was first seen not running it after it had started."""
    setup_s: float = 0.0
    """Added to the stall floor until its first progress event: the Prompt Bank lookup's budget, when
    the attempt runs one (it reports nothing while it looks the prompt up)."""
    progressed: bool = False

    def on_event(self, now: float, seconds_per_iteration: float | None, progress: bool = False) -> None:
        self.started = True
        self.last_event_at = now
        self.progressed = self.progressed or progress
        if seconds_per_iteration:
            self.seconds_per_iteration = seconds_per_iteration

    def observe_worker(self, job: str, rec: WorkerRecord | None, now: float) -> None:
        """The rank-0 worker's registry record this round (None: not in the registry; the fleet
        reports a lost worker itself)."""
        if rec is None:
            return
        running = rec.state is WorkerState.BUSY and rec.job == job and rec.attempt == self.attempt
        if running:
            if not self.started:
                self.started = True
                self.last_event_at = now  # the stall clock runs from the moment it was seen running
            self.off_since = None
        elif self.started and self.off_since is None:
            self.off_since = now


def overdue(
    watch: AttemptWatch,
    limits: AttemptTimeouts,
    now: float,
    *,
    progress_every: int,
    guess_seconds_per_iteration: float,
) -> tuple[str, str] | None:
    """(reason, message) when the attempt ran past one of its timeouts, else None."""
    if not watch.started:
        waited = now - watch.dispatched_at
        if waited > limits.start_timeout_s:
            return (
                Reason.ATTEMPT_NOT_STARTED,
                f"attempt {watch.attempt} did not start within {limits.start_timeout_s:g} s of its dispatch",
            )
        return None
    if watch.off_since is not None and now - watch.off_since > limits.result_grace_s:
        return (
            Reason.RESULT_LOST,
            f"attempt {watch.attempt} ended on its worker but its result never arrived",
        )
    spi = watch.seconds_per_iteration or guess_seconds_per_iteration
    floor = limits.stall_floor_s + (0.0 if watch.progressed else watch.setup_s)
    allowed = max(limits.stall_factor * max(1, progress_every) * spi, floor)
    silent = now - watch.last_event_at
    if silent > allowed:
        return (
            Reason.ATTEMPT_STALLED,
            f"attempt {watch.attempt} made no progress for {silent:.0f} s (allowed {allowed:.0f} s at "
            f"{spi:.3g} s per iteration)",
        )
    return None
