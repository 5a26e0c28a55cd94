"""Discrete-event simulator that drives the real policy objects round by round.

Physics the policies cannot see: each GPU taken from the cold pool becomes warm after its own
lognormal-jittered T_cold (instances initialise independently); a job runs its real iterations at
the LLM's real per-iteration time (the configured profile is off by ``true_iteration_factor``), after
the allocation overhead and, if chosen, the Prompt Bank lookup, which cuts its iterations by the job's
bank speedup. Observations flow back into the policy's estimator exactly as they would from workers.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from elastune_operator.scheduling.policy import ROUND_SECONDS, Policy
from elastune_operator.scheduling.state import ClusterState, GPUState, Job, RoundDecision

from .workload import SimJob, SimLLM

DEFAULT_PRICE_PER_GPU_HOUR = 40.966 / 8
"""AWS p4de.24xlarge on-demand (8 × A100-80GB), per GPU-hour (paper §6.1)."""

_ARRIVAL, _GPU_READY, _FINISH = 0, 1, 2


@dataclass(slots=True)
class SimConfig:
    cold_capacity: int = 32
    """Shared cold pool: 4 servers × 8 A100 as in the paper's testbed."""
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR
    cold_start_jitter: float = 0.15
    """Sigma of the lognormal factor on each GPU's warm-up."""
    round_seconds: float = ROUND_SECONDS
    seed: int = 0
    max_seconds: float = 6 * 3600.0
    """Give up (unfinished jobs count as misses) after this much simulated time."""


@dataclass(slots=True)
class SimResult:
    policy: str
    jobs: int
    slo_violations: int
    dropped: int
    unfinished: int
    cost_usd: float
    paid_gpu_seconds: float
    busy_gpu_seconds: float
    idle_gpu_seconds: float
    """Warm GPUs with nothing assigned (the idle window's price); for a fixed cluster every GPU that
    holds no job."""
    starting_held_gpu_seconds: float
    """GPUs held by a job or a warm pool that are not running a job yet: loading (T_cold) or warm and
    held for a job whose other GPUs are still loading. busy + idle + starting/held = paid."""
    makespan_seconds: float
    bank_used: int
    rounds: int
    round_ms_mean: float
    round_ms_max: float
    round_ms_p99: float
    rounds_recomputed: int
    latencies: list[float] = field(default_factory=list, repr=False)
    init_wait_fractions: list[float] = field(default_factory=list, repr=False)
    """Per finished job: time spent waiting for its instances to initialise (from getting GPUs to
    starting, summed over restarts) over its end-to-end latency (the paper's Fig. 3b)."""

    @property
    def slo_violation_pct(self) -> float:
        return 100.0 * self.slo_violations / self.jobs if self.jobs else 0.0

    @property
    def utilization_pct(self) -> float:
        return 100.0 * self.busy_gpu_seconds / self.paid_gpu_seconds if self.paid_gpu_seconds else 0.0

    @property
    def allocated_pct(self) -> float:
        """GPUs held by jobs (running, loading or waiting for a gang) over paid GPUs: a training
        cluster's "utilisation" (the paper's Fig. 3a counts allocated GPUs, initialising or not)."""
        allocated = self.busy_gpu_seconds + self.starting_held_gpu_seconds
        return 100.0 * allocated / self.paid_gpu_seconds if self.paid_gpu_seconds else 0.0

    @property
    def init_wait_pct(self) -> float:
        """Mean share of a finished job's latency spent waiting for instance initialisation."""
        f = self.init_wait_fractions
        return 100.0 * sum(f) / len(f) if f else 0.0

    def breakdown(self) -> dict[str, float]:
        """Paid GPU-seconds split into busy / idle / starting-or-held."""
        return {
            "busy_gpu_s": round(self.busy_gpu_seconds, 1),
            "idle_gpu_s": round(self.idle_gpu_seconds, 1),
            "starting_held_gpu_s": round(self.starting_held_gpu_seconds, 1),
            "paid_gpu_s": round(self.paid_gpu_seconds, 1),
        }

    def summary(self) -> dict[str, float | int | str]:
        return {
            "policy": self.policy,
            "jobs": self.jobs,
            "slo_violation_pct": round(self.slo_violation_pct, 2),
            "cost_usd": round(self.cost_usd, 2),
            "utilization_pct": round(self.utilization_pct, 1),
            "idle_pct_of_paid": round(100.0 * self.idle_gpu_seconds / self.paid_gpu_seconds, 1)
            if self.paid_gpu_seconds
            else 0.0,
            "allocated_pct": round(self.allocated_pct, 1),
            "init_wait_pct": round(self.init_wait_pct, 1),
            **self.breakdown(),
            "dropped": self.dropped,
            "unfinished": self.unfinished,
            "bank_used": self.bank_used,
            "makespan_s": round(self.makespan_seconds, 1),
            "round_ms_mean": round(self.round_ms_mean, 4),
            "round_ms_max": round(self.round_ms_max, 3),
            "round_ms_p99": round(self.round_ms_p99, 3),
            "rounds": self.rounds,
            "rounds_recomputed": self.rounds_recomputed,
        }


