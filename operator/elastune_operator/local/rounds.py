"""The control rounds of `elastune serve` and `elastune run`, surviving a Redis that goes away.

A round that cannot reach Redis is skipped, said once per outage: the workers keep their state and retry,
the gateway routes from its last view of the registry, and the first round after Redis is back re-asserts
what the control plane owns there (a Redis restarted empty included). Before, the first such round
raised out of the loop and `elastune serve` exited, taking the gateway and the workers with it.
"""

from __future__ import annotations

import time
from typing import Protocol, TextIO

import redis

from elastune_common.bus import BusUnreachable

REDIS_AWAY = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, BusUnreachable)


class Ticking(Protocol):
    def tick(self) -> None: ...


class Rounds:
    def __init__(self, core: Ticking, err: TextIO) -> None:
        self.core = core
        self.err = err
        self.away_since: float | None = None
        self.skipped = 0

    def tick(self) -> bool:
        """One round; False when Redis could not be reached (the round is skipped)."""
        try:
            self.core.tick()
        except REDIS_AWAY as exc:
            self.skipped += 1
            if self.away_since is None:
                self.away_since = time.monotonic()
                print(
                    f"Redis unreachable ({exc}); serving on, retrying every round", file=self.err, flush=True
                )
            return False
        if self.away_since is not None:
            away = time.monotonic() - self.away_since
            print(f"Redis is back after {away:.1f} s", file=self.err, flush=True)
            self.away_since = None
        return True
