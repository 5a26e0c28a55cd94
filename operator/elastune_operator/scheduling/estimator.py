"""Execution-time estimator of PromptTuner (§4.4): T_warm(a) and T_cold per LLM, learned online.

T_warm(a) is an *upper bound* on a job's completion time on ``a`` warm GPUs: the maximum remaining
iterations × the time per iteration at ``a`` GPUs + the allocation overhead (+ the Prompt Bank lookup
when the job runs it first, §5.2: bank and tuning run sequentially on the same GPUs).

Per-LLM profiles start from configuration and are corrected from observations: each observed run
updates an EWMA of its own GPU count, and a model-wide correction factor so GPU counts never observed
also benefit. A job on A GPUs fresh from the cold pool waits for the slowest of them, so T_cold(A)
is the empirical A/(A+1) quantile of recent warm-ups (the expected maximum of A draws).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class LLMProfile:
    """Starting profile of one LLM's prompt-tuning runtime (from configuration or WarmPool status)."""

    name: str
    iteration_seconds: float
    """Seconds per tuning iteration on one GPU at the job's global batch."""
    cold_start_seconds: float
    """T_cold: container + runtime + weights load of one GPU taken from the cold pool."""
    warm_overhead_seconds: float = 2.0
    """Allocation overhead on already-warm GPUs (instances connecting; paper §5.1: at most ~2 s)."""
    comm_fraction: float = 0.005
    """Gradient sync share of an iteration when a > 1 (paper §2.2: 0.4–0.5 %)."""
    bank_lookup_seconds: float = 6.0
    """Predicted Prompt Bank lookup latency for this LLM (paper §6.3: 5.3–9.2 s at K=50)."""
    max_gpus_per_job: int = 32
    """Upper bound on A for one job (LPT jobs request at most tens of GPUs, paper §7)."""

    def __post_init__(self) -> None:
        if self.iteration_seconds <= 0 or self.cold_start_seconds < 0 or self.max_gpus_per_job < 1:
            raise ValueError(f"invalid profile for {self.name!r}: {self}")


def model_iteration_seconds(profile: LLMProfile, gpus: int) -> float:
    """Near-linear data-parallel scaling with a small synchronisation term."""
    if gpus <= 1:
        return profile.iteration_seconds
    return profile.iteration_seconds / gpus * (1.0 + profile.comm_fraction)


@dataclass(slots=True)
class _LLMState:
    profile: LLMProfile
    observed: dict[int, float] = field(default_factory=dict)  # EWMA s/iter by GPU count
    correction: float = 1.0  # EWMA of observed / model, applied to unobserved GPU counts
    cold_samples: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    cold_sorted: list[float] = field(default_factory=list)
    # EWMA of iterations used / maximum iterations of finished jobs, with and without the Prompt Bank.
    used_fraction: dict[bool, float] = field(default_factory=lambda: {True: 1.0, False: 1.0})
    coserved: float | None = None  # EWMA s/iter of co-served steps (one pod, beside inference)
    table: list[float] = field(default_factory=list)  # s/iter at a = index + 1
    neg_table: list[float] = field(default_factory=list)  # -table, ascending, for bisect