@dataclass(slots=True)
class _Run:
    job: SimJob
    true_done: float = 0.0  # real iterations completed (kept across restarts: checkpoints)
    epoch: int = 0  # invalidates finish events of a run that was restarted
    started: float = 0.0
    gpus: int = 0
    bank_until: float = 0.0
    iter_start: float = 0.0
    assigned_at: float | None = None  # when it last got GPUs while not running
    init_wait: float = 0.0  # summed time from getting GPUs to starting


class Simulator:
    def __init__(
        self,
        llms: dict[str, SimLLM],
        jobs: list[SimJob],
        policy: Policy,
        config: SimConfig | None = None,
    ) -> None:
        self.llms = llms
        self.jobs = jobs
        self.policy = policy
        self.cfg = config or SimConfig()
        self.rng = np.random.default_rng(self.cfg.seed + 7919)
        self.state = ClusterState(self.cfg.cold_capacity, list(llms))
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._runs: dict[str, _Run] = {}
        self._busy = 0

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    # -- physics ------------------------------------------------------------------------------------
    def _true_iterations(self, run: _Run, sched: Job) -> float:
        j = run.job
        return j.iterations / j.bank_speedup if sched.use_bank else float(j.iterations)

    def _start(self, job: Job, now: float) -> None:
        run = self._runs[job.id]
        llm = self.llms[job.llm]
        a = len(job.gpus)
        run.epoch += 1
        run.started, run.gpus = now, a
        if run.assigned_at is not None:
            run.init_wait += now - run.assigned_at
            run.assigned_at = None
        bank = llm.profile.bank_lookup_seconds if (job.use_bank and not job.bank_done) else 0.0
        run.bank_until = now + llm.profile.warm_overhead_seconds + bank
        run.iter_start = run.bank_until
        remaining = max(0.0, self._true_iterations(run, job) - run.true_done)
        finish = self._run_until(job, run.iter_start, remaining * llm.true_iteration_seconds(a))
        est = self.policy.estimator
        predicted = now + est.t_warm(
            job.llm, job.remaining_iterations, a, job.bank_seconds * (not job.bank_done)
        )
        self.state.start(job.id, now, predicted)
        self._busy += a
        self._push(finish, _FINISH, (job.id, run.epoch))

    # -- hooks of environments with more physics (sim.mixed: pods that also serve inference) -------------
    def _setup(self) -> None:
        """Before the first round."""

    def _make_job(self, sj: SimJob) -> Job:
        """The scheduler's view of an arriving job."""
        return Job(sj.id, sj.llm, sj.arrival, sj.slo, sj.max_iterations, bank_mode=sj.bank_mode)

    def _before_round(self, now: float) -> None:
        """Each round, before the policy decides: report what the policy reads from the environment."""

    def _run_until(self, job: Job, start: float, seconds: float) -> float:
        """When a job that needs ``seconds`` of dedicated time on its GPUs from ``start`` finishes."""
        return start + seconds

    def _observe_finished(self, job: Job, run: _Run, t: float) -> None:
        """What the job's workers report to the estimator when it finishes: its iteration time."""
        gpus = run.gpus
        self.policy.estimator.observe_iteration(
            job.llm, gpus, self.llms[job.llm].true_iteration_seconds(gpus)
        )

    def _progress(self, job: Job, now: float) -> None:
        """Checkpointed progress of a running job that is being stopped (ElasticFlow restarts)."""
        run = self._runs[job.id]
        llm = self.llms[job.llm]
        if now >= run.bank_until:
            job.bank_done = True
        if now > run.iter_start:
            run.true_done += (now - run.iter_start) / llm.true_iteration_seconds(run.gpus)
        # The scheduler only knows iterations done, bounded by its maximum.
        job.done_iterations = min(float(job.max_iterations), run.true_done)

    def _launch(self, llm: str, count: int, job: str | None, now: float) -> None:
        mean = self.llms[llm].cold_start_mean
        for _ in range(count):
            gpu = self.state.launch(llm, now, job=job, target=count)
            warm = mean * float(self.rng.lognormal(0.0, self.cfg.cold_start_jitter))
            self._push(now + warm, _GPU_READY, gpu.id)

    def _apply(self, d: RoundDecision, now: float, touched: set[str]) -> None:
        st = self.state
        for jid, n in d.restarts:
            job = st.jobs[jid]
            if job.started_at is not None:
                self._busy -= len(job.gpus)
                self._progress(job, now)
            self._runs[jid].epoch += 1
            st.preempt(jid, job.done_iterations, now, keep_warm=self.policy.keep_warm)
            self._runs[jid].assigned_at = now
            self._launch(job.llm, n, jid, now)
            touched.add(jid)
        for alloc in d.allocations:
            st.assign(alloc.job, alloc.gpus, alloc.target)
            self._assigned(alloc.job, now)
            touched.add(alloc.job)
        for gid in d.releases:  # before launches: released GPUs refill the cold pool
            gpu = st.gpus.get(gid)
            if gpu is not None and gpu.state is GPUState.IDLE:
                st.release(gid)
        for launch in d.launches:
            self._launch(launch.llm, launch.count, launch.job, now)
            if launch.job:
                self._assigned(launch.job, now)
                touched.add(launch.job)

    def _assigned(self, jid: str, now: float) -> None:
        run = self._runs[jid]
        if run.assigned_at is None:
            run.assigned_at = now

    # -- main loop ----------------------------------------------------------------------------------
    def run(self) -> SimResult:
        st, pol, cfg = self.state, self.policy, self.cfg
        for j in self.jobs:
            self._push(j.arrival, _ARRIVAL, j)
        dt = cfg.round_seconds
        remaining = len(self.jobs)
        paid = busy = idle = held = 0.0
        round_times: list[float] = []
        tick = 0
        now = 0.0
        last_arrival = max((j.arrival for j in self.jobs), default=0.0)
        self._setup()
        while remaining > 0 and now <= cfg.max_seconds:
            now = tick * dt
            touched: set[str] = set()
            while self._events and self._events[0][0] <= now:
                t, _, kind, payload = heapq.heappop(self._events)
                if kind == _ARRIVAL:
                    sj: SimJob = payload  # type: ignore[assignment]
                    job = self._make_job(sj)
                    self._runs[sj.id] = _Run(sj)
                    pol.admit(st, job, t)
                    if job.dropped:
                        remaining -= 1
                elif kind == _GPU_READY:
                    gpu = st.gpus.get(payload)  # type: ignore[arg-type]
                    if gpu is not None and gpu.state is GPUState.STARTING:
                        pol.estimator.observe_cold_start(gpu.llm, t - gpu.launched_at)
                        st.gpu_ready(gpu.id, t)
                        if gpu.job:
                            touched.add(gpu.job)
                else:
                    jid, epoch = payload  # type: ignore[misc]
                    run = self._runs[jid]
                    if epoch != run.epoch:
                        continue
                    job = st.jobs[jid]
                    self._observe_finished(job, run, t)
                    used = self._true_iterations(run, job)
                    pol.estimator.observe_completion(job.llm, job.use_bank, used, job.planned_iterations)
                    self._busy -= len(job.gpus)
                    st.finish(jid, t, keep_warm=pol.keep_warm)
                    remaining -= 1
            self._before_round(now)
            t0 = time.perf_counter()
            decision = pol.round(st, now)
            round_times.append(time.perf_counter() - t0)
            self._apply(decision, now, touched)
            for jid in touched:
                if st.startable(jid):
                    self._start(st.jobs[jid], now)
            paid += (len(st.gpus) if pol.billing == "warm_pool" else 0) * dt
            busy += self._busy * dt
            n_idle = sum(len(ids) for ids in st.idle.values())
            held += (len(st.gpus) - n_idle - self._busy) * dt
            if pol.billing == "warm_pool":
                idle += n_idle * dt
            tick += 1
        makespan = max(now, last_arrival)
        if pol.billing == "fixed_cluster":
            n = getattr(pol, "cluster_gpus")(st)  # noqa: B009 - only fixed-cluster policies have it
            paid = n * makespan
        if pol.billing == "fixed_cluster":
            idle = paid - busy - held  # every GPU of the fixed cluster that holds no job
        return self._result(paid, busy, idle, held, makespan, round_times)

    def _result(
        self, paid: float, busy: float, idle: float, held: float, makespan: float, round_times: list[float]
    ) -> SimResult:
        st = self.state
        violations = dropped = unfinished = bank = 0
        latencies = []
        init_wait = []
        for j in st.jobs.values():
            bank += j.use_bank and not j.dropped
            if j.dropped:
                dropped += 1
                violations += 1
            elif j.finished_at is None:
                unfinished += 1
                violations += 1
            else:
                latencies.append(j.finished_at - j.arrival)
                init_wait.append(self._runs[j.id].init_wait / max(latencies[-1], 1e-9))
                violations += j.finished_at > j.deadline + 1e-9
        missing = len(self.jobs) - len(st.jobs)  # never arrived before max_seconds
        rt = np.asarray(round_times) * 1000.0 if round_times else np.zeros(1)
        cache = getattr(self.policy, "_cache", None)
        return SimResult(
            policy=self.policy.name,
            jobs=len(self.jobs),
            slo_violations=violations + missing,
            dropped=dropped,
            unfinished=unfinished + missing,
            cost_usd=paid / 3600.0 * self.cfg.price_per_gpu_hour,
            paid_gpu_seconds=paid,
            busy_gpu_seconds=busy,
            idle_gpu_seconds=idle,
            starting_held_gpu_seconds=held,
            makespan_seconds=makespan,
            bank_used=int(bank),
            rounds=len(round_times),
            round_ms_mean=float(rt.mean()),
            round_ms_max=float(rt.max()),
            round_ms_p99=float(np.percentile(rt, 99)),
            rounds_recomputed=cache.misses if cache is not None else len(round_times),
            latencies=latencies,
            init_wait_fractions=init_wait,
        )


def simulate(
    llms: dict[str, SimLLM], jobs: list[SimJob], policy: Policy, config: SimConfig | None = None
) -> SimResult:
    return Simulator(llms, jobs, policy, config).run()
