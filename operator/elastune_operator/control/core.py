"""The reconcile core: TuningJobs in, scheduling rounds, worker assignments out, status back.

Independent of kopf and of where workers run: `elastune run` drives it with the Local backend, the
operator with the Knative backend. Every round (50 ms) it

1. syncs workers from the registry (a newly warm worker binds to the oldest GPU launched for its
   pool and feeds the measured T_cold to the estimator; a vanished worker fails over its job),
2. reads each running job's event stream (progress → status and estimator; result → Succeeded;
   failure → Failed with the worker's reason, or a retry from the checkpoint when a peer was lost),
3. runs the PromptTuner policy on the ``ClusterState`` and applies its decision (hand idle GPUs to
   jobs, grow pools from the cold pool, return idle GPUs after the idle window),
4. dispatches jobs whose GPUs are all warm: one ``Assignment`` per worker, ranks in GPU order.

Status is a ``TuningJobStatus`` per job, handed to ``on_status`` whenever it changes (the operator
patches the resource; local mode prints and saves it).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from elastune_operator.api import units
from elastune_operator.api.common import set_condition
from elastune_operator.api.tuningjob import PromptBankStatus, TuningJobSpec, TuningJobStatus
from elastune_operator.control.backend import ClusterBackend
from elastune_operator.control.protocol import (
    WORKER_TTL_SECONDS,
    Assignment,
    Bus,
    Event,
    WorkerRecord,
    WorkerState,
)
from elastune_operator.metrics import ControlMetrics
from elastune_operator.scheduling.estimator import Estimator, LLMProfile
from elastune_operator.scheduling.factory import make_policy
from elastune_operator.scheduling.policy import ROUND_SECONDS, PolicyName, PoolLimits
from elastune_operator.scheduling.state import ClusterState, GPUState, Job, RoundDecision

log = logging.getLogger("elastune.control")

# Condition types and reasons (CamelCase constants, Kubernetes API conventions).
ACCEPTED, SCHEDULED, RUNNING, SUCCEEDED, FAILED = "Accepted", "Scheduled", "Running", "Succeeded", "Failed"
UNKNOWN_MODEL = "UnknownModel"
WORKER_LOST = "WorkerLost"
CANCELLED = "Cancelled"
#: Failures a retry cannot fix: the job ends Failed at once. Anything else (a peer lost, a collective
#: timeout) is retried from the last checkpoint, up to ``max_attempts``.
PERMANENT_REASONS = frozenset(
    {
        "DatasetNotFound",
        "DatasetMalformed",
        "DatasetEmpty",
        "DatasetUnsupportedScheme",
        "InvalidSpec",
        "InvalidAssignment",
        "CheckpointMismatch",
        "ChannelUnreachable",
        "ModelLoadFailed",
        "WorkerError",
    }
)


@dataclass
class PoolConfig:
    """What the core needs of a WarmPool."""

    name: str
    model: str
    min_warm: int = 0
    max_warm: int = 8
    idle_window_seconds: float = 60.0
    cold_start_seconds: float = 30.0
    seconds_per_iteration: float = 0.05


@dataclass
class CoreSettings:
    cold_capacity: int
    """GPUs in the shared cold pool (local mode: worker processes the machine can hold)."""
    channel_url: str
    """Storage channel for gradient all-reduce (redis:// or memcached://)."""
    work_dir: Path
    """Checkpoints (and default artifacts) go under here; on Kubernetes a shared volume."""
    collective_timeout_s: float = 60.0
    eval_every: int = 10
    checkpoint_every: int = 10
    progress_every: int = 10
    max_attempts: int = 3
    round_seconds: float = ROUND_SECONDS
    policy: PolicyName = "promptTuner"
    """The scheduling policy: PromptTuner's, or one of the paper's baselines (infless, elasticflow)
    for side-by-side runs on real workers."""
    recovery_grace_s: float = WORKER_TTL_SECONDS + 5.0
    """After a control-plane restart, how long a job's in-flight attempt may take to show up (its busy
    workers in the registry, or its result in the event stream) before it is re-run from its checkpoint."""


@dataclass
class JobRecord:
    """The control plane's bookkeeping of one TuningJob."""

    key: str
    """namespace/name."""
    spec: TuningJobSpec
    created: float
    """Unix time of creation: the SLO runs from here."""
    dataset: str
    """The dataset as workers must read it (local mode resolves relative paths)."""
    artifact_dir: str
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    generation: int | None = None
    status: TuningJobStatus = field(default_factory=TuningJobStatus)
    attempt: int = 0
    workers: list[str] = field(default_factory=list)
    last_event: str = "0-0"
    checkpointed: int = 0
    resumed_from: list[int] = field(default_factory=list)
    """Per attempt, the iteration its workers resumed from."""
    started: float | None = None
    gpu_seconds: float = 0.0
    terminal: bool = False
    pool: str = ""

    @property
    def llm(self) -> str:
        return self.spec.model


class ControlCore:
    def __init__(
        self,
        backend: ClusterBackend,
        bus: Bus,
        settings: CoreSettings,
        pools: list[PoolConfig],
        *,
        on_status: Callable[[JobRecord], None] | None = None,
        metrics: ControlMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend, self.bus, self.settings = backend, bus, settings
        self.metrics = metrics or ControlMetrics()
        self.on_status = on_status or (lambda _job: None)
        self.clock = clock
        self.pools: dict[str, PoolConfig] = {}
        self.state = ClusterState(settings.cold_capacity, [])
        self.estimator = Estimator([])
        self.policy = make_policy(settings.policy, self.estimator)
        self.jobs: dict[str, JobRecord] = {}
        self.gpu_of: dict[str, int] = {}  # worker id -> GPU id
        self.worker_of: dict[int, str] = {}  # GPU id -> worker id
        self.unbound: dict[str, list[int]] = {}  # llm -> GPUs launched, no worker bound yet (FIFO)
        self.failed_workers: set[str] = set()
        self.gone: set[str] = set()
        self.start_failures: dict[str, int] = {}
        self.recovering: dict[str, float] = {}  # job key -> give-up time (see CoreSettings.recovery_grace_s)
        self._last_tick: float | None = None
        for pool in pools:
            self.add_pool(pool)

    # -- pools and jobs -----------------------------------------------------------------------------
    def add_pool(self, pool: PoolConfig) -> None:
        if pool.model in self.unbound and self.pools.get(pool.model, pool).name != pool.name:
            raise ValueError(f"model {pool.model!r} already has a warm pool ({self.pools[pool.model].name})")
        self.pools[pool.model] = pool
        if pool.model not in self.unbound:
            self.state.idle[pool.model] = {}
            self.state.pool_size[pool.model] = 0
            self.state.running[pool.model] = {}
            self.state.waiting[pool.model] = {}
            self.state.pending[pool.model] = {}
            self.state.starting[pool.model] = {}
            self.state.pending_version[pool.model] = 0
            self.unbound[pool.model] = []
        self.estimator.register(
            LLMProfile(
                pool.model,
                iteration_seconds=pool.seconds_per_iteration,
                cold_start_seconds=pool.cold_start_seconds,
                max_gpus_per_job=max(1, pool.max_warm),
            )
        )
        self.policy.set_pool_limits(
            pool.model, PoolLimits(pool.min_warm, pool.max_warm, pool.idle_window_seconds)
        )

    def remove_pool(self, model: str, reason_message: str) -> None:
        """The WarmPool went away: jobs that still need it fail; its GPUs are left to the backend."""
        if model not in self.pools:
            return
        now = self.clock()
        for job in list(self.jobs.values()):
            if job.llm == model and not job.terminal:
                if job.attempt:
                    self.bus.cancel(job.key, job.attempt)
                self._fail(job, "WarmPoolDeleted", reason_message, now)
        del self.pools[model]

    def submit(self, job: JobRecord) -> None:
        """Accept a TuningJob (or fail it with a reason); idempotent per key.

        A record built from a resource that already has status (the operator restarted) resumes: a
        terminal job stays as it is; a job with an attempt in flight is recovered (``_recover``)."""
        if job.key in self.jobs:
            return
        self.jobs[job.key] = job
        now = self.clock()
        done = next((c for c in job.status.conditions if c.type == SUCCEEDED and c.status != "Unknown"), None)
        if done is not None:
            job.terminal = True
            return
        pool = self.pools.get(job.llm)
        if pool is None:
            known = ", ".join(sorted(self.pools)) or "none"
            self._fail(
                job, UNKNOWN_MODEL, f"no WarmPool serves model {job.llm!r} (pools serve: {known})", now
            )
            return
        job.pool = pool.name
        if job.attempt > 0:
            self.recovering[job.key] = now + self.settings.recovery_grace_s
            return
        job.status.observed_generation = job.generation
        self._condition(job, ACCEPTED, "True", "Validated", "spec is valid; waiting for the scheduler")
        self._condition(job, SCHEDULED, "False", "Pending", "waiting for warm GPUs")
        self._condition(job, SUCCEEDED, "Unknown", "Pending", "")
        self._admit(job, now, 0.0)
        self.metrics.jobs_submitted.labels(job.llm).inc()
        self._emit(job)

    def _admit(self, job: JobRecord, now: float, done_iterations: float) -> Job:
        """Enter the job into the scheduler's state (pending)."""
        sched = Job(
            job.key,
            job.llm,
            job.created,
            units.parse_duration(job.spec.deadline),
            job.spec.termination.max_iterations,
            done_iterations=done_iterations,
            bank_mode=job.spec.prompt_bank,
        )
        self.policy.admit(self.state, sched, now)
        if job.status.prompt_bank is None:
            self._prompt_bank_decision(job, sched)
        else:
            sched.use_bank, sched.bank_seconds = False, 0.0
        return sched

    def _prompt_bank_decision(self, job: JobRecord, sched: Job) -> None:
        """The latency budget's verdict (policy.admit): skipped jobs get their status now; a job that
        runs the lookup gets it from its worker, which re-checks the budget with the bank's own
        prediction and falls back to spec.initialPrompt (saying why) when the bank cannot serve."""
        if sched.use_bank:
            return
        if job.spec.prompt_bank == "never":
            reason, msg = (
                "PromptBankDisabled",
                "spec.promptBank is never: tuning starts from spec.initialPrompt",
            )
        else:
            budget = self.policy.bank_budget_seconds(sched.slo)
            lookup = self.estimator.profile(job.llm).bank_lookup_seconds
            reason = "LatencyBudgetExceeded"
            msg = f"predicted lookup {lookup:.1f} s exceeds the budget {budget:.1f} s (20% of the deadline)"
        job.status.prompt_bank = PromptBankStatus(used=False, reason=reason, message=msg)
        self.metrics.bank_lookups.labels(job.llm, "skipped").inc()

    def _on_bank_report(self, job: JobRecord, sched: Job, report: dict[str, Any]) -> None:
        used = report.get("source") == "bank"
        latency = report.get("latencySeconds")
        score = report.get("score")
        job.status.prompt_bank = PromptBankStatus(
            used=used,
            prompt=report.get("prompt"),
            score=_dec(score) if score is not None else None,
            evaluations=report.get("evaluations"),
            latency_seconds=_dec(latency, 3) if latency is not None else None,
            reason=report.get("reason") or ("PromptBankUsed" if used else "PromptBankSkipped"),
            message=report.get("message"),
        )
        sched.bank_done = True
        predicted = report.get("predictedSeconds")
        if predicted:  # the bank's own prediction is better than the configured guess
            self.estimator.profile(job.llm).bank_lookup_seconds = float(predicted)
        result = (
            "used"
            if used
            else ("skipped" if report.get("reason") in ("Disabled", "OverBudget") else "failed")
        )
        self.metrics.bank_lookups.labels(job.llm, result).inc()
        if latency is not None:
            self.metrics.bank_latency.labels(job.llm).observe(float(latency))

    def cancel(self, key: str) -> None:
        """The job was deleted: stop its workers, free its GPUs, forget it."""
        job = self.jobs.pop(key, None)
        if job is None:
            return
        if job.attempt:
            self.bus.cancel(job.key, job.attempt)
        sched = self.state.jobs.get(key)
        if sched is not None and sched.finished_at is None:
            self._settle(job, sched, self.clock())
        if not job.terminal:
            self.metrics.jobs_finished.labels(job.llm, "cancelled").inc()

    def done(self) -> bool:
        return all(j.terminal for j in self.jobs.values())

    # -- the round ----------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        dt = 0.0 if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        touched: set[str] = set()
        records = self._sync_workers(now, touched)
        if self.recovering:
            self._recover(records, now, touched)
        self._read_events(now, touched)
        t0 = time.perf_counter()
        decision = self.policy.round(self.state, now)
        self.metrics.round_time.observe(time.perf_counter() - t0)
        self._apply(decision, now, touched)
        for key in sorted(touched):
            if key in self.state.jobs and self.state.startable(key):
                self._dispatch(self.jobs[key], now)
        self._account(dt)

    def _account(self, dt: float) -> None:
        st = self.state
        for llm in self.pools:
            counts = st.counts(llm)
            for state_name, n in counts.items():
                self.metrics.gpus.labels(llm, state_name).set(n)
            self.metrics.pending.labels(llm).set(len(st.pending[llm]))
            if dt > 0:
                self.metrics.gpu_seconds.labels(llm).inc(st.pool_size[llm] * dt)
        self.metrics.cold_free.set(st.cold_free)

    def _close_segment(self, job: JobRecord, now: float) -> None:
        """GPU-seconds of the attempt that just ended: its GPUs from dispatch until now."""
        if job.started is not None:
            job.gpu_seconds += len(job.workers) * max(0.0, now - job.started)
            job.started = None
            alive = [w for w in job.workers if w in self.gpu_of]
            if alive:
                self.backend.mark_busy(job.pool, alive, False)

    # -- workers ------------------------------------------------------------------------------------
    def _sync_workers(self, now: float, touched: set[str]) -> dict[str, WorkerRecord]:
        records = self.bus.workers()
        exited = self.backend.exited()
        for wid, gid in list(self.gpu_of.items()):
            if wid not in records or wid in exited:
                self._worker_lost(wid, gid, now, touched)
        for wid, (model, detail) in exited.items():
            if wid in self.gone or wid in self.failed_workers or model not in self.pools:
                continue
            self.gone.add(wid)
            if wid not in self.gpu_of and wid not in records:  # died before it ever became warm
                self._start_failed(model, wid, detail, now, touched)
        for wid, rec in records.items():
            if wid in self.gpu_of or wid in exited or wid in self.gone or rec.model not in self.pools:
                continue
            if rec.state is WorkerState.FAILED and wid not in self.failed_workers:
                self.failed_workers.add(wid)
                self._pool_broken(rec, now, touched)
            elif rec.state is WorkerState.BUSY and (rec.job in self.recovering or rec.job not in self.jobs):
                # Busy with an attempt this process did not dispatch (it restarted): _recover adopts it
                # with its job, or it comes back READY when that attempt ends or is cancelled.
                continue
            elif rec.state in (WorkerState.READY, WorkerState.BUSY) and (
                self.unbound[rec.model] or self.state.cold_free > 0
            ):
                # A worker nobody launched in this process (the control plane restarted) is adopted.
                unbound = self.unbound[rec.model]
                gid = unbound.pop(0) if unbound else self.state.launch(rec.model, now).id
                self.gpu_of[wid], self.worker_of[gid] = gid, wid
                if rec.ready_at is not None:
                    cold = max(0.0, rec.ready_at - rec.started_at)
                    self.estimator.observe_cold_start(rec.model, cold)
                    self.metrics.cold_start.labels(rec.model).observe(cold)
                gpu = self.state.gpus[gid]
                self.state.gpu_ready(gid, now)
                if gpu.job:
                    touched.add(gpu.job)
        return records

    def _recover(self, records: dict[str, WorkerRecord], now: float, touched: set[str]) -> None:
        """Jobs whose attempt was in flight when the control plane restarted: adopt the attempt if all
        its workers still run it, take its result if it finished meanwhile, else re-run it from the
        checkpoint once the grace period is over. Either way the job finishes exactly once."""
        for key, give_up in list(self.recovering.items()):
            job = self.jobs[key]
            stream = self.bus.events(key, "0-0")
            events = [e for _, e in stream if e.attempt == job.attempt]
            finished = any(e.type in ("succeeded", "failed") for e in events)
            job.checkpointed = max((e.checkpointed or 0 for e in events), default=job.checkpointed)
            ranks = {
                r.rank: r
                for r in records.values()
                if r.state is WorkerState.BUSY
                and r.job == key
                and r.attempt == job.attempt
                and r.rank is not None
            }
            world = next((r.world for r in ranks.values() if r.world), 0)
            complete = not finished and world > 0 and sorted(ranks) == list(range(world))
            if not (finished or complete or now >= give_up):
                continue
            del self.recovering[key]
            touched.add(key)
            self._admit(job, now, float(job.checkpointed))
            job.last_event = "0-0"  # replay this attempt's events: progress, and the result if any
            if complete and self.state.cold_free >= world:
                gids = []
                for rank in range(world):
                    wid = ranks[rank].id
                    gpu = self.state.launch(job.llm, now)
                    self.state.gpu_ready(gpu.id, now)
                    self.gpu_of[wid], self.worker_of[gpu.id] = gpu.id, wid
                    gids.append(gpu.id)
                self.state.assign(key, gids, world)
                sched = self.state.jobs[key]
                self.state.start(
                    key, now, now + self.estimator.t_warm(job.llm, sched.remaining_iterations, world)
                )
                job.workers, job.started = [ranks[r].id for r in range(world)], now
                log.info("%s: adopted attempt %d running on %s", key, job.attempt, ", ".join(job.workers))
            elif not finished:
                job.last_event = stream[-1][0] if stream else "0-0"  # nothing of the lost attempt counts
                self.bus.cancel(key, job.attempt)
                log.warning("%s: attempt %d did not survive the restart; re-running it", key, job.attempt)
                self._condition(
                    job,
                    RUNNING,
                    "False",
                    "AttemptLost",
                    f"attempt {job.attempt} did not survive the control-plane restart; resuming from the "
                    f"checkpoint at iteration {job.checkpointed}",
                )
                self._emit(job)

    def _start_failed(self, model: str, wid: str, detail: str, now: float, touched: set[str]) -> None:
        self._drop_unbound(model, now, touched)
        n = self.start_failures[model] = self.start_failures.get(model, 0) + 1
        log.error("worker %s of %s exited before becoming warm: %s", wid, model, detail)
        if n >= self.settings.max_attempts:  # no point in launching more: fail what waits for it
            pool = self.pools[model].name
            msg = f"{n} workers of pool {pool} exited before becoming warm; last: {detail}"
            for job in list(self.jobs.values()):
                if job.llm == model and not job.terminal:
                    self._fail(job, "WorkerStartFailed", msg, now)

    def _pool_broken(self, rec: WorkerRecord, now: float, touched: set[str]) -> None:
        """A worker cannot load its model: every job waiting for that model fails with the reason."""
        reason = rec.reason or "ModelLoadFailed"
        message = f"worker {rec.id} of pool {rec.pool}: {rec.message or 'cannot load the model'}"
        log.error("%s", message)
        for job in list(self.jobs.values()):
            if job.llm == rec.model and not job.terminal:
                self._fail(job, reason, message, now)
        self._drop_unbound(rec.model, now, touched)
        self.backend.shrink(self.pools[rec.model].name, [rec.id])

    def _drop_unbound(self, model: str, now: float, touched: set[str]) -> None:
        """A launched worker will never become warm: give its GPU back to the cold pool (any unbound GPU
        of the model stands for it); a job waiting on it goes back to pending."""
        if not self.unbound[model]:
            return
        gid = self.unbound[model].pop()
        gpu = self.state.gpus[gid]
        if gpu.job is not None:
            job = self.state.jobs[gpu.job]
            self.state.preempt(job.id, job.done_iterations, now, keep_warm=True)
            touched.add(job.id)
        self.state.release(gid)

    def _worker_lost(self, wid: str, gid: int, now: float, touched: set[str]) -> None:
        del self.gpu_of[wid]
        self.worker_of.pop(gid, None)
        self.gone.add(wid)
        self.bus.forget_worker(wid)
        gpu = self.state.gpus.get(gid)
        log.warning("worker %s is gone", wid)
        if gpu is None:
            return
        if gpu.job is not None and gpu.job in self.jobs:
            job = self.jobs[gpu.job]
            if job.attempt:
                self.bus.cancel(job.key, job.attempt)
            iterations = job.checkpointed
            self._close_segment(job, now)
            self.state.preempt(job.key, float(iterations), now, keep_warm=True)
            job.workers = []
            if job.attempt >= self.settings.max_attempts:
                self._fail(
                    job, WORKER_LOST, f"worker {wid} was lost on the last of {job.attempt} attempts", now
                )
            else:
                self._condition(
                    job,
                    RUNNING,
                    "False",
                    WORKER_LOST,
                    f"worker {wid} was lost at attempt {job.attempt}; resuming from the checkpoint at "
                    f"iteration {iterations} once GPUs are free",
                )
                self._condition(
                    job, SCHEDULED, "False", "Rescheduling", "waiting for GPUs after a lost worker"
                )
                job.status.allocated_gpus, job.status.pods = 0, []
                self._emit(job)
            touched.add(job.key)
        if gid in self.state.gpus:
            self.state.release(gid)

    # -- events -------------------------------------------------------------------------------------
    def _read_events(self, now: float, touched: set[str]) -> None:
        for job in list(self.jobs.values()):
            if job.terminal or not job.attempt or job.key in self.recovering:
                continue
            for entry_id, ev in self.bus.events(job.key, job.last_event):
                job.last_event = entry_id
                if ev.attempt != job.attempt:
                    continue  # a cancelled attempt's stragglers
                self._on_event(job, ev, now)
                touched.add(job.key)
                if job.terminal:
                    break

    def _on_event(self, job: JobRecord, ev: Event, now: float) -> None:
        st = job.status
        sched = self.state.jobs[job.key]
        if ev.type == "progress":
            if ev.prompt_bank is not None:
                self._on_bank_report(job, sched, ev.prompt_bank)
            if ev.resumed_from is not None:
                job.resumed_from.append(ev.resumed_from)
            if ev.initial_value is not None:
                st.initial_metric = _dec(ev.initial_value)
                st.current_metric = st.current_metric or _dec(ev.initial_value)
            if ev.iterations is not None:
                st.iterations = ev.iterations
                sched.done_iterations = float(ev.iterations)
            if ev.checkpointed is not None:
                job.checkpointed = ev.checkpointed
            if ev.value is not None:
                st.current_metric = _dec(ev.value)
            if ev.seconds_per_iteration and sched.gpus:
                self.estimator.observe_iteration(job.llm, len(sched.gpus), ev.seconds_per_iteration)
                remaining = self.estimator.t_warm(job.llm, sched.remaining_iterations, len(sched.gpus)) - (
                    self.estimator.warm_overhead(job.llm)
                )
                st.predicted_completion_time = _ts(now + max(0.0, remaining))
            self._emit(job)
        elif ev.type == "succeeded":
            st.iterations = ev.iterations
            st.current_metric = _dec(ev.value) if ev.value is not None else st.current_metric
            st.optimized_prompt = ev.prompt
            st.artifact_uri = _file_uri(ev.artifact) if ev.artifact else None
            self.estimator.observe_completion(job.llm, False, float(ev.iterations or 0), sched.max_iterations)
            why = ev.reason or "Completed"
            self._finish(job, now, SUCCEEDED, "True", why, f"{why} after {ev.iterations} iterations")
        elif ev.type == "failed":
            reason = ev.reason or "WorkerError"
            msg = f"worker {ev.worker} (rank {ev.rank}): {ev.message}"
            if reason in PERMANENT_REASONS or job.attempt >= self.settings.max_attempts:
                self.bus.cancel(job.key, job.attempt)
                self._fail(job, reason, msg, now)
            else:
                self.bus.cancel(job.key, job.attempt)
                self._close_segment(job, now)
                self.state.preempt(job.key, float(job.checkpointed), now, keep_warm=True)
                job.workers = []
                self._condition(job, RUNNING, "False", reason, f"{msg}; retrying from the checkpoint")
                self._emit(job)

    # -- decisions ----------------------------------------------------------------------------------
    def _apply(self, d: RoundDecision, now: float, touched: set[str]) -> None:
        st = self.state
        for alloc in d.allocations:
            st.assign(alloc.job, alloc.gpus, alloc.target)
            touched.add(alloc.job)
            job = self.jobs[alloc.job]
            self._condition(
                job, SCHEDULED, "True", "WarmGPUsAssigned", f"{alloc.target} warm GPU(s) of pool {job.pool}"
            )
            self._emit(job)
        releases: dict[str, list[str]] = {}
        for gid in d.releases:
            gpu = st.gpus.get(gid)
            if gpu is None or gpu.state is not GPUState.IDLE:
                continue
            wid = self.worker_of.pop(gid, None)
            if wid is not None:
                del self.gpu_of[wid]
                releases.setdefault(gpu.llm, []).append(wid)
            st.release(gid)
        for llm, wids in releases.items():
            self.backend.shrink(self.pools[llm].name, wids)
        for launch in d.launches:
            for _ in range(launch.count):
                gpu = st.launch(launch.llm, now, job=launch.job, target=launch.count)
                self.unbound[launch.llm].append(gpu.id)
            self.backend.grow(self.pools[launch.llm].name, launch.llm, launch.count)
            # Algorithm 2 grows the pool (B_l += A), Algorithm 1 then hands out the warm GPUs: tell
            # the jobs that wait for this model why.
            waiting = (
                [self.jobs[launch.job]] if launch.job else [self.jobs[k] for k in st.pending[launch.llm]]
            )
            for job in waiting:
                self._condition(
                    job,
                    SCHEDULED,
                    "True" if launch.job else "False",
                    "PoolGrowing",
                    f"pool {job.pool} is warming up {launch.count} more GPU(s) from the cold pool",
                )
                self._emit(job)
                touched.add(job.key)

    def _dispatch(self, job: JobRecord, now: float) -> None:
        sched = self.state.jobs[job.key]
        gids = sorted(sched.gpus)
        workers = [self.worker_of[g] for g in gids]
        job.attempt += 1
        job.workers = workers
        world = len(workers)
        ckpt = Path(self.settings.work_dir) / "checkpoints" / job.key / job.uid
        pb = job.status.prompt_bank
        # The first attempt looks the prompt up (if the budget allowed it); retries reuse its pick.
        bank_mode = "never"
        if sched.use_bank and pb is None:
            bank_mode = "always" if job.spec.prompt_bank == "always" else "auto"
        chosen = pb.prompt if pb is not None and pb.used else None
        for rank, wid in enumerate(workers):
            self.bus.assign(
                wid,
                Assignment(
                    job=job.key,
                    attempt=job.attempt,
                    rank=rank,
                    world=world,
                    model=job.llm,
                    spec=job.spec.model_dump(by_alias=True, exclude_none=True),
                    dataset=job.dataset,
                    channel_url=self.settings.channel_url,
                    comm_job=f"{job.key.replace('/', '.')}.{job.uid}.a{job.attempt}",
                    collective_timeout_s=self.settings.collective_timeout_s,
                    checkpoint_dir=str(ckpt),
                    artifact_dir=job.artifact_dir,
                    eval_every=self.settings.eval_every,
                    checkpoint_every=self.settings.checkpoint_every,
                    progress_every=self.settings.progress_every,
                    prompt_bank=bank_mode,
                    bank_budget_s=self.policy.bank_budget_seconds(sched.slo),
                    initial_prompt=chosen,
                ),
            )
        predicted = now + self.estimator.t_warm(job.llm, sched.remaining_iterations, world)
        self.state.start(job.key, now, predicted)
        job.started = now
        self.backend.mark_busy(job.pool, workers, True)
        st = job.status
        st.attempts = job.attempt
        st.allocated_gpus, st.pods = world, workers
        st.start_time = st.start_time or _ts(now)
        st.predicted_completion_time = _ts(predicted)
        self._condition(job, SCHEDULED, "True", "WarmGPUsAssigned", f"{world} warm GPU(s) of pool {job.pool}")
        resumed = f", resuming at iteration {job.checkpointed}" if job.attempt > 1 else ""
        self._condition(
            job, RUNNING, "True", "Tuning", f"attempt {job.attempt} on {', '.join(workers)}{resumed}"
        )
        self._emit(job)

    # -- endings ------------------------------------------------------------------------------------
    def _settle(self, job: JobRecord, sched: Job, now: float) -> None:
        """Take the job out of the scheduler's state; its warm GPUs go back to idle (GPUs still warming
        up for it stay in the pool, unheld)."""
        self._close_segment(job, now)
        if sched.started_at is not None:
            self.state.finish(job.key, now, keep_warm=True)
        elif sched.gpus:
            self.state.preempt(job.key, sched.done_iterations, now, keep_warm=True)
            self.state.drop(job.key)
        elif job.key in self.state.pending[job.llm]:
            self.state.drop(job.key)
        job.workers = []

    def _finish(self, job: JobRecord, now: float, ctype: str, status: str, reason: str, message: str) -> None:
        sched = self.state.jobs.get(job.key)
        if sched is not None:
            self._settle(job, sched, now)
        job.terminal = True
        st = job.status
        st.allocated_gpus, st.pods = 0, []
        st.completion_time = _ts(now)
        st.gpu_seconds = _dec(job.gpu_seconds, 1)
        deadline = job.created + units.parse_duration(job.spec.deadline)
        st.slo_met = now <= deadline
        st.predicted_completion_time = None
        self._condition(job, RUNNING, "False", reason, "")
        self._condition(job, SUCCEEDED, status, reason, message)
        if status == "False":
            self._condition(job, FAILED, "True", reason, message)
        outcome = "succeeded" if status == "True" else "failed"
        self.metrics.jobs_finished.labels(job.llm, outcome).inc()
        self.metrics.slo.labels(job.llm, "met" if st.slo_met else "missed").inc()
        self.metrics.job_latency.labels(job.llm).observe(now - job.created)
        self._emit(job)

    def _fail(self, job: JobRecord, reason: str, message: str, now: float) -> None:
        if job.status.conditions == [] or not any(c.type == ACCEPTED for c in job.status.conditions):
            self._condition(job, ACCEPTED, "True" if reason != UNKNOWN_MODEL else "False", reason, message)
        self._finish(job, now, SUCCEEDED, "False", reason, message)

    # -- status helpers -----------------------------------------------------------------------------
    def _condition(self, job: JobRecord, ctype: str, status: str, reason: str, message: str) -> None:
        job.status.conditions = set_condition(
            job.status.conditions,
            ctype,
            status,
            reason,
            message,
            observed_generation=job.generation,  # type: ignore[arg-type]
        )

    def _emit(self, job: JobRecord) -> None:
        try:
            self.on_status(job)
        except Exception:  # a status sink must never break the round
            log.exception("status callback failed for %s", job.key)


def status_dict(job: JobRecord) -> dict[str, Any]:
    """The status as the operator writes it (camelCase, no nulls)."""
    return job.status.model_dump(by_alias=True, exclude_none=True, mode="json")


def _dec(value: float, places: int = 4) -> str:
    return units.format_decimal(round(float(value), places))


def _ts(unix: float) -> str:
    return units.format_timestamp(datetime.fromtimestamp(unix, UTC))


def _file_uri(path: str) -> str:
    return path if "://" in path else "file://" + str(Path(path).resolve())
