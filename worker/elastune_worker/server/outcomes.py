"""How an assignment ends other than with success: cancelled by the control plane, or failed with a
CamelCase reason for the job's status (docs/design.md §5). A failure never ends the worker: the agent
posts it and takes the next assignment."""

from __future__ import annotations

import time

from elastune_common.bus import Bus
from elastune_contract.vocabulary import Reason
from elastune_worker.comm import ChannelError, CollectiveTimeout
from elastune_worker.storage import s3
from elastune_worker.tuning.data import DatasetError
from elastune_worker.tuning.trainer import CheckpointMismatch


class Cancelled(Exception):
    """The control plane gave the attempt up (or the worker is stopping)."""


class AssignmentFailed(Exception):
    """The assignment cannot run as given; ``reason`` is what the job's status says."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class CancelCheck:
    """bus.cancelled(), at most every 0.25 s: called once per step and while polling peers."""

    def __init__(self, bus: Bus, job: str, attempt: int) -> None:
        self.bus, self.job, self.attempt = bus, job, attempt
        self._next = 0.0
        self._value = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self._value and now >= self._next:
            self._next = now + 0.25
            try:
                self._value = self.bus.cancelled(self.job, self.attempt)
            except Exception:
                self._value = False  # Redis hiccup: the collective timeout still bounds the wait
        return self._value


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """(reason, message) of a failed assignment, the reason a CamelCase constant for the job's status."""
    if isinstance(exc, AssignmentFailed):
        return exc.reason, str(exc)
    if isinstance(exc, DatasetError | s3.StorageError):
        return exc.reason, str(exc)
    if isinstance(exc, ChannelError):
        return Reason.CHANNEL_UNREACHABLE, f"gradient storage channel: {exc}"
    if isinstance(exc, CollectiveTimeout):
        return Reason.COLLECTIVE_TIMEOUT, str(exc)
    if isinstance(exc, CheckpointMismatch):
        return Reason.CHECKPOINT_MISMATCH, str(exc)
    if isinstance(exc, ValueError):  # config checks: context too long, bad combination of fields
        return Reason.INVALID_SPEC, str(exc)
    return Reason.WORKER_ERROR, f"{type(exc).__name__}: {exc}"
