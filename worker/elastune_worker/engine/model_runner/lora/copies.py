"""When an adapter's host→device copy is done (CaraServe's cold-start window).

The device tier asks one question of its copies — which are still in flight — and may wait for some of
them (on-demand loading). ``DeviceCopies`` answers it for the real copy: on CUDA each copy runs on a side
stream and is in flight until its event completes; on a CPU the "copy" is a memory copy, done when it
returns. ``EmulatedCopies`` is an EMULATION that benchmarks and tests inject on a CPU-only machine to give
each copy the time it would take on a GPU; the product never builds one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

#: Bytes of a Llama-2-7B adapter per unit of rank: q, k, v in fp16 over 32 layers (rank × 3 × 8,192 × 2 B ×
#: 32 ≈ 1.5 MiB), the size CaraServe's §2.3 measures copies by.
LLAMA2_7B_ADAPTER_BYTES_PER_RANK = 3 * 8192 * 2 * 32


class CopyTiming(Protocol):
    def started(self, name: str, rank: int, event: Any | None) -> None:
        """A copy of ``name`` (its rank) was issued; ``event`` completes with it on CUDA (else None)."""

    def in_flight(self) -> set[str]:
        """Adapters whose copy has not completed."""

    def wait(self, names: Iterable[str]) -> None:
        """Block until the copies of ``names`` have completed."""

    def forget(self, name: str) -> None:
        """``name`` left the device: its copy no longer matters."""


class DeviceCopies:
    """The real copies: CUDA events of the side stream (CPU copies complete before ``started``)."""

    def __init__(self) -> None:
        self._events: dict[str, Any] = {}

    def started(self, name: str, rank: int, event: Any | None) -> None:
        if event is not None:
            self._events[name] = event

    def in_flight(self) -> set[str]:
        for name in [n for n, e in self._events.items() if e.query()]:
            del self._events[name]
        return set(self._events)

    def wait(self, names: Iterable[str]) -> None:
        for name in names:
            event = self._events.pop(name, None)
            if event is not None:
                event.synchronize()

    def forget(self, name: str) -> None:
        self._events.pop(name, None)


class EmulatedCopies:
    """EMULATION for CPU-only machines: each copy takes the time a Llama-2-7B adapter of the same rank
    takes at ``gbps`` GB/s, measured on ``clock`` (monotonic seconds; tests may pass their own)."""

    def __init__(self, gbps: float, clock: Callable[[], float] = time.monotonic) -> None:
        if gbps <= 0:
            raise ValueError("the emulated bandwidth must be > 0 GB/s")
        self.gbps, self.clock = gbps, clock
        self._ready_at: dict[str, float] = {}

    def seconds(self, rank: int) -> float:
        return rank * LLAMA2_7B_ADAPTER_BYTES_PER_RANK / (self.gbps * 1e9)

    def started(self, name: str, rank: int, event: Any | None) -> None:
        self._ready_at[name] = self.clock() + self.seconds(rank)

    def in_flight(self) -> set[str]:
        now = self.clock()
        for name in [n for n, t in self._ready_at.items() if t <= now]:
            del self._ready_at[name]
        return set(self._ready_at)

    def wait(self, names: Iterable[str]) -> None:
        until = max((self._ready_at.pop(n) for n in list(names) if n in self._ready_at), default=None)
        if until is not None:
            time.sleep(max(0.0, until - self.clock()))

    def forget(self, name: str) -> None:
        self._ready_at.pop(name, None)
