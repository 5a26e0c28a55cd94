"""Co-serving capacity for the PromptTuner scheduler (FlexLLM, issue 13): whether a tuning job should
run co-served on a pod that serves inference instead of growing its pool from the cold pool.

A co-served job gets what inference leaves of each iteration. FlexLLM measures how much finetuning
progress that is: at peak inference demand co-serving keeps "over 76 % of peak finetuning progress"
(FlexLLM abstract; §7: 7.2K vs 9.4K tokens/s on LLaMA-3.1-8B at 20 vs 4 req/s). The GPU model here reads
that as a linear derating of the dedicated rate with the pod's inference utilisation u ∈ [0, 1]:
rate = dedicated × (1 − (1 − 0.76) u). Where the paper is silent — whether "peak progress" equals a
dedicated GPU's — we take the stated intent (co-serving matches separate finetuning at light load,
§7.2) and set it equal. On a CPU decode is compute-bound, so a co-served job only gets the idle share,
at the efficiency measured by `elastune bench coserve` here (the runner in windows and micro-batches
takes 1.6-1.9x a dedicated step): rate = dedicated × 0.55 × (1 − u).

The decision is the scheduler's, made with what it knows now: the pod's utilisation (its peak of the
last minute, ``UtilizationPeaks``) stands for the rest of the job (a prediction), and the job is
co-served only when that prediction finishes it within ``SAFETY`` of the time left to its deadline. The
live scheduler applies it inside Algorithm 1 (``PromptTunerPolicy._coserve``, gangs of pods too), and
the mixed-workload simulation runs that same scheduler (``sim.mixed``). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

PEAK_DEMAND_RETENTION = 0.76
"""FlexLLM: share of peak finetuning progress kept at peak inference demand."""
CPU_EFFICIENCY = 0.55
"""Measured here (bench coserve): the co-served runner's step takes ~1.8x a dedicated one on a CPU."""
SAFETY = 0.8
"""Co-serve only when the predicted co-served time is at most this share of the time to the deadline
(the utilisation can rise after the decision)."""

CoServeKind = Literal["gpu", "cpu"]


@dataclass(frozen=True)
class CoServeModel:
    kind: CoServeKind = "gpu"

    def rate(self, utilization: float) -> float:
        """Co-served progress per second, as a share of a dedicated GPU's, at inference utilisation u."""
        u = min(max(utilization, 0.0), 1.0)
        if self.kind == "gpu":
            return 1.0 - (1.0 - PEAK_DEMAND_RETENTION) * u
        return CPU_EFFICIENCY * (1.0 - u)


def coserved_finish(
    start: float, dedicated_seconds: float, rate_at: Callable[[float], float], step: float, horizon: float
) -> float | None:
    """When work of ``dedicated_seconds`` started at ``start`` really ends as its co-serving rate
    changes (piecewise constant over ``step``: the pods' utilisation); None if not done by ``horizon``."""
    done, t = 0.0, start
    while t < horizon:
        edge = (int(t // step) + 1) * step
        r = rate_at(t)
        if r > 0 and done + (edge - t) * r >= dedicated_seconds:
            return t + (dedicated_seconds - done) / r
        done += (edge - t) * r
        t = edge
    return None


PEAK_WINDOW_SECONDS = 60.0
"""A pod's co-serving rate is read at its highest utilisation of the last minute, not its last report:
with instant reports a bursty load got co-served jobs that then stalled when the burst came back."""
RATE_STEP = 0.05
"""Rates are floored to this step so small swings of utilisation do not change the scheduler's input
every heartbeat (each change recomputes the round)."""


class UtilizationPeaks:
    """Per pod, the highest inference utilisation its heartbeats reported in the last window."""

    def __init__(self, window_seconds: float = PEAK_WINDOW_SECONDS) -> None:
        self.window = window_seconds
        self._reports: dict[str, deque[tuple[float, float]]] = {}

    def observe(self, pod: str, heartbeat: float, utilization: float) -> float:
        """Record one heartbeat's report (a heartbeat seen before is not counted twice); the peak."""
        q = self._reports.setdefault(pod, deque())
        if not q or heartbeat > q[-1][0]:
            q.append((heartbeat, utilization))
        while q and q[0][0] < heartbeat - self.window:
            q.popleft()
        return max(u for _, u in q)

    def forget(self, keep: set[str]) -> None:
        for pod in set(self._reports) - keep:
            del self._reports[pod]


def floored_rate(model: CoServeModel, utilization: float) -> float:
    return math.floor(model.rate(utilization) / RATE_STEP + 1e-9) * RATE_STEP
