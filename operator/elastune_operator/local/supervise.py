"""Restart with back-off for the processes `elastune serve` runs beside its workers: the embedded Redis
and the gateway (issue 38 item 5: either one killed was never restarted, and the gateway's exit ended the
whole serve). A process that keeps dying is restarted ever more slowly (1 s, 2 s, 4 s, ... at most
``MAX_BACKOFF_S``); one that stayed up ``STABLE_S`` starts again from the shortest delay."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0


@dataclass
class Backoff:
    name: str
    started_at: float = field(default_factory=time.monotonic)
    delay: float = FIRST_BACKOFF_S
    due: float | None = None
    """When the next restart may run (None: the process is up)."""
    restarts: int = 0

    def exited(self, now: float) -> float:
        """The process was found gone at ``now``: when to restart it."""
        if self.due is None:
            if now - self.started_at >= STABLE_S:
                self.delay = FIRST_BACKOFF_S
            self.due = now + self.delay
        return self.due

    def ready(self, now: float) -> bool:
        return self.due is not None and now >= self.due

    def restarted(self, now: float) -> None:
        self.restarts += 1
        self.started_at, self.due = now, None
        self.delay = min(self.delay * 2, MAX_BACKOFF_S)

    def failed(self, now: float) -> None:
        """The restart itself failed: try again after the next delay."""
        self.due = now + self.delay
        self.delay = min(self.delay * 2, MAX_BACKOFF_S)
