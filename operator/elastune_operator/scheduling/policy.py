"""The policy interface every scheduler implements, and the factory that picks one by name."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

from .estimator import Estimator
from .state import ClusterState, Job, RoundDecision

PolicyName = Literal["promptTuner", "infless", "elasticflow"]
Billing = Literal["warm_pool", "fixed_cluster"]

ROUND_SECONDS = 0.05
"""Scheduling round period (paper §5.3: both allocators run every 50 ms)."""


class Policy(Protocol):
    name: str
    estimator: Estimator
    keep_warm: bool
    """Runtime reuse: a finished job's GPUs stay warm in their pool (False: back to cold at once)."""
    billing: Billing
    """warm_pool: pay for GPUs while they are in a warm pool; fixed_cluster: pay for the whole cluster."""

    def admit(self, state: ClusterState, job: Job, now: float) -> None:
        """Called once when a job arrives: decide the Prompt Bank, admission control, then submit."""
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


def make_policy(name: PolicyName, estimator: Estimator, **options: object) -> Policy:
    """Build a policy by its configuration name; options go to the policy's config dataclass."""
    from .baselines import ElasticFlowConfig, ElasticFlowPolicy, INFlessConfig, INFlessPolicy
    from .prompttuner import PromptTunerConfig, PromptTunerPolicy

    if name == "promptTuner":
        return PromptTunerPolicy(estimator, PromptTunerConfig(**options))  # type: ignore[arg-type]
    if name == "infless":
        return INFlessPolicy(estimator, INFlessConfig(**options))  # type: ignore[arg-type]
    if name == "elasticflow":
        return ElasticFlowPolicy(estimator, ElasticFlowConfig(**options))  # type: ignore[arg-type]
    raise ValueError(f"unknown policy {name!r}; choose one of promptTuner, infless, elasticflow")
