"""The interface every scheduling policy implements, and what it shares with its callers.

The implementations (``prompttuner.py``, ``baselines.py``) and the factory that picks one by name
(``factory.py``) sit beside this module; this one imports none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from .estimator import Estimator
from .state import ClusterState, Job, RoundDecision

PolicyName = Literal["promptTuner", "infless", "elasticflow"]
"""The typed setting that chooses a policy (CoreSettings.policy, ELASTUNE_SCHEDULING_POLICY)."""
POLICY_NAMES: tuple[PolicyName, ...] = get_args(PolicyName)
Billing = Literal["warm_pool", "fixed_cluster"]

ROUND_SECONDS = 0.05
"""Scheduling round period (paper §5.3: both allocators run every 50 ms)."""


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """One LLM's warm pool bounds, from its WarmPool (spec.minWarmGPUs, maxWarmGPUs, idleWindow).

    Each pool keeps its own: a policy holds them per LLM, so one WarmPool never changes another's."""

    min_warm: int = 0
    """Never shrink the pool below this; grow up to it eagerly."""
    max_warm: int | None = None
    """Never grow the pool past this (None: only the cold pool bounds it)."""
    idle_window_seconds: float | None = None
    """Idle warm GPUs return to the cold pool after this long (None: the policy's default)."""

    def __post_init__(self) -> None:
        if self.min_warm < 0:
            raise ValueError("min_warm must be >= 0")
        if self.max_warm is not None and self.max_warm < self.min_warm:
            raise ValueError("max_warm must be >= min_warm")
        if self.idle_window_seconds is not None and self.idle_window_seconds < 0:
            raise ValueError("idle_window_seconds must be >= 0")


class PoolLimitsTable:
    """Per-LLM ``PoolLimits`` with the policy's default idle window for pools that set none."""

    def __init__(self, default_idle_window_seconds: float) -> None:
        self.default_idle_window_seconds = default_idle_window_seconds
        self._limits: dict[str, PoolLimits] = {}

    def set(self, llm: str, limits: PoolLimits) -> None:
        self._limits[llm] = limits

    def get(self, llm: str) -> PoolLimits:
        return self._limits.get(llm, _NO_LIMITS)

    def min_warm(self, llm: str) -> int:
        return self.get(llm).min_warm

    def max_warm(self, llm: str) -> int | None:
        return self.get(llm).max_warm

    def idle_window(self, llm: str) -> float:
        window = self.get(llm).idle_window_seconds
        return self.default_idle_window_seconds if window is None else window


_NO_LIMITS = PoolLimits()


class Policy(Protocol):
    name: str
    estimator: Estimator
    keep_warm: bool
    """Runtime reuse: a finished job's GPUs stay warm in their pool (False: back to cold at once)."""
    billing: Billing
    """warm_pool: pay for GPUs while they are in a warm pool; fixed_cluster: pay for the whole cluster."""

    def set_pool_limits(self, llm: str, limits: PoolLimits) -> None:
        """A WarmPool for ``llm`` was added or changed: its bounds from now on (other pools keep theirs)."""
        ...

    def bank_budget_seconds(self, slo_seconds: float) -> float:
        """The Prompt Bank latency budget for a job with this SLO (PromptTuner §4.4.3); the workers
        re-check it with the bank's own predicted lookup time."""
        ...

    def admit(self, state: ClusterState, job: Job, now: float) -> None:
        """Called once when a job arrives: decide the Prompt Bank (its budget, ``bank_budget_seconds``
        of the job's SLO, kept on ``job``), admission control, then submit."""
        ...

    def round(self, state: ClusterState, now: float) -> RoundDecision:
        """One scheduling round. Must not mutate ``state``; the environment applies the decision."""
        ...


@dataclass(slots=True)
class RoundCache:
    """Skips rounds whose inputs are unchanged, exactly.

    A round reads the state (``state.version``) and the clock. Each policy records, while deciding,
    every future instant at which a comparison against ``now`` could flip (e.g. the latest moment a
    job can still start on k GPUs and meet its deadline); until the earliest of them, with an unchanged
    state, a full recomputation provably returns the same (empty) decision. Tests check that claim.
    """

    version: int = -1
    horizon: float = -math.inf
    state_id: int = 0
    hits: int = 0
    misses: int = 0

    def fresh(self, state: ClusterState, now: float) -> bool:
        if id(state) == self.state_id and state.version == self.version and now < self.horizon:
            self.hits += 1
            return True
        self.misses += 1
        return False

    def store(self, state: ClusterState, horizon: float) -> None:
        self.state_id = id(state)
        self.version = state.version
        self.horizon = horizon
