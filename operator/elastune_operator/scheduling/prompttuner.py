"""PromptTuner's Workload Scheduler (paper §4.4, Algorithms 1 and 2), one round at a time.

A round (every 50 ms) does, in this order:

1. Algorithm 1 per LLM — pending jobs sorted by SLO; each gets the fewest warm GPUs A ≤ R_l with
   T_warm(A) ≤ T_slo, all A at once (a gang), or waits (A = 0).
2. Algorithm 2 over all LLMs — pending jobs sorted by SLO; DelaySchedulable first (can the job meet
   its SLO by waiting for warm GPUs being released?); otherwise grow the LLM's warm pool from the
   shared cold pool by the fewest GPUs A with T_warm(A) + T_cold ≤ T_slo.
3. Best effort for jobs projected to miss their SLO (see ``_best_effort``).
4. Idle release: warm GPUs idle for longer than the window (60 s) return to the cold pool.

Interpretations of the paper's pseudo-code (each marked "Interpretation" below):

* Times. E_l holds absolute timestamps while Alg. 2 line 26 mixes them with durations
  (``T_i(k) − T_cur + E_l,k ≤ T_slo``) and line 30 stores a duration into E_l. We use absolute time
  throughout: the job can start on k GPUs at ``start = max(E_l,k, now)`` and meets its SLO iff
  ``start + T_warm(k) ≤ deadline`` (deadline = arrival + SLO); the reservation sets E_l,1:k to that
  finish time and keeps E_l sorted.
* Line 29's ``k < E_l.len`` would never use the last GPU of the pool; the intent is k ≤ |E_l|.
* Line 12's second conjunct ``T_slo < T_cold`` would stop the search immediately for any job whose SLO
  exceeds T_cold; the intent is "grow A while the SLO is not met and more GPUs can still help",
  bounded by the per-job maximum. Line 15 then adds GPUs only when the SLO is met.
* Jobs projected to miss: the paper delays them. Algorithm 1 as written would never allocate them
  (no A meets the SLO), i.e. starve them. We serve them best-effort after every job that can still
  meet its SLO: from idle warm GPUs nobody reserved, else by waiting for warm GPUs or growing the
  pool, whichever is predicted to start them sooner.
* T_cold in line 12/19 is the estimator's per-LLM value; T_i(A) in Alg. 2 is T_warm(A) (it includes
  the allocation overhead and the Prompt Bank lookup when the job runs it), matching line 19.
* Warm GPUs are handed out most-recently-idle first, so surplus GPUs age past the idle window and
  return to the cold pool instead of all staying lukewarm (the paper does not say which ones).
* Idle release never removes warm GPUs that DelaySchedulable counted on in this round.
* E_l's release times: sizing uses the paper's upper bound (maximum iterations), but jobs stop at
  their target, and the paper motivates DelaySchedulable precisely by Prompt-Bank jobs finishing
  early. By default (``release_prediction="learned"``) a running job's bound is scaled by the share of
  maximum iterations that finished jobs of the same LLM (with / without the bank) really used — a
  profile learned online like the others. ``"upper_bound"`` keeps the literal bound.

Co-serving (FlexLLM, issue 13; not in the paper). Warm GPUs whose pods serve inference
(``ClusterState.coserve_rate``) are not idle capacity for dedicated tuning — a dedicated job would take
the device from inference. Algorithm 1 offers them, after the idle dedicated GPUs, to a co-servable job
that the idle dedicated GPUs alone cannot start: the fewest k ≥ A GPUs (dedicated first, then serving
pods fastest first) whose co-served time ``bank + overhead + rem × T_iter(k) / rate`` — ``rate`` the
slowest member's, a data-parallel step waits for its slowest worker — is at most
``coserving.SAFETY`` of the time left; otherwise the job goes on to Algorithm 2 (wait or grow from the
cold pool), which counts no serving pod. This is how a job is "given co-served GPUs instead of growing
the pool from the cold pool when its predicted time on them still meets its SLO".

Ablations (paper Table 8): ``warm_allocator=False`` hands a job whatever warm GPUs are idle right
away and takes the rest of its A GPUs from the cold pool for it (each instance allocated on its own,
as a serverless platform would), instead of allocating all A together from the warm pool or waiting
for them; A then counts T_cold. The held warm GPUs idle until the cold ones are up.
``delay_schedulable=False`` makes DelaySchedulable see only idle and starting GPUs (GPUs being
released by running jobs are ignored, so the pool grows instead of waiting; in-flight GPUs still
count so a job is never grown for twice);
``latency_budget=False`` runs the Prompt Bank for every job whose spec says ``auto``.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Literal

import numpy as np

from .coserving import SAFETY as COSERVE_SAFETY
from .estimator import Estimator
from .latency_budget import DEFAULT_BUDGET_FRACTION, bank_verdict
from .policy import Billing, PoolLimits, PoolLimitsTable, RoundCache
from .state import Allocation, ClusterState, GPUState, Job, Launch, RoundDecision

DEFAULT_IDLE_WINDOW_SECONDS = 60.0
"""Idle warm GPUs go back to the cold pool after one minute (paper §4.4.2, Fig. 8c)."""


@dataclass(slots=True)
class PromptTunerConfig:
    warm_allocator: bool = True
    delay_schedulable: bool = True
    latency_budget: bool = True
    budget_fraction: float = DEFAULT_BUDGET_FRACTION
    idle_window_seconds: float = DEFAULT_IDLE_WINDOW_SECONDS
    """Default idle window of pools whose ``PoolLimits`` set none (WarmPools set their own)."""
    release_prediction: Literal["upper_bound", "learned"] = "learned"
    """How E_l predicts when running jobs release their GPUs (see ``_expected_release``)."""
    # -- idle and starting spend (all off by default: the paper's scheduler) ---------------------------
    idle_window_mode: Literal["fixed", "cold_start"] = "fixed"
    """Default idle window of pools whose ``PoolLimits`` set none. ``fixed``: ``idle_window_seconds``
    (paper: one minute). ``cold_start``: ``idle_window_cold_multiple`` × the LLM's learned T_cold —
    keeping an idle GPU costs its GPU-seconds, re-acquiring one costs about T_cold GPU-seconds of
    loading, so the break-even window of ski rental is T_cold, which differs per LLM (Fig. 8c's
    trade-off, tuned per pool)."""
    idle_window_cold_multiple: float = 2.0
    """Measured (medium, S = 1.0, 5 seeds; calibrated / heavy profile): 1 × T_cold releases too soon
    (+6.5 / +4.1 violation points), 2 × keeps violations (+0.1 / +0.8) at 12 % / 0 % lower cost,
    3 × trades cost back for fewer violations."""
    bank_sizing_speedup: float = 1.0
    """Size jobs that start from the Prompt Bank on max_iterations / this. 1.0: the paper's upper
    bound. 1.2: the bank's minimum observed speedup (§4.4.3, the same figure the latency budget rests
    on), so bank-using jobs get fewer GPUs and release them earlier in E_l."""
    early_release: bool = False
    """Release unreserved idle warm GPUs before their idle window when they will not be needed within
    T_cold: the GPUs the recent arrivals would ask for in the next T_cold (their rate over
    ``arrival_window_seconds`` × the warm GPUs each asked for) are covered by GPUs that running jobs
    are predicted to release, and GPUs already loading, within T_cold (see ``_needed_soon``)."""
    arrival_window_seconds: float = 180.0
    """Window of the recent arrival rate ``early_release`` uses. Three minutes: with 60 s, a quiet
    minute of a bursty trace reads as no demand at all and every idle GPU goes, and the next
    arrival waits for a cold start (medium, S = 1.0, 5 seeds, calibrated / heavy profile: +6.0 / +6.1
    violation points over the paper's scheduler with 60 s, +1.1 / +1.7 with 180 s)."""
    early_release_confidence: float = 0.9
    """``early_release`` keeps enough idle GPUs for the arrivals of the next T_cold with this
    probability (Poisson arrivals at the recent rate); 0.5 keeps about the mean."""

    def __post_init__(self) -> None:
        if self.idle_window_seconds < 0:
            raise ValueError("idle_window_seconds must be >= 0")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError("budget_fraction must be in (0, 1]")
        if self.idle_window_cold_multiple < 0:
            raise ValueError("idle_window_cold_multiple must be >= 0")
        if self.bank_sizing_speedup < 1:
            raise ValueError("bank_sizing_speedup must be >= 1 (a speedup)")
        if self.arrival_window_seconds <= 0:
            raise ValueError("arrival_window_seconds must be > 0")
        if not 0 < self.early_release_confidence < 1:
            raise ValueError("early_release_confidence must be in (0, 1)")


Slot = tuple[float, bool, float]
"""An E_l entry: (time the GPU becomes free, floating, fixed until). Floating entries are tied to the
clock — an idle GPU (free "now"), an estimate already overrun, or anything planned from those — and
move with it; a fixed entry stays put until its underlying estimate (a predicted finish, an expected
warm-up) passes, then floats. The round cache needs both facts to be exact."""


@dataclass(slots=True)
class _Round:
    """Scratch state of one round."""

    now: float
    free: dict[str, list[int]]  # idle warm GPUs not handed out yet, oldest idle first
    serving: dict[str, list[tuple[float, int]]]  # idle GPUs serving inference: (-rate, id), fastest first
    E: dict[str, list[Slot]]  # sorted earliest-free times of each LLM's warm GPUs (absolute)
    E_busy_free: dict[str, list[Slot]]  # same without busy GPUs (delay_schedulable ablation)
    unreserved_idle: dict[str, int]  # idle GPUs that no delayed job counts on
    total_unreserved: int  # sum of unreserved_idle
    growth: dict[str, int]
    cold_free: int
    horizon: float = math.inf
    decision: RoundDecision = field(default_factory=RoundDecision)

    def note(self, t: float) -> None:
        """Record an instant at which a time comparison made this round could flip."""
        if self.now < t < self.horizon:
            self.horizon = t


@dataclass(slots=True)
class _Queue:
    version: tuple[int, int]  # (state identity, pending_version)
    jobs: list[Job]
    deadline: np.ndarray
    rem: np.ndarray
    bank: np.ndarray


class PromptTunerPolicy:
    name = "promptTuner"
    keep_warm = True
    billing: Billing = "warm_pool"

    def __init__(self, estimator: Estimator, config: PromptTunerConfig | None = None) -> None:
        self.estimator = estimator
        self.config = config or PromptTunerConfig()
        self.pools = PoolLimitsTable(self.config.idle_window_seconds)
        """Per-LLM WarmPool bounds (minWarmGPUs, maxWarmGPUs, idle window)."""
        self._cache = RoundCache()
        self._queues: dict[str, _Queue] = {}

    @property
    def round_cache(self) -> RoundCache:
        """Hits and misses of the exact round cache (the scale benchmark reports them)."""
        return self._cache

    def set_pool_limits(self, llm: str, limits: PoolLimits) -> None:
        self.pools.set(llm, limits)
        self._cache = RoundCache()  # limits are round inputs outside the state's version

    def bank_budget_seconds(self, slo_seconds: float) -> float:
        return self.config.budget_fraction * slo_seconds

    # -- arrival ----------------------------------------------------------------------------------
    def admit(self, state: ClusterState, job: Job, now: float) -> None:
        mode = job.bank_mode
        if mode == "auto" and not self.config.latency_budget:
            mode = "always"
        lookup = self.estimator.profile(job.llm).bank_lookup_seconds
        job.bank_budget_seconds = self.bank_budget_seconds(job.slo)
        choice = bank_verdict(mode, lookup, job.bank_budget_seconds)
        job.use_bank = choice.use
        job.bank_seconds = lookup if choice.use else 0.0
        if job.use_bank and not job.done_iterations:
            job.planned_iterations = job.max_iterations / self.config.bank_sizing_speedup
        state.submit(job)

    # -- round ------------------------------------------------------------------------------------
    def round(self, state: ClusterState, now: float) -> RoundDecision:
        if self._cache.fresh(state, now):
            return RoundDecision()
        r = self._begin(state, now)
        # Per LLM, the jobs Algorithm 1 left to Algorithm 2 (delayed) and to best effort (hopeless),
        # each run in deadline order; consumed merged by deadline, lazily: the loops below usually stop
        # after a few dozen jobs of a thousand (nothing left to grow with or reserve).
        hopeless: list[Iterable[Job]] = []
        delayed: list[Iterable[Job]] = []
        needed: set[str] = set()
        for llm in state.pending:
            self._warm_allocation(state, r, llm, hopeless, delayed, needed)
        if r.cold_free > 0 or any(r.free.values()):
            # Otherwise (exact shortcut) nothing is left to grow with, reserve or hand out, so
            # Algorithm 2 and best effort could not change this round's decision.
            self._build_free_times(state, r, needed)
            missed: list[Job] = []
            for job in _by_deadline(delayed):
                if r.cold_free <= 0 and r.total_unreserved <= 0:
                    break  # absorbing within a round: nothing left to grow with or to reserve
                if self._cold_allocation(state, r, job) is _PROJECTED_MISS:
                    missed.append(job)
            hopeless.append(missed)  # in deadline order too, after the runs of equal deadlines
            for job in _by_deadline(hopeless):
                if r.cold_free <= 0 and r.total_unreserved <= 0:
                    break
                self._best_effort(state, r, job)
        for llm in state.pending:
            self._min_warm_and_release(state, r, llm)
        self._check(state, r)
        if r.decision.empty():
            self._cache.store(state, r.horizon)
        return r.decision

    def _begin(self, state: ClusterState, now: float) -> _Round:
        rates = state.coserve_rate
        serving: dict[str, list[tuple[float, int]]] = {llm: [] for llm in state.idle}
        if rates:
            free = {llm: [g for g in ids if g not in rates] for llm, ids in state.idle.items()}
            for llm, ids in state.idle.items():
                # A pod with no spare budget (rate 0) is neither free nor co-servable.
                serving[llm] = sorted((-rates[g], g) for g in ids if rates.get(g, 0.0) > 0)
        else:
            free = {llm: list(ids) for llm, ids in state.idle.items()}
        return _Round(
            now=now,
            free=free,
            serving=serving,
            E={},
            E_busy_free={},
            unreserved_idle=dict.fromkeys(state.idle, 0),  # set after Algorithm 1
            total_unreserved=0,
            growth=dict.fromkeys(state.pending, 0),
            cold_free=state.cold_free,
        )

    # -- Algorithm 1 --------------------------------------------------------------------------------
    def _warm_allocation(
        self,
        state: ClusterState,
        r: _Round,
        llm: str,
        hopeless: list[Iterable[Job]],
        delayed: list[Iterable[Job]],
        needed: set[str],
    ) -> None:
        """Algorithm 1 for one LLM. Appends (in deadline order) the jobs it leaves waiting to
        ``delayed`` and those projected to miss their SLO to ``hopeless`` as one run each, and the LLM
        to ``needed`` if it left any."""
        est = self.estimator
        free = r.free[llm]
        serving = r.serving[llm]
        if not free and not serving and r.cold_free <= 0 and not any(r.free.values()):
            # Exact shortcut: with no idle warm GPU anywhere and an empty cold pool, neither
            # algorithm nor best effort can hand this LLM's jobs anything this round; any change
            # (a GPU freed, a job finished) bumps the state version and triggers a full round.
            return
        q = self._queue(state, llm)
        if not q.jobs:
            return
        tbl, _, overhead = est.curve(llm)
        # T_warm(a) = (bank + overhead) + rem × table[a-1], exactly as the estimator computes it. The
        # table is non-increasing (Estimator keeps it so) and rem ≥ 0, so T_warm(a) is too, float
        # rounding included: a job fits on some a iff it fits on the most GPUs.
        base = q.bank + overhead
        left = q.deadline - r.now
        fastest = base + q.rem * tbl[-1]
        feasible = fastest <= left
        if feasible.any():
            # A feasible job turns hopeless once even the most GPUs could not finish it in time.
            r.note(float((q.deadline - fastest)[feasible].min()))
        # Vectorised est.fewest_gpus over the SLO-sorted queue, needed only if Algorithm 1 has GPUs to
        # hand out: the smallest a that fits, for every job and every a at once (a few thousand
        # numbers: cheaper than bisecting).
        fewest = _NO_INDEX
        if free or serving:
            fits = base[:, None] + q.rem[:, None] * np.asarray(tbl) <= left[:, None]
            fewest = fits.argmax(axis=1) + 1
        i = 0
        n = len(q.jobs)
        waits: list[Job] = []
        misses: list[Job] = []
        while i < n and (free or serving):  # Algorithm 1 proper: sequential, it consumes the idle GPUs
            job = q.jobs[i]
            if not feasible[i]:
                misses.append(job)
            else:
                a = int(fewest[i])
                if a <= len(free):
                    self._give(r, job, free, a, a)
                elif (
                    serving
                    and job.coservable
                    and self._coserve(r, job, a, float(base[i]), float(q.rem[i]), float(left[i]), tbl)
                ):
                    pass
                elif self.config.warm_allocator:
                    waits.append(job)
                else:
                    self._piecemeal(state, r, job, free)
            i += 1
        # No idle GPU left: the rest are classified in bulk, and listed only as far as they are read.
        rest_waits = np.flatnonzero(feasible[i:]) + i if i < n else _NO_INDEX
        rest_misses = np.flatnonzero(~feasible[i:]) + i if i < n else _NO_INDEX
        if waits or len(rest_waits):
            delayed.append(chain(waits, map(q.jobs.__getitem__, rest_waits)))
            needed.add(llm)
        if misses or len(rest_misses):
            hopeless.append(chain(misses, map(q.jobs.__getitem__, rest_misses)))
            needed.add(llm)

    def _queue(self, state: ClusterState, llm: str) -> _Queue:
        """The LLM's pending jobs sorted by deadline, with their numbers as arrays; rebuilt only when
        the pending set changed (most rounds touch one LLM at most)."""
        version = (id(state), state.pending_version[llm])
        q = self._queues.get(llm)
        if q is None or q.version != version:
            jobs = sorted(map(state.jobs.__getitem__, state.pending[llm]), key=_deadline)
            n = len(jobs)
            planned = np.fromiter(map(_planned, jobs), float, n)
            done = np.fromiter(map(_done, jobs), float, n)
            q = _Queue(
                version,
                jobs,
                np.fromiter(map(_deadline, jobs), float, n),
                np.maximum(planned - done, 0.0),  # Job.remaining_iterations, element by element
                np.fromiter(map(_bank_seconds, jobs), float, n),
            )
            self._queues[llm] = q
        return q

    def _piecemeal(self, state: ClusterState, r: _Round, job: Job, free: list[int]) -> None:
        """Ablation: all idle warm GPUs now, the rest of A from the cold pool, held for the job."""
        est = self.estimator
        a = est.fewest_gpus_cold(job.llm, job.remaining_iterations, job.deadline - r.now, job.bank_seconds)
        take = min(a, len(free))
        if a == 0 or a - take > self._growth_room(state, r, job.llm):
            return  # cannot be provisioned now; retried next round
        self._give(r, job, free, take, a)
        r.growth[job.llm] += a - take
        r.cold_free -= a - take
        r.decision.launches.append(Launch(job.llm, a - take, job.id))

    def _coserve(
        self, r: _Round, job: Job, a: int, base: float, rem: float, left: float, tbl: list[float]
    ) -> bool:
        """Co-serving (module docstring): the fewest k ≥ a of the LLM's idle dedicated GPUs plus its
        serving pods, fastest first, on which the job's co-served time is within ``COSERVE_SAFETY`` of
        the time left; hand them out and return True, or False when no k fits. The prediction takes
        each pod's rate as staying what it is now (the environment reports a recent peak, so a bursty
        load errs towards not co-serving). No instant needs noting for the round cache: the time left
        only shrinks, so a k that does not fit now never will."""
        free, serving = r.free[job.llm], r.serving[job.llm]
        d = len(free)
        for k in range(max(a, d + 1), min(len(tbl), d + len(serving)) + 1):
            rate = -serving[k - d - 1][0]  # the slowest member: a data-parallel step waits for it
            if base + rem * tbl[k - 1] / rate <= COSERVE_SAFETY * left:
                ids = free[:] + [g for _, g in serving[: k - d]]
                free.clear()
                del serving[: k - d]
                r.decision.allocations.append(Allocation(job.id, ids, k))
                return True
        return False

    def _give(self, r: _Round, job: Job, free: list[int], n: int, target: int) -> None:
        """Hand the n most recently idle GPUs to the job (see module docstring)."""
        ids = free[-n:]
        del free[-n:]
        r.decision.allocations.append(Allocation(job.id, ids, target))

    # -- E_l: earliest times each warm GPU becomes free ---------------------------------------------
    def _build_free_times(self, state: ClusterState, r: _Round, needed: set[str]) -> None:
        """E_l for the LLMs that have jobs left to plan this round (others stay empty)."""
        est = self.estimator
        now = r.now
        E: dict[str, list[Slot]] = {llm: [] for llm in state.pending}
        no_busy: dict[str, list[Slot]] = {llm: [] for llm in state.pending}
        for llm, free in r.free.items():
            r.unreserved_idle[llm] = len(free)  # after Algorithm 1 handed some out
            if llm in needed:
                E[llm].extend([(now, True, now)] * len(free))
                no_busy[llm].extend([(now, True, now)] * len(free))
        r.total_unreserved = sum(r.unreserved_idle.values())
        if not needed:
            r.E, r.E_busy_free = E, no_busy
            return

        def slot(t: float) -> Slot:  # an estimate already overrun floats at "now"
            return (t, False, t) if t > now else (now, True, now)

        t_cold = {llm: est.cold_start(llm) for llm in needed}
        for llm in needed:
            for gid in state.starting[llm]:
                sl = slot(state.gpus[gid].launched_at + t_cold[llm])
                E[llm].append(sl)
                no_busy[llm].append(sl)
            for jid in state.running[llm]:
                job = state.jobs[jid]
                E[llm].extend([slot(self._expected_release(job, now))] * _dedicated(state, job.gpus))
            for jid in state.waiting[llm]:
                job = state.jobs[jid]
                ready = slot(
                    max(
                        [now]
                        + [
                            state.gpus[g].launched_at + t_cold[llm]
                            for g in job.gpus
                            if state.gpus[g].state is GPUState.STARTING
                        ]
                    )
                )
                t = est.t_warm(llm, job.remaining_iterations, job.target_gpus, job.bank_seconds)
                E[llm].extend([(ready[0] + t, ready[1], ready[2])] * _dedicated(state, job.gpus))
        for alloc in r.decision.allocations:
            job = state.jobs[alloc.job]
            if job.llm not in needed:
                continue
            t = est.t_warm(job.llm, job.remaining_iterations, alloc.target, job.bank_seconds)
            E[job.llm].extend([(now + t, True, now)] * _dedicated(state, alloc.gpus))
        for llm in E:
            E[llm].sort()
            no_busy[llm].sort()
        r.E = E
        r.E_busy_free = no_busy

    def _expected_release(self, job: Job, now: float) -> float:
        """When a running job's GPUs come back (E_l). Sizing uses the upper bound (max iterations,
        §4.4), but jobs stop at their target: the paper's DelaySchedulable exists because jobs
        started from the Prompt Bank finish early. With ``release_prediction="learned"`` the tuning
        part of the bound is scaled by the share of max iterations finished jobs of this LLM used."""
        bound = job.predicted_finish or now
        if self.config.release_prediction == "upper_bound" or job.started_at is None:
            return bound
        frac = self.estimator.expected_fraction(job.llm, job.use_bank)
        return job.started_at + (bound - job.started_at) * frac

    # -- Algorithm 2 --------------------------------------------------------------------------------
    def _cold_allocation(self, state: ClusterState, r: _Round, job: Job) -> object:
        """Algorithm 2 for one job; returns _PROJECTED_MISS when neither waiting nor growing can
        meet its SLO any more (it is then served best effort, see the module docstring)."""
        est = self.estimator
        llm = job.llm
        if self._delay_schedulable(r, job):
            return None
        rem = job.remaining_iterations
        a = est.fewest_gpus_cold(llm, rem, job.deadline - r.now, job.bank_seconds)
        if a == 0:
            return _PROJECTED_MISS  # line 15 fails for every A
        if a > self._growth_room(state, r, llm) and not self._reclaim(state, r, llm, a):
            # The cold pool (or the WarmPool's max) cannot supply A GPUs: the job waits — until even
            # the most GPUs from the cold pool would be too late, when it becomes a projected miss.
            most = est.max_gpus(llm)
            r.note(job.deadline - (est.t_warm(llm, rem, most, job.bank_seconds) + est.cold_start(llm, most)))
            return None
        finish = r.now + est.cold_start(llm, a) + est.t_warm(llm, rem, a, job.bank_seconds)
        r.note(r.now + job.deadline - finish)
        self._grow(r, llm, a, finish)
        return None

    def _delay_schedulable(self, r: _Round, job: Job) -> bool:
        """Can the job meet its SLO by waiting for k warm GPUs being released? Reserve them if so.

        Smallest k with max(E_l,k, now) + T_warm(k) ≤ deadline (E_l entries are already ≥ now).
        Hot path of a round: T_warm is inlined from the estimator's curve.
        """
        est = self.estimator
        llm = job.llm
        E = r.E[llm] if self.config.delay_schedulable else r.E_busy_free[llm]
        tbl, neg, overhead = est.curve(llm)
        rem = job.remaining_iterations
        base = job.bank_seconds + overhead
        deadline = job.deadline
        now = r.now
        # Bisection guess of the fewest GPUs that fit from now, one lower to absorb rounding (the
        # loop applies the exact test).
        k_first = max(1, bisect_left(neg, -(deadline - now - base) / rem)) if rem > 0 else 1
        # No GPU that frees up after deadline − T_warm(max) can help; bound the scan by bisection.
        k_last = min(len(tbl), bisect_right(E, (deadline - (base + rem * tbl[-1]), True, math.inf)))
        for k in range(k_first, k_last + 1):
            e, floating, until = E[k - 1]
            t = base + rem * tbl[k - 1]
            if e + t <= deadline:
                # Floating start: the slack (deadline - e - t) runs out that much later than now;
                # fixed start: nothing changes until its estimate passes and it starts to float.
                if floating:
                    r.note(now + (deadline - e - t))
                _note_kth(r, E, k)
                self._reserve(r, llm, k, (e + t, floating, until))
                return True
        return False

    def _reserve(self, r: _Round, llm: str, k: int, finish: Slot) -> None:
        for E in (r.E[llm], r.E_busy_free[llm]):
            n = min(k, len(E))
            del E[:n]
            i = bisect_right(E, finish)
            E[i:i] = [finish] * n
        taken = min(k, r.unreserved_idle[llm])
        r.unreserved_idle[llm] -= taken
        r.total_unreserved -= taken

    def _reclaim(self, state: ClusterState, r: _Round, llm: str, a: int) -> bool:
        """Cold pool short of A GPUs: return other LLMs' idle GPUs that nobody counts on, oldest first.

        Interpretation: the paper releases idle warm GPUs only after the idle window, but its stated
        aim is the fewest warm GPUs that meet SLOs "based on traffic and GPU availability"; an idle
        GPU kept for another LLM's possible future job must not cost a present job its SLO.
        Releases are applied before launches, so the freed GPUs refill the cold pool in time.
        """
        cap = self.pools.max_warm(llm)
        if cap is not None and cap - state.pool_size[llm] - r.growth[llm] < a:
            return False
        short = a - r.cold_free
        spare = []
        for other, free in r.free.items():
            if other == llm:
                continue
            # Only idle GPUs nobody counts on, and never below the other pool's WarmPool minimum.
            keep = self.pools.min_warm(other)
            n = min(r.unreserved_idle[other], state.pool_size[other] + r.growth[other] - keep)
            spare += [(state.gpus[g].idle_since, g, other) for g in free[: max(n, 0)]]
        if len(spare) < short:
            return False
        spare.sort()
        for _, gid, other in spare[:short]:
            r.free[other].remove(gid)
            r.unreserved_idle[other] -= 1
            r.total_unreserved -= 1
            r.growth[other] -= 1
            r.cold_free += 1
            r.decision.releases.append(gid)
        return True

    def _growth_room(self, state: ClusterState, r: _Round, llm: str) -> int:
        cap = self.pools.max_warm(llm)
        room = r.cold_free
        if cap is not None:
            room = min(room, cap - state.pool_size[llm] - r.growth[llm])
        return max(room, 0)

    def _grow(self, r: _Round, llm: str, a: int, finish: float) -> None:
        """Alg. 2 lines 17-19: B_l += A and push the new GPUs' free time A times into E_l."""
        r.growth[llm] += a
        r.cold_free -= a
        r.decision.launches.append(Launch(llm, a))
        slot = (finish, True, r.now)  # planned from now: moves with the clock
        for E in (r.E[llm], r.E_busy_free[llm]):
            i = bisect_right(E, slot)
            E[i:i] = [slot] * a

    # -- jobs projected to miss their SLO ---------------------------------------------------------
    def _best_effort(self, state: ClusterState, r: _Round, job: Job) -> None:
        """Serve a job that can no longer meet its SLO as early as possible without hurting others.

        It gets the GPU count that would have met its SLO had it started now (A*), runs on idle warm
        GPUs no one reserved if there are any, else waits for warm GPUs if they free up before a cold
        start would finish, else grows the pool by A*.
        """
        est = self.estimator
        llm = job.llm
        rem = job.remaining_iterations
        a_star = est.fewest_gpus(llm, rem, job.slo, job.bank_seconds) or est.max_gpus(llm)
        available = min(r.unreserved_idle[llm], len(r.free[llm]))
        if available:
            take = min(a_star, available)
            self._give(r, job, r.free[llm], take, take)
            finish = r.now + est.t_warm(llm, rem, take, job.bank_seconds)
            self._reserve(r, llm, take, (finish, True, r.now))
            return
        E = r.E[llm]
        t_cold = est.cold_start(llm, a_star)
        k = min(a_star, len(E))
        if k and E[k - 1][0] <= r.now + t_cold:
            e, floating, until = E[k - 1]
            _note_kth(r, E, k)
            self._reserve(r, llm, k, (e + est.t_warm(llm, rem, k, job.bank_seconds), floating, until))
            return
        if k and not E[k - 1][1]:
            r.note(E[k - 1][0] - t_cold)
        if k:
            _note_kth(r, E, k)
        room = self._growth_room(state, r, llm)
        if room:
            a = min(a_star, room)
            self._grow(r, llm, a, r.now + est.cold_start(llm, a) + est.t_warm(llm, rem, a, job.bank_seconds))

    # -- pool size: WarmPool minimum and the idle window ----------------------------------------------
    def _min_warm_and_release(self, state: ClusterState, r: _Round, llm: str) -> None:
        size = state.pool_size[llm] + r.growth[llm]
        minimum = self.pools.min_warm(llm)
        if size < minimum:
            n = min(minimum - size, self._growth_room(state, r, llm))
            if n:
                r.growth[llm] += n
                r.cold_free -= n
                r.decision.launches.append(Launch(llm, n))
            return
        window = self._idle_window(llm)
        free = r.free[llm]  # oldest idle first
        unreserved = min(r.unreserved_idle[llm], len(free))
        releasable = min(unreserved, size - minimum)
        surplus = 0  # idle GPUs not needed within T_cold (early release)
        if self.config.early_release and releasable > 0:
            surplus = unreserved - self._needed_soon(state, r, llm)
        for gid in free:
            expires = state.gpus[gid].idle_since + window
            if releasable > 0 and (expires <= r.now or surplus > 0):
                r.decision.releases.append(gid)
                releasable -= 1
                surplus -= 1
            else:
                r.note(expires)

    def _idle_window(self, llm: str) -> float:
        """The pool's own window if its WarmPool sets one, else the configured default."""
        if self.config.idle_window_mode == "fixed" or self.pools.get(llm).idle_window_seconds is not None:
            return self.pools.idle_window(llm)
        return self.config.idle_window_cold_multiple * self.estimator.cold_start(llm)

    def _needed_soon(self, state: ClusterState, r: _Round, llm: str) -> int:
        """Idle warm GPUs of ``llm`` to keep: the GPUs likely to be asked for within T_cold that GPUs
        freeing up by then will not cover (early release keeps these, releases the rest).

        Asked for: the jobs that arrived within the last ``arrival_window_seconds`` give a rate; the
        number arriving in the next T_cold is taken as Poisson at that rate, at its
        ``early_release_confidence`` quantile, each asking for the mean of the warm GPUs those
        recent jobs would get from scratch (fewest A with T_warm(A) ≤ SLO). Covered: GPUs of running
        jobs whose predicted release (E_l's, see ``_expected_release``) falls within T_cold, and
        GPUs loading for the pool. The answer changes with the clock only when an arrival leaves
        the window or a predicted release enters the T_cold horizon; both instants are noted for
        the round cache.
        """
        est = self.estimator
        now = r.now
        t_cold = est.cold_start(llm)
        window = self.config.arrival_window_seconds
        arrivals = state.arrivals[llm]
        jobs = 0
        gpus = 0
        for arrival, jid in arrivals[bisect_right(arrivals, (now - window, "\U0010ffff")) :]:
            job = state.jobs[jid]
            gpus += est.fewest_gpus(llm, job.planned_iterations, job.slo, job.bank_seconds) or est.max_gpus(
                llm
            )
            jobs += 1
            r.note(arrival + window)
        demand = 0.0
        if jobs:
            expected = jobs * t_cold / window
            demand = _poisson_quantile(expected, self.config.early_release_confidence) * gpus / jobs
        covered = len(state.starting[llm])
        for jid in state.running[llm]:
            job = state.jobs[jid]
            release = self._expected_release(job, now)
            if release <= now + t_cold:
                covered += len(job.gpus)
            else:
                r.note(release - t_cold)
        return max(0, math.ceil(demand - covered - 1e-9))

    def _check(self, state: ClusterState, r: _Round) -> None:
        """Invariants every round must hold (cheap; keeps refactors honest)."""
        d = r.decision
        handed = [g for a in d.allocations for g in a.gpus]
        assert len(handed) == len(set(handed)), "a GPU was handed out twice"
        assert all(state.gpus[g].state is GPUState.IDLE for g in handed), "allocated a non-idle GPU"
        assert not set(handed) & set(d.releases), "released a GPU that was just allocated"
        assert len(set(d.releases)) == len(d.releases), "a GPU was released twice"
        launched = sum(launch.count for launch in d.launches)
        # cold_free is negative while nodes that left had GPUs out (ClusterState.set_capacity).
        assert launched <= max(0, state.cold_free + len(d.releases)), "cold pool over-drawn"


_PROJECTED_MISS = object()


def _dedicated(state: ClusterState, gpus: list[int]) -> int:
    """How many of ``gpus`` come back as dedicated capacity (E_l): a pod serving inference is offered
    only through co-serving, so DelaySchedulable must not wait for it."""
    rates = state.coserve_rate
    return sum(g not in rates for g in gpus) if rates else len(gpus)


def _note_kth(r: _Round, E: list[Slot], k: int) -> None:
    """Note every instant at which E's k-th earliest entry could change how it moves with the clock:
    a fixed entry among the first k starts to float (its estimate passes); a floating entry below a
    fixed k-th one reaches it; a floating k-th entry reaches the next fixed entry above it. Until
    then the k-th entry keeps its value (fixed) or keeps moving with the clock (floating)."""
    now = r.now
    e_k, floating_k, _ = E[k - 1]
    for e, floating, until in E[:k]:
        if not floating:
            r.note(until)
        elif not floating_k:
            r.note(now + (e_k - e))
    if floating_k:
        for e, floating, _ in E[k:]:
            if not floating:
                r.note(now + (e - e_k))
                break


def _poisson_quantile(mean: float, q: float) -> int:
    """Smallest n with P(N ≤ n) ≥ q for N ~ Poisson(mean)."""
    pmf = math.exp(-mean)
    cdf, n = pmf, 0
    while cdf < q and n < 10_000:
        n += 1
        pmf *= mean / n
        cdf += pmf
    return n


_deadline = attrgetter("deadline")
_planned = attrgetter("planned_iterations")
_done = attrgetter("done_iterations")
_bank_seconds = attrgetter("bank_seconds")
_NO_INDEX = np.zeros(0, dtype=np.intp)


def _by_deadline(runs: list[Iterable[Job]]) -> Iterable[Job]:
    """The runs (each in deadline order) merged by deadline; equal deadlines keep the runs' order, so
    this is ``sorted(chain(*runs), key=deadline)`` without reading more than is consumed."""
    if len(runs) == 1:
        return runs[0]
    return heapq.merge(*runs, key=_deadline)