class Estimator:
    """Per-LLM time model used by every policy (PromptTuner and the baselines alike)."""

    def __init__(self, profiles: list[LLMProfile], ewma_alpha: float = 0.3) -> None:
        if not 0 < ewma_alpha <= 1:
            raise ValueError("ewma_alpha must be in (0, 1]")
        self._alpha = ewma_alpha
        self._llms: dict[str, _LLMState] = {}
        for p in profiles:
            self.register(p)

    # -- profiles ---------------------------------------------------------------------------------
    def register(self, profile: LLMProfile) -> None:
        state = _LLMState(profile)
        self._llms[profile.name] = state
        self._rebuild(state)

    def profile(self, llm: str) -> LLMProfile:
        return self._state(llm).profile

    def llms(self) -> list[str]:
        return list(self._llms)

    def _state(self, llm: str) -> _LLMState:
        try:
            return self._llms[llm]
        except KeyError:
            raise KeyError(f"no profile for LLM {llm!r}; known: {sorted(self._llms)}") from None

    def _rebuild(self, s: _LLMState) -> None:
        p = s.profile
        s.table = [
            s.observed.get(a, model_iteration_seconds(p, a) * s.correction)
            for a in range(1, p.max_gpus_per_job + 1)
        ]
        # Observations can be noisy; keep the table non-increasing so "fewest GPUs" search is exact.
        for i in range(1, len(s.table)):
            s.table[i] = min(s.table[i], s.table[i - 1])
        s.neg_table = [-t for t in s.table]

    # -- online updates ---------------------------------------------------------------------------
    def observe_iteration(self, llm: str, gpus: int, seconds_per_iteration: float) -> None:
        """Feed a measured time per iteration at ``gpus`` GPUs (from a finished or running job)."""
        s = self._state(llm)
        if seconds_per_iteration <= 0 or not 1 <= gpus <= s.profile.max_gpus_per_job:
            return
        a = self._alpha
        prev = s.observed.get(gpus)
        s.observed[gpus] = (
            seconds_per_iteration if prev is None else (1 - a) * prev + a * seconds_per_iteration
        )
        ratio = seconds_per_iteration / model_iteration_seconds(s.profile, gpus)
        s.correction = (1 - a) * s.correction + a * ratio
        self._rebuild(s)

    def observe_coserved_iteration(self, llm: str, seconds_per_iteration: float) -> None:
        """A co-served step's time, learned apart from dedicated ones: it depends on the inference
        load beside it, so it must not move the dedicated model (nor the correction factor)."""
        s = self._state(llm)
        if seconds_per_iteration <= 0:
            return
        prev, a = s.coserved, self._alpha
        s.coserved = seconds_per_iteration if prev is None else (1 - a) * prev + a * seconds_per_iteration

    def coserved_iteration_seconds(self, llm: str) -> float | None:
        return self._state(llm).coserved

    def observed_iteration_seconds(self, llm: str) -> dict[int, float]:
        """Measured seconds per iteration by GPU count (EWMA), for the WarmPool's status."""
        return dict(sorted(self._state(llm).observed.items()))

    def observe_completion(self, llm: str, used_bank: bool, iterations: float, max_iterations: float) -> None:
        """A job finished after ``iterations`` of the ``max_iterations`` it was sized on (it reached its
        target early)."""
        if max_iterations <= 0:
            return
        s = self._state(llm)
        frac = min(1.0, max(0.0, iterations / max_iterations))
        s.used_fraction[used_bank] = (1 - self._alpha) * s.used_fraction[used_bank] + self._alpha * frac

    def expected_fraction(self, llm: str, used_bank: bool) -> float:
        """Expected share of the maximum iterations a job really runs (1.0 until observed)."""
        return self._state(llm).used_fraction[used_bank]

    def observe_cold_start(self, llm: str, seconds: float) -> None:
        """Feed a measured warm-up time of one GPU taken from the cold pool."""
        if seconds >= 0:
            s = self._state(llm)
            s.cold_samples.append(seconds)
            s.cold_sorted = sorted(s.cold_samples)

    # -- queries ----------------------------------------------------------------------------------
    def curve(self, llm: str) -> tuple[list[float], list[float], float]:
        """(s/iter by GPU count − 1, its negation for bisect, warm overhead) — for hot loops."""
        s = self._state(llm)
        return s.table, s.neg_table, s.profile.warm_overhead_seconds

    def iteration_seconds(self, llm: str, gpus: int) -> float:
        s = self._state(llm)
        return s.table[min(gpus, len(s.table)) - 1]

    def cold_start(self, llm: str, gpus: int = 1) -> float:
        """T_cold_l for ``gpus`` GPUs warming up together: configured until observed, then the
        A/(A+1) quantile of the recent warm-ups."""
        s = self._state(llm)
        ordered = s.cold_sorted
        if not ordered:
            return s.profile.cold_start_seconds
        return ordered[min(len(ordered) - 1, int(gpus / (gpus + 1) * len(ordered)))]

    def warm_overhead(self, llm: str) -> float:
        return self._state(llm).profile.warm_overhead_seconds

    def max_gpus(self, llm: str) -> int:
        return self._state(llm).profile.max_gpus_per_job

    def t_warm(self, llm: str, remaining_iterations: float, gpus: int, bank_seconds: float = 0.0) -> float:
        """T_warm(a): upper bound on the time from allocation on warm GPUs to completion."""
        s = self._state(llm)
        # This exact expression (and association) is the one every fit test uses, so a boundary
        # case can never be "fits" in one place and "does not fit" in another.
        base = bank_seconds + s.profile.warm_overhead_seconds
        return base + remaining_iterations * s.table[min(gpus, len(s.table)) - 1]

    def fewest_gpus(
        self, llm: str, remaining_iterations: float, budget_seconds: float, bank_seconds: float = 0.0
    ) -> int:
        """Smallest a ≤ max_gpus_per_job with T_warm(a) ≤ budget; 0 when no a fits.

        Equivalent to Algorithm 1's ``while T_warm(A) > T_slo: A += 1`` loop, in O(log n).
        """
        s = self._state(llm)
        base = bank_seconds + s.profile.warm_overhead_seconds
        n = len(s.table)
        if remaining_iterations <= 0:
            return 1 if base <= budget_seconds else 0
        # table is non-increasing: bisection guesses the first a with table[a-1] <= room/iterations;
        # the exact T_warm comparison then settles rounding ties either way.
        a = bisect_left(s.neg_table, -(budget_seconds - base) / remaining_iterations) + 1
        a = min(max(a, 1), n)

        def fits(k: int) -> bool:
            return base + remaining_iterations * s.table[k - 1] <= budget_seconds

        while a > 1 and fits(a - 1):
            a -= 1
        while a <= n and not fits(a):
            a += 1
        return a if a <= n else 0

    def fewest_gpus_cold(
        self, llm: str, remaining_iterations: float, budget_seconds: float, bank_seconds: float = 0.0
    ) -> int:
        """Smallest a with T_warm(a) + T_cold(a) ≤ budget (GPUs taken from the cold pool); 0 if none."""
        a = self.fewest_gpus(
            llm, remaining_iterations, budget_seconds - self.cold_start(llm, 1), bank_seconds
        )
        if a == 0:
            return 0
        for k in range(a, self.max_gpus(llm) + 1):
            if (
                self.t_warm(llm, remaining_iterations, k, bank_seconds) + self.cold_start(llm, k)
                <= budget_seconds
            ):
                return k
        return 0
