"""The two baselines of the paper's evaluation (§3, §6.1), behind the same policy interface.

Both get everything the paper gave them: the same estimator (learned online, like PromptTuner's),
multi-GPU execution and the Prompt Bank (run for every job — the latency budget is PromptTuner's own
mechanism, ablated separately). They run in the same simulator, on the same trace and physics.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .estimator import Estimator
from .latency_budget import BankMode, bank_verdict
from .policy import Billing, PoolLimits, PoolLimitsTable
from .state import Allocation, ClusterState, Job, Launch, RoundDecision


def _bank_always(estimator: Estimator, job: Job, budget_seconds: float) -> None:
    mode: BankMode = "never" if job.bank_mode == "never" else "always"
    job.bank_budget_seconds = budget_seconds
    choice = bank_verdict(mode, 0.0, budget_seconds)
    job.use_bank = choice.use
    job.bank_seconds = estimator.profile(job.llm).bank_lookup_seconds if choice.use else 0.0


class _BankAlwaysPools:
    """What both baselines share of the policy interface: per-pool limits and the bank budget."""

    pools: PoolLimitsTable

    def set_pool_limits(self, llm: str, limits: PoolLimits) -> None:
        self.pools.set(llm, limits)

    def bank_budget_seconds(self, slo_seconds: float) -> float:
        """No latency budget (PromptTuner's own mechanism): the baselines run the bank for every job,
        so the workers' re-check may use the whole SLO."""
        return slo_seconds


def _best_effort_gpus(estimator: Estimator, job: Job) -> int:
    """GPUs for a job that cannot meet its SLO any more: what would have met it starting now."""
    return estimator.fewest_gpus(
        job.llm, job.remaining_iterations, job.slo, job.bank_seconds
    ) or estimator.max_gpus(job.llm)


@dataclass(slots=True)
class INFlessConfig:
    keep_alive_seconds: float = 60.0
    """Idle instances are kept this long (same window PromptTuner uses, for a like-for-like cost)."""
    prewarm: bool = True
    """Traffic-based autoscaling: keep as many instances as the recent GPU demand needs."""
    rate_window_seconds: float = 60.0


class INFlessPolicy(_BankAlwaysPools):
    """INFless-like serverless inference autoscaling, extended to multi-GPU LPT jobs (paper §3.2, §6.1).

    Models: requests dispatched on arrival (FIFO, no global reordering); SLO-aware sizing with the
    shared estimator, knowing whether instances must be cold-started (A is chosen so that
    T(A) + T_cold ≤ SLO when idle instances are short); each instance is one GPU and initialises
    independently, and a multi-GPU job waits until all its instances are up (Inefficiency 2, §3.2);
    when the cluster is full, idle instances of other models are evicted to make room;
    per-LLM autoscaling from traffic (instances pre-warmed to the GPU demand of the last minute, by
    Little's law) with keep-alive of idle instances; no waiting for busy instances to be released
    (an inference system scales out instead).
    Leaves out: INFless's batching and CPU/GPU operator placement (irrelevant to LPT jobs), its LSTH
    keep-alive histogram (a fixed window stands in), and any cross-model optimisation — it has none.
    Pool limits: a WarmPool's idle window is its keep-alive (``keep_alive_seconds`` is the default);
    min/max warm GPUs are not part of INFless and are not applied.

    Fidelity, both ways (``elastune bench scheduler``, 5 seeds; README "Scheduler benchmark"):
    stronger than the paper's INFless — it shares PromptTuner's learned estimator, sizes jobs knowing
    an instance must cold-start (adding GPUs to absorb T_cold), evicts other models' idle instances
    and pre-warms by Little's law; on the calibrated workload at medium load, S = 1.0 it misses
    24.7 % of SLOs where the paper implies 27–37 %. Cheaper and colder than the paper's — its 60 s
    keep-alive is generous to its bill (§3.2: inference systems keep idle instances "for a prolonged
    time"), and at medium load, S = 1.0 its jobs spend 19.5 % / 26.7 % (calibrated / heavy) of their
    latency waiting for instances to initialise (25 % / 22 % on the Vicuna-7B trace of Fig. 3b)
    against the paper's 11 %: it meets cold instances more often than the paper's INFless. Neither
    is tuned to close a gap.
    """

    name = "infless"
    keep_warm = True
    billing: Billing = "warm_pool"

    def __init__(self, estimator: Estimator, config: INFlessConfig | None = None) -> None:
        self.estimator = estimator
        self.config = config or INFlessConfig()
        self.pools = PoolLimitsTable(self.config.keep_alive_seconds)
        self._demand: dict[str, deque[tuple[float, float]]] = {}

    def admit(self, state: ClusterState, job: Job, now: float) -> None:
        _bank_always(self.estimator, job, self.bank_budget_seconds(job.slo))
        state.submit(job)
        est = self.estimator
        a = est.fewest_gpus(job.llm, job.remaining_iterations, job.slo, job.bank_seconds) or est.max_gpus(
            job.llm
        )
        gpu_seconds = a * est.t_warm(job.llm, job.remaining_iterations, a, job.bank_seconds)
        self._demand.setdefault(job.llm, deque()).append((now, gpu_seconds))

    def round(self, state: ClusterState, now: float) -> RoundDecision:
        est = self.estimator
        d = RoundDecision()
        cold_free = state.cold_free
        free = {llm: list(ids) for llm, ids in state.idle.items()}
        queue = sorted((state.jobs[j] for p in state.pending.values() for j in p), key=lambda j: j.arrival)
        for job in queue:
            llm = job.llm
            idle = free[llm]
            rem = job.remaining_iterations
            budget = job.deadline - now
            a = est.fewest_gpus(llm, rem, budget, job.bank_seconds)
            if not a or a > len(idle):
                a = est.fewest_gpus_cold(llm, rem, budget, job.bank_seconds)
            if not a:
                a = _best_effort_gpus(est, job)
            take = min(a, len(idle))
            cold = a - take
            if cold > cold_free:
                # Make room by evicting other models' idle instances, oldest first (what a
                # serverless platform does under memory pressure). All-or-nothing: a job never holds
                # instances while it cannot get the rest, so jobs cannot deadlock each other.
                victims = [g for other, ids in free.items() if other != llm for g in ids]
                victims.sort(key=lambda g: state.gpus[g].idle_since)
                if cold - cold_free > len(victims):
                    continue  # waits for capacity (next rounds); later requests may still fit
                for g in victims[: cold - cold_free]:
                    free[state.gpus[g].llm].remove(g)
                    d.releases.append(g)
                    cold_free += 1
            if take:
                ids = idle[-take:]
                del idle[-take:]
                d.allocations.append(Allocation(job.id, ids, a))
            if cold:
                cold_free -= cold
                d.launches.append(Launch(llm, cold, job.id))
        for llm in state.pending:
            target = self._prewarm_target(llm, now)
            size = state.pool_size[llm] + sum(x.count for x in d.launches if x.llm == llm)
            if size < target and cold_free > 0:  # negative when the pool's nodes left
                n = min(target - size, cold_free)
                cold_free -= n
                d.launches.append(Launch(llm, n))
                size += n
            surplus = size - target
            for gid in free[llm]:
                expires = state.gpus[gid].idle_since + self.pools.idle_window(llm)
                if expires <= now and surplus > 0:
                    d.releases.append(gid)
                    surplus -= 1
        return d

    def _prewarm_target(self, llm: str, now: float) -> int:
        if not self.config.prewarm:
            return 0
        window = self.config.rate_window_seconds
        q = self._demand.get(llm)
        if not q:
            return 0
        while q and q[0][0] < now - window:
            q.popleft()
        return math.ceil(sum(gs for _, gs in q) / window) if q else 0


@dataclass(slots=True)
class ElasticFlowConfig:
    cluster_gpus: int | None = None
    """Size of the fixed, always-paid cluster; None = the cold pool's capacity (the paper's 32 GPUs)."""


class ElasticFlowPolicy(_BankAlwaysPools):
    """ElasticFlow-like SLO-aware elastic training scheduler (paper §3.1, §6.1; Gu et al. 2023).

    Models: a fixed-size cluster paid all the time; deadline-aware admission control with minimum
    satisfactory shares (the fewest GPUs that meet the deadline, counting the initialisation every
    allocation pays), jobs that cannot be guaranteed are dropped (counted as SLO misses); admitted jobs
    run earliest-deadline-first on at least their minimum share; GPUs left over go to the jobs being
    started, to the one with the largest marginal time reduction first (elastic scaling); when a newly
    admitted job needs room, jobs running above their minimum share are shrunk to it (a restart). No
    runtime reuse: every allocation, including a restart, pays the full initialisation T_cold.
    Leaves out: ElasticFlow's slot-by-slot future planning (admission here guarantees minimum shares
    against the current commitments, which is at least as permissive for jobs that fit now), its
    topology-aware placement, and growing running jobs (a restart costs T_cold, which near-linear
    scaling rarely repays for jobs of seconds to minutes).
    Pool limits: none apply (a fixed cluster, no warm pools to keep or release).

    Fidelity, both ways (``elastune bench scheduler``, 5 seeds; README "Scheduler benchmark"):
    admission against current commitments only is at least as permissive as ElasticFlow's planning,
    and leftover GPUs go to starting jobs. Yet it is weaker than the paper's ElasticFlow on these
    workloads: at medium load, S = 1.0 it drops 61 % (heavy) / 71 % (calibrated) of jobs at admission
    and misses 76 % / 82 % of SLOs where the paper implies ≈ 60–63 %. The cause is the workload
    meeting its lack of runtime reuse: every allocation pays T_cold while an SLO leaves
    duration × S + 0.6–1.0 T_cold, so a short job can only be guaranteed on many GPUs, and the
    guarantees fill the 32 GPUs. Its allocated-GPU utilisation on the Fig. 3a trace, 57 %
    (calibrated), matches the paper's 56 % (busy-only: 11 %); most allocated time is loading.
    """

    name = "elasticflow"
    keep_warm = False
    billing: Billing = "fixed_cluster"

    def __init__(self, estimator: Estimator, config: ElasticFlowConfig | None = None) -> None:
        self.estimator = estimator
        self.config = config or ElasticFlowConfig()
        self.pools = PoolLimitsTable(0.0)
        self._min_share: dict[str, int] = {}

    def cluster_gpus(self, state: ClusterState) -> int:
        n = self.config.cluster_gpus
        return state.capacity if n is None else min(n, state.capacity)

    def _share(self, job: Job, now: float) -> int:
        budget = job.deadline - now
        return self.estimator.fewest_gpus_cold(job.llm, job.remaining_iterations, budget, job.bank_seconds)

    def admit(self, state: ClusterState, job: Job, now: float) -> None:
        _bank_always(self.estimator, job, self.bank_budget_seconds(job.slo))
        state.submit(job)
        m = self._share(job, now)
        for jid in [j for j in self._min_share if state.jobs[j].finished_at is not None]:
            del self._min_share[jid]  # guarantees end with the job
        committed = sum(self._min_share.values())
        if m == 0 or committed + m > self.cluster_gpus(state):
            state.drop(job.id)
            return
        self._min_share[job.id] = m

    def round(self, state: ClusterState, now: float) -> RoundDecision:
        est = self.estimator
        d = RoundDecision()
        free = self.cluster_gpus(state) - len(state.gpus)
        pending = sorted((state.jobs[j] for p in state.pending.values() for j in p), key=lambda j: j.deadline)
        starting: dict[str, int] = {}
        for job in pending:
            share = max(self._min_share.get(job.id, 1), self._share(job, now))
            share = min(share, self.cluster_gpus(state))
            if share > free:
                free += self._shrink_for(state, d, share - free, now)
            if share > free:
                continue  # wait for running jobs to finish
            starting[job.id] = share
            free -= share
        # Elastic scaling: leftover GPUs to the starting job with the largest marginal time reduction.
        while free > 0 and starting:
            best, gain = None, 0.0
            for jid, a in starting.items():
                job = state.jobs[jid]
                if a >= est.max_gpus(job.llm):
                    continue
                rem = job.remaining_iterations
                g = est.t_warm(job.llm, rem, a) - est.t_warm(job.llm, rem, a + 1)
                if g > gain:
                    best, gain = jid, g
            if best is None:
                break
            starting[best] += 1
            free -= 1
        for jid, a in starting.items():
            d.launches.append(Launch(state.jobs[jid].llm, a, jid))
        return d

    def _shrink_for(self, state: ClusterState, d: RoundDecision, need: int, now: float) -> int:
        """Shrink running jobs above their minimum share (latest deadline first) to make ``need`` GPUs.

        All or nothing: restarts are committed only if together they free enough (a restart costs the
        job T_cold, so shrinking that does not let the pending job start would be pure loss). A job
        whose restart could no longer meet its deadline (minimum share 0) is never shrunk.
        """
        planned: list[tuple[str, int]] = []
        freed = 0
        restarted = {jid for jid, _ in d.restarts}
        running = sorted(
            (state.jobs[j] for r in state.running.values() for j in r),
            key=lambda j: j.deadline,
            reverse=True,
        )
        for job in running:
            if freed >= need:
                break
            if job.id not in self._min_share or job.id in restarted:
                continue
            m = self._share(job, now)
            if m == 0:
                continue
            surplus = len(job.gpus) - m
            if surplus > 0:
                planned.append((job.id, m))
                freed += surplus
        if freed < need:
            return 0
        d.restarts.extend(planned)
        return freed
