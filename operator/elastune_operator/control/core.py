"""The reconcile core: TuningJobs in, scheduling rounds, worker assignments out, status back.

Independent of kopf and of where workers run: `elastune run` drives it with the Local backend, the
operator with the Knative backend. Every round (50 ms) it

1. syncs the fleet with the registry (``fleet.py``: warm workers bind to launched GPUs; lost, failed
   and never-warm workers are reported back here, where their jobs are rescheduled or failed),
2. recovers attempts that were in flight when the control plane restarted,
3. reads each running job's event stream (progress → status and estimator; result → Succeeded;
   failure → Failed with the worker's reason, or a retry from the checkpoint when a peer was lost),
4. runs the scheduling policy on the ``ClusterState`` and applies its decision (hand idle GPUs to
   jobs, grow pools from the cold pool, return idle GPUs after each pool's idle window, restart
   jobs on another GPU count),
5. dispatches jobs whose GPUs are all warm: one ``Assignment`` per worker, ranks in GPU order.

Pools are keyed by pool id (namespace/name, ``PoolConfig.key``): two namespaces may each have a WarmPool
of one model. A job's pool is chosen once, at submission (``resolve``: its own namespace's WarmPool of
its model, else the lowest id of those admitting its namespace; the operator resolves it itself and
hands it to ``submit_to``), and the scheduler's per-LLM state, estimator profile and limits are those
of that pool: Algorithms 1 and 2 run per pool (the state's ``llm`` is the pool id; a pool serves one
LLM), exactly as they ran per model. A job not dispatched yet
is moved when a better pool appears (its own namespace's) or its pool goes while another admits it.

Status transitions live in ``lifecycle.py``; the data it keeps in ``records.py``.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable

from elastune_common.bus import Bus
from elastune_contract import storage
from elastune_contract.api.loraadapter import LoRAAdapterSpec
from elastune_contract.api.tuningjob import PromptBankMode
from elastune_contract.coserve import coservable
from elastune_contract.protocol import Assignment, Event, WorkerRecord, WorkerState, attempt_proof
from elastune_contract.vocabulary import PERMANENT_FAILURE_REASONS, Reason
from elastune_operator.control.attempt_timeouts import AttemptTimeouts, AttemptWatch, overdue
from elastune_operator.control.backend import ClusterBackend, WorkerExit
from elastune_operator.control.fleet import Fleet, exit_pool
from elastune_operator.control.lifecycle import JobLifecycle, is_terminal, succeeded
from elastune_operator.control.records import (
    CoreSettings,
    JobRecord,
    PoolConfig,
    pool_not_shared,
    resolve_pool,
)
from elastune_operator.control.serving import AdapterRecord, ServingControl
from elastune_operator.failpoints import DISPATCH_AFTER_STATUS, failpoint
from elastune_operator.metrics import ControlMetrics
from elastune_operator.scheduling.coserving import CoServeModel, UtilizationPeaks, floored_rate
from elastune_operator.scheduling.estimator import Estimator, LLMProfile
from elastune_operator.scheduling.factory import make_policy
from elastune_operator.scheduling.policy import PoolLimits
from elastune_operator.scheduling.state import ClusterState, GPUState, Job, RoundDecision

log = logging.getLogger("elastune.control")

PUBLISH_RETRY_S = 2.0
"""How often a publication the API refused for now (not a taken name) is tried again."""


class PublishRefused(Exception):
    """``on_publish`` will not publish the adapter (``reason``: e.g. PublishNameTaken): the job's
    Published condition says why; anything else ``on_publish`` raises is retried."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ControlCore:
    def __init__(
        self,
        backend: ClusterBackend,
        bus: Bus,
        settings: CoreSettings,
        pools: list[PoolConfig],
        *,
        on_status: Callable[[JobRecord], None] | None = None,
        on_adapter_status: Callable[[AdapterRecord], None] | None = None,
        on_publish: Callable[[JobRecord, AdapterRecord], None] | None = None,
        persist: Callable[[JobRecord], bool] | None = None,
        on_move: Callable[[JobRecord, PoolConfig], bool] | None = None,
        timeouts: AttemptTimeouts | None = None,
        metrics: ControlMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend, self.bus, self.settings = backend, bus, settings
        self.metrics = metrics or ControlMetrics()
        self.clock = clock
        self.pools: dict[str, PoolConfig] = {}  # pool id (namespace/name) -> config
        self.state = ClusterState(settings.cold_capacity, [])
        self.estimator = Estimator([])
        self.policy = make_policy(settings.policy, self.estimator)
        self.jobs: dict[str, JobRecord] = {}
        self.lifecycle = JobLifecycle(self.metrics, on_status or (lambda _job: None))
        self.fleet = Fleet(self.state, bus, backend, self.estimator, self.metrics, settings.missing_grace_s)
        self.recovering: dict[str, float] = {}  # job key -> give-up time (see CoreSettings.recovery_grace_s)
        self._touched: set[str] = set()  # jobs whose GPUs or state changed this round
        self._unproven: set[tuple[str, str]] = set()  # (job, worker) whose unproven events were logged
        self._last_tick: float | None = None
        self.serving = ServingControl(
            bus,
            on_adapter_status,
            clock,
            check_artifact_paths=settings.check_artifact_paths,
            lend_gpus_only=settings.lend_gpus_only,
            metrics=self.metrics,  # re-asserts of what it owns in the registry are counted
            # The addresses the backend knows its workers at (Local, Knative); a backend without them
            # (tests' fakes) vouches for none and the pool records say so (no list).
            vouched=getattr(backend, "vouched", None),
        )
        self.on_publish = on_publish
        """Tune -> serve on Kubernetes: create the LoRAAdapter resource (None: register it here). Returns
        once it exists (the job's own, created before: fine); raises PublishRefused when it will not,
        anything else to be retried. Status says published only after it returned."""
        self.persist = persist
        """Write the job's status now; True once stored. An attempt is in status before any worker is
        told to start it (None: ``on_status`` stores it synchronously, as local mode does)."""
        self.on_move = on_move
        """A job not dispatched yet is about to move to another pool (``_reresolve``, ``remove_pool``):
        False keeps it where it is (Kubernetes: its storage cannot be placed on the new pool's claims).
        None: it moves."""
        self.timeouts = timeouts or AttemptTimeouts()
        self._watch: dict[str, AttemptWatch] = {}  # job key -> its attempt in flight (attempt_timeouts)
        self._unsent: dict[str, list[tuple[str, Assignment]]] = {}  # dispatched, status not stored yet
        self._unpublished: dict[str, float] = {}  # job key -> next try of its publication
        self._serving_need: dict[str, int] = {}
        self._records: dict[str, WorkerRecord] = {}  # the workers' registry records of this round
        self._peaks = UtilizationPeaks()  # serving pods' inference utilisation, peak of the last minute
        for pool in pools:
            self.add_pool(pool)

    # -- pools and jobs -----------------------------------------------------------------------------
    def add_pool(self, pool: PoolConfig) -> None:
        """Add or update a pool. One namespace has at most one WarmPool per model (ValueError); other
        namespaces' pools of the model are other pools."""
        key = pool.key
        same = (k for k, p in self.pools.items() if (p.namespace, p.model) == (pool.namespace, pool.model))
        twin = next((k for k in same if k != key), None)
        if twin is not None:
            raise ValueError(f"namespace {pool.namespace} already has a warm pool of {pool.model!r} ({twin})")
        if key not in self.pools:
            self.state.add_llm(key)
            self.fleet.add_pool(key)
        self.pools[key] = pool
        self.estimator.register(
            LLMProfile(
                key,
                iteration_seconds=pool.seconds_per_iteration,
                cold_start_seconds=pool.cold_start_seconds,
                max_gpus_per_job=max(1, pool.max_warm),
            )
        )
        self.serving.add_pool(
            pool.name,
            pool.model,
            pool.serving,
            namespace=pool.namespace,
            allowed=pool.allowed_namespaces,
            job_storage=pool.job_storage,
        )
        self._serving_need.pop(key, None)
        self._set_limits(pool, 0)
        self._reresolve(self.clock())

    def resolve(self, namespace: str, model: str) -> PoolConfig | None:
        """The pool a job (or adapter) of ``namespace`` uses for ``model`` (``records.resolve_pool``)."""
        return resolve_pool(self.pools.values(), namespace, model)

    def _undispatched(self, job: JobRecord) -> bool:
        """Never dispatched and holding no GPU: it may still move to another pool."""
        sched = self.state.jobs.get(job.key)
        if job.terminal or job.attempt or job.key in self.recovering or sched is None or sched.gpus:
            return False
        return not any(g.job == job.key for g in self.state.gpus.values())

    def _reresolve(self, now: float) -> None:
        """Pools changed: jobs not dispatched yet go to the pool that resolves for them now."""
        for job in list(self.jobs.values()):
            if not self._undispatched(job):
                continue
            pool = self.resolve(job.namespace, job.llm)
            if (
                pool is None
                or pool.key == job.pool
                or pool.exceeded_by(job.spec) is not None  # it stays where it was admitted
                or (self.on_move is not None and not self.on_move(job, pool))
            ):
                continue
            log.info("%s: moves from pool %s to %s", job.key, job.pool or "none", pool.key)
            self.state.remove(job.key)
            job.pool = pool.key
            self._admit(job, now, 0.0)
            self._touched.add(job.key)

    def _set_limits(self, pool: PoolConfig, serving_need: int) -> None:
        """The pool runs max(tuning need, serving need): the serving need raises the scheduler's minimum
        warm GPUs (Alg. 2 grows the pool to it eagerly; the idle window never shrinks below it)."""
        minimum = min(max(pool.min_warm, serving_need), pool.max_warm)
        self.policy.set_pool_limits(pool.key, PoolLimits(minimum, pool.max_warm, pool.idle_window_seconds))

    def remove_pool(self, key: str, reason_message: str) -> None:
        """The WarmPool ``key`` (its id) went away: its jobs not dispatched yet move to another pool that
        admits them, if any; the others fail; its GPUs are left to the backend. Other pools, of the
        same model or not, are not touched."""
        if key not in self.pools:
            return
        now = self.clock()
        rest = [p for k, p in self.pools.items() if k != key]
        for job in list(self.jobs.values()):
            if job.pool != key or job.terminal:
                continue
            other = resolve_pool(rest, job.namespace, job.llm) if self._undispatched(job) else None
            if other is not None and other.exceeded_by(job.spec) is not None:
                other = None  # a pool whose job limits it exceeds is no place to go
            if other is not None and (self.on_move is None or self.on_move(job, other)):
                log.info("%s: its pool %s went; moves to %s", job.key, key, other.key)
                self.state.remove(job.key)
                job.pool = other.key
                self._admit(job, now, 0.0)
                self._touched.add(job.key)
                continue
            if job.attempt:
                self.bus.cancel(job.key, job.attempt)
            self._fail(job, Reason.WARM_POOL_DELETED, reason_message, now)
        del self.pools[key]
        self.serving.remove_pool(key)

    def submit(self, job: JobRecord) -> None:
        """Accept a TuningJob on the pool ``resolve`` picks for it (``submit_to``)."""
        if job.key not in self.jobs:
            self.submit_to(job, None if is_terminal(job) else self.resolve(job.namespace, job.llm))

    def submit_to(self, job: JobRecord, pool: PoolConfig | None) -> None:
        """Accept a TuningJob on ``pool`` (or fail it with a reason); idempotent per key. ``pool`` is
        what ``resolve`` returned for it (None: no pool admits it), resolved once by the caller, which
        may need it first (the operator places the job's storage on that pool's claims).

        A record built from a resource that already has status (the operator restarted) resumes: a
        terminal job stays as it is; a job with an attempt in flight is recovered (``_recover``)."""
        if job.key in self.jobs:
            return
        self.jobs[job.key] = job
        now = self.clock()
        if is_terminal(job):
            job.terminal = True
            # The operator may have stopped between the job's success and its LoRAAdapter's creation.
            self.publish(job)
            return
        if pool is None:
            # The operator holds such a job before it comes here (Runtime._hold: a WarmPool applied
            # later may admit it); local mode's pools are fixed for the run, so the job fails there.
            # It never runs on a pool that does not admit its namespace.
            of_model = [p.key for p in self.pools.values() if p.model == job.llm]
            if of_model:
                msg = pool_not_shared(job.llm, job.namespace, of_model)
                self._fail(job, Reason.POOL_NOT_SHARED, msg, now)
                return
            known = ", ".join(sorted({p.model for p in self.pools.values()})) or "none"
            msg = f"no WarmPool serves model {job.llm!r} (pools serve: {known})"
            self._fail(job, Reason.UNKNOWN_MODEL, msg, now)
            return
        job.pool = pool.key
        if job.attempt > 0:
            self.recovering[job.key] = now + self.settings.recovery_grace_s
            return
        over = pool.exceeded_by(job.spec)  # checked at admission: a limit lowered later stops nothing
        if over is not None:
            self._fail(job, Reason.EXCEEDS_POOL_LIMITS, over, now)
            return
        self.lifecycle.accepted(job)
        self._admit(job, now, 0.0)
        self.lifecycle.emit(job)

    def _admit(self, job: JobRecord, now: float, done_iterations: float) -> Job:
        """Enter the job into the scheduler's state (pending)."""
        sched = Job(
            job.key,
            job.pool,  # the scheduler's per-LLM state is per pool
            job.created,
            job.deadline.seconds,  # parsed once, when the record was built
            job.spec.termination.max_iterations,
            done_iterations=done_iterations,
            bank_mode=job.spec.prompt_bank,
            coservable=coservable(job.spec, job.llm) is None,
        )
        self.policy.admit(self.state, sched, now)
        if job.status.prompt_bank is None:
            self._prompt_bank_verdict(job, sched)
        else:
            sched.use_bank, sched.bank_seconds = False, 0.0
        return sched

    def _prompt_bank_verdict(self, job: JobRecord, sched: Job) -> None:
        """The latency budget's verdict (policy.admit, which set the budget on ``sched`` once): skipped
        jobs get their status now; a job that runs the lookup gets it from its worker, which re-checks
        the same budget with the bank's own prediction and falls back to spec.initialPrompt (saying
        why) when the bank cannot serve."""
        if sched.use_bank:
            return
        if job.spec.prompt_bank == "never":
            reason = Reason.PROMPT_BANK_DISABLED
            msg = "spec.promptBank is never: tuning starts from spec.initialPrompt"
        else:
            budget = sched.bank_budget_seconds
            lookup = self.estimator.profile(job.pool).bank_lookup_seconds
            reason = Reason.LATENCY_BUDGET_EXCEEDED
            msg = f"predicted lookup {lookup:.1f} s exceeds the budget {budget:.1f} s (20% of the deadline)"
        self.lifecycle.bank_skipped(job, reason, msg)

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
            self.metrics.jobs_finished.labels(job.llm, job.pool_namespace, "cancelled").inc()

    def done(self) -> bool:
        return all(j.terminal for j in self.jobs.values())

    # -- the round ----------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        dt = 0.0 if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        self._touched = touched = set[str]()
        adoptable = set(self.jobs) - set(self.recovering)
        records = self._records = self.fleet.sync(now, self.pools, adoptable, self)
        self._serve(records, now)
        self.state.set_coserve_rates(self._coserve_rates(records, now))
        if self.recovering:
            self._recover(records, now)
        self._read_events(now)
        self._check_attempt_timeouts(records, now)
        self._retry_publish(now)
        t0 = time.perf_counter()
        decision = self.policy.round(self.state, now)
        self.metrics.round_time.observe(time.perf_counter() - t0)
        self._apply(decision, now)
        self._push_unsent()
        for key in sorted(touched):
            if key in self.state.jobs and self.state.startable(key):
                self._dispatch(self.jobs[key], now)
        self._account(dt)

    def _serve(self, records: dict[str, WorkerRecord], now: float) -> None:
        """The serving half of the round: placement and adapter status, the serving need of each pool,
        and pods that serve requests kept from looking idle (the idle window counts from their last
        request, so a pool that serves never scales down under its traffic)."""
        self.serving.tick(records, self.fleet.pool_of)
        for key, pool in self.pools.items():
            need = self.serving.serving_need(key)
            if self._serving_need.get(key) != need:
                self._serving_need[key] = need
                self._set_limits(pool, need)
        for wid, rec in records.items():
            gid = self.fleet.gpu_of.get(wid)
            served = rec.serving.last_request_at if rec.serving is not None else None
            if gid is not None and served is not None:
                busy = rec.serving is not None and (rec.serving.running or rec.serving.waiting)
                self.state.served(gid, now if busy else min(served, now))

    def _coserve_rates(self, records: dict[str, WorkerRecord], now: float) -> dict[int, float]:
        """The warm GPUs whose pods serve inference now and the share of a dedicated GPU's tuning speed a
        co-served job would get there, at the pod's peak utilisation of the last minute (the policy
        offers these GPUs to co-servable jobs only, see PromptTunerPolicy)."""
        rates: dict[int, float] = {}
        allowed = {k: _co_serving_allowed(p) for k, p in self.pools.items()}
        for wid, rec in records.items():
            gid = self.fleet.gpu_of.get(wid)
            if gid is None or rec.serving is None:
                continue
            peak = self._peaks.observe(wid, rec.heartbeat, rec.serving.utilization)
            if _serves_inference(rec, now):  # rate 0: serving, and offered to no job (coServing: false)
                ok = allowed.get(self.fleet.pool_of.get(wid, ""), True)
                rates[gid] = floored_rate(_coserve_model(rec), peak) if ok else 0.0
        self._peaks.forget(set(records))
        return rates

    def publish(self, job: JobRecord) -> None:
        """Tune -> serve: a succeeded job with spec.output.publish becomes a promptTuning LoRAAdapter."""
        name = job.spec.output.publish if job.spec.output else None
        uri = job.status.artifact_uri
        if not name or not uri or job.status.published_adapter == name or not succeeded(job):
            return
        ns = job.key.split("/", 1)[0]
        fields: dict[str, object] = {"baseModel": job.llm, "artifactURL": uri, "type": "promptTuning"}
        out = job.spec.output
        if out and uri.startswith("s3://"):  # the adapter is read with the credentials the job wrote with
            if out.secret_name:
                fields["artifactSecret"] = out.secret_name
            elif out.use_ambient_credentials:
                fields["useAmbientCredentials"] = True
        spec = LoRAAdapterSpec.model_validate(fields)
        rec = AdapterRecord(ns, name, spec)
        self._unpublished.pop(job.key, None)
        if self.on_publish is not None:
            try:
                self.on_publish(job, rec)  # the LoRAAdapter exists once it returns
            except PublishRefused as exc:
                self.lifecycle.publish_refused(job, exc.reason, str(exc))
                return
            except Exception as exc:  # the API refused for now: status must not say published yet
                log.warning("%s: cannot publish LoRAAdapter %s yet (%s); retrying", job.key, rec.key, exc)
                self._unpublished[job.key] = self.clock() + PUBLISH_RETRY_S
                return
        else:
            self.serving.upsert_adapter(rec)
        job.status.published_adapter = name
        self.lifecycle.published(job, name)

    def _retry_publish(self, now: float) -> None:
        for key, when in list(self._unpublished.items()):
            job = self.jobs.get(key)
            if job is None:
                del self._unpublished[key]
            elif now >= when:
                self.publish(job)

    def _account(self, dt: float) -> None:
        st = self.state
        for key, pool in self.pools.items():
            labels = (pool.model, pool.namespace)
            counts = st.counts(key)
            for state_name, n in counts.items():
                self.metrics.gpus.labels(*labels, state_name).set(n)
            self.metrics.pending.labels(*labels).set(len(st.pending[key]))
            if dt > 0:
                self.metrics.gpu_seconds.labels(*labels).inc(st.pool_size[key] * dt)
        self.metrics.cold_free.set(st.cold_free)

    def _close_segment(self, job: JobRecord, now: float) -> None:
        """GPU-seconds of the attempt that just ended: its GPUs from dispatch until now."""
        if job.started is not None:
            job.gpu_seconds += len(job.workers) * max(0.0, now - job.started)
            job.started = None
            alive = self.fleet.alive(job.workers)
            if alive and job.pool in self.pools:
                self.backend.mark_busy(job.pool, alive, False)

    def _stop_attempt(self, job: JobRecord, resume_from: float, now: float) -> None:
        """Cancel the attempt in flight and put the job back to pending, resuming from ``resume_from``;
        its GPUs stay warm, or go back to the cold pool for policies without runtime reuse."""
        self.bus.cancel(job.key, job.attempt)
        self._close_segment(job, now)
        gids = list(self.state.jobs[job.key].gpus)
        self.state.preempt(job.key, resume_from, now, keep_warm=self.policy.keep_warm)
        self._return_to_cold(job.pool, gids)
        job.workers = []
        self._touched.add(job.key)

    def _return_to_cold(self, key: str, gids: list[int]) -> None:
        """GPUs the state released on its own (keep_warm False): their workers go too."""
        gone = [wid for gid in gids if gid not in self.state.gpus and (wid := self.fleet.unbind(gid))]
        if gone:
            self.backend.shrink(key, gone)

    # -- what the fleet reports (FleetEvents) -------------------------------------------------------
    def worker_lost(self, wid: str, gid: int, now: float, how: WorkerExit | None = None) -> None:
        self.fleet.forget(wid)
        gpu = self.state.gpus.get(gid)
        if gpu is None:
            return
        # Its GPU goes back to the cold pool below: a pod Kubernetes still keeps (crash-looping) goes too.
        if gpu.llm in self.pools:  # the state's llm: the pool id
            self.backend.shrink(gpu.llm, [wid])
        reason = how.reason if how is not None and how.reason else Reason.WORKER_LOST
        detail = how.detail if how is not None else None
        if gpu.job is not None and gpu.job in self.jobs:
            job = self.jobs[gpu.job]
            if job.attempt:
                self.bus.cancel(job.key, job.attempt)
            iterations = job.checkpointed
            self._close_segment(job, now)
            self.state.preempt(job.key, float(iterations), now, keep_warm=True)
            job.workers = []
            if job.attempt >= self.settings.max_attempts:
                msg = f"worker {wid} was lost on the last of {job.attempt} attempts"
                self._fail(job, reason, f"{msg}: {detail}" if detail else msg, now)
            else:
                self.lifecycle.worker_lost(job, wid, iterations, reason, detail)
            self._touched.add(job.key)
        if gid in self.state.gpus:
            self.state.release(gid)

    def worker_start_failed(self, wid: str, how: WorkerExit, now: float) -> None:
        pool = exit_pool(how, self.pools)
        if pool is None:
            return
        self._drop_unbound(pool, now)
        self.backend.shrink(pool, [wid])  # a pod that cannot start leaves the pool with its GPU
        n = self.fleet.count_start_failure(pool)
        log.error("worker %s of %s failed before becoming warm: %s", wid, pool, how.detail)
        if n >= self.settings.max_attempts:  # no point in launching more: fail what waits for it
            msg = f"{n} workers of pool {pool} failed before becoming warm in a row; last: {how.detail}"
            for job in list(self.jobs.values()):
                sched = self.state.jobs.get(job.key)
                running = sched is not None and sched.started_at is not None
                if job.pool == pool and not job.terminal and not running:
                    self._fail(job, how.reason or Reason.WORKER_START_FAILED, msg, now)

    def worker_broken(self, rec: WorkerRecord, now: float) -> None:
        """A worker cannot load its model: every job waiting for its pool fails with the reason."""
        pool = self.fleet.pool_of.get(rec.id)
        if pool is None:
            return
        reason = rec.reason or Reason.MODEL_LOAD_FAILED
        message = f"worker {rec.id} of pool {pool}: {rec.message or 'cannot load the model'}"
        log.error("%s", message)
        for job in list(self.jobs.values()):
            if job.pool == pool and not job.terminal:
                self._fail(job, reason, message, now)
        self._drop_unbound(pool, now)
        self.backend.shrink(pool, [rec.id])

    def gpu_warm(self, job: str) -> None:
        self._touched.add(job)

    def _drop_unbound(self, key: str, now: float) -> None:
        """A launched worker of pool ``key`` will never become warm: give its GPU back to the cold pool;
        a job waiting on it goes back to pending."""
        gid = self.fleet.take_unbound(key)
        if gid is None:
            return
        gpu = self.state.gpus[gid]
        if gpu.job is not None:
            job = self.state.jobs[gpu.job]
            self.state.preempt(job.id, job.done_iterations, now, keep_warm=True)
            self._touched.add(job.id)
        self.state.release(gid)

    # -- after a control-plane restart --------------------------------------------------------------
    def _recover(self, records: dict[str, WorkerRecord], now: float) -> None:
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
            self._touched.add(key)
            self._admit(job, now, float(job.checkpointed))
            job.last_event = "0-0"  # replay this attempt's events: progress, and the result if any
            if complete and self.state.cold_free >= world:
                workers = [ranks[r].id for r in range(world)]
                gids = self.fleet.adopt(job.pool, workers, now)
                self.state.assign(key, gids, world)
                sched = self.state.jobs[key]
                self.state.start(
                    key, now, now + self.estimator.t_warm(job.pool, sched.remaining_iterations, world)
                )
                job.workers, job.started = workers, now
                self._watch[key] = AttemptWatch(job.attempt, now, now, started=True, progressed=True)
                log.info("%s: adopted attempt %d running on %s", key, job.attempt, ", ".join(job.workers))
            elif not finished:
                job.last_event = stream[-1][0] if stream else "0-0"  # nothing of the lost attempt counts
                self.bus.cancel(key, job.attempt)
                log.warning("%s: attempt %d did not survive the restart; re-running it", key, job.attempt)
                self.lifecycle.attempt_lost(job)

    # -- events -------------------------------------------------------------------------------------
    def _read_events(self, now: float) -> None:
        for job in list(self.jobs.values()):
            if job.terminal or not job.attempt or job.key in self.recovering:
                continue
            for entry_id, ev in self.bus.events(job.key, job.last_event):
                job.last_event = entry_id
                if ev.attempt != job.attempt:
                    continue  # a cancelled attempt's stragglers
                if not self._proven(job, ev):
                    continue
                watch = self._watch.get(job.key)
                if watch is not None and watch.attempt == ev.attempt:
                    watch.on_event(now, ev.seconds_per_iteration, progress=ev.type == "progress")
                self._on_event(job, ev, now)
                self._touched.add(job.key)
                if job.terminal:
                    break

    def _proven(self, job: JobRecord, ev: Event) -> bool:
        """Whether ``ev`` carries the proof its attempt's assigned worker was given (issue 39 item 1):
        any pod holding the worker credential can write to a job's event stream, and a forged
        ``succeeded`` once ended another namespace's job with the forger's prompt and artifact."""
        want = attempt_proof(self.settings.proof_key, job.key, ev.attempt, ev.rank)
        if hmac.compare_digest(want, ev.proof):
            return True
        seen = (job.key, ev.worker)
        if seen not in self._unproven:
            self._unproven.add(seen)
            log.warning(
                "%s: ignoring a %s event from %s without its attempt's proof", job.key, ev.type, ev.worker
            )
            self.metrics.unvouched.labels("event").inc()
        return False

    def _on_event(self, job: JobRecord, ev: Event, now: float) -> None:
        sched = self.state.jobs[job.key]
        if ev.type == "started" and ev.coserved is False and ev.message and job.status.co_served:
            # The engine refused the co-served assignment; the worker tunes that rank dedicated.
            job.status.co_serving_reason = f"{ev.worker}: {ev.message}; that rank tunes dedicated"
            job.status.co_served = len(job.workers) > 1  # the other ranks may still co-serve
            self.lifecycle.emit(job)
        if ev.type == "progress":
            if ev.prompt_bank is not None:
                self.lifecycle.bank_reported(job, ev.prompt_bank)
                sched.bank_done = True
                if ev.prompt_bank.predicted_seconds:  # the bank's own prediction beats the configured guess
                    self.estimator.profile(job.pool).bank_lookup_seconds = ev.prompt_bank.predicted_seconds
            if ev.resumed_from is not None:
                job.resumed_from.append(ev.resumed_from)
            if ev.iterations is not None:
                sched.done_iterations = float(ev.iterations)
            if ev.checkpointed is not None:
                job.checkpointed = ev.checkpointed
            predicted = None
            # A co-served step shares its pod with inference: its time says nothing of a dedicated one.
            if ev.seconds_per_iteration and job.status.co_served:
                self.estimator.observe_coserved_iteration(job.pool, ev.seconds_per_iteration)
                coserved = self.estimator.coserved_iteration_seconds(job.pool)
                per_iteration = coserved or ev.seconds_per_iteration
                predicted = now + sched.remaining_iterations * per_iteration
            elif ev.seconds_per_iteration and sched.gpus:
                self.estimator.observe_iteration(job.pool, len(sched.gpus), ev.seconds_per_iteration)
                remaining = self.estimator.t_warm(job.pool, sched.remaining_iterations, len(sched.gpus))
                predicted = now + max(0.0, remaining - self.estimator.warm_overhead(job.pool))
            self.lifecycle.progress(job, ev, predicted)
        elif ev.type == "succeeded":
            done = float(ev.iterations or 0)
            self.estimator.observe_completion(job.pool, False, done, sched.max_iterations)
            self._settle(job, sched, now)
            self.lifecycle.succeeded(job, ev, now)
            self.publish(job)
        elif ev.type == "failed":
            reason = ev.reason or Reason.WORKER_ERROR
            msg = f"worker {ev.worker} (rank {ev.rank}): {ev.message}"
            if reason in PERMANENT_FAILURE_REASONS or job.attempt >= self.settings.max_attempts:
                self.bus.cancel(job.key, job.attempt)
                self._fail(job, reason, msg, now)
            else:
                self._stop_attempt(job, float(job.checkpointed), now)
                self.lifecycle.retrying(job, reason, msg)

    # -- decisions ----------------------------------------------------------------------------------
    def _apply(self, d: RoundDecision, now: float) -> None:
        st = self.state
        for jid, n in d.restarts:  # ElasticFlow-like: stop at the checkpoint, re-launch on n GPUs
            job = self.jobs[jid]
            self._stop_attempt(job, float(job.checkpointed), now)
            self._launch(job.pool, n, jid, now)
            self.lifecycle.retrying(job, Reason.RESCHEDULING, f"the scheduler resizes the job to {n} GPU(s)")
        for alloc in d.allocations:
            st.assign(alloc.job, alloc.gpus, alloc.target)
            self._touched.add(alloc.job)
            self.lifecycle.warm_gpus_assigned(self.jobs[alloc.job], alloc.target)
        releases: dict[str, list[str]] = {}
        for gid in d.releases:
            gpu = st.gpus.get(gid)
            if gpu is None or gpu.state is not GPUState.IDLE:
                continue
            wid = self.fleet.unbind(gid)
            if wid is not None:
                releases.setdefault(gpu.llm, []).append(wid)
            st.release(gid)
        for key, wids in releases.items():  # the state's llm: the pool id
            self.backend.shrink(key, wids)
        for launch in d.launches:
            self._launch(launch.llm, launch.count, launch.job, now)
            waiting = (
                [self.jobs[launch.job]] if launch.job else [self.jobs[k] for k in st.pending[launch.llm]]
            )
            for job in waiting:
                self.lifecycle.pool_growing(job, launch.count, held_for_job=launch.job is not None)
                self._touched.add(job.key)

    def _launch(self, key: str, count: int, job: str | None, now: float) -> None:
        """GPUs leave the cold pool for pool ``key`` (held for ``job`` if given); the backend starts
        workers of the pool's model."""
        for _ in range(count):
            gpu = self.state.launch(key, now, job=job, target=count)
            self.fleet.launched(key, gpu.id)
        self.backend.grow(key, self.pools[key].model, count)

    def _dispatch(self, job: JobRecord, now: float) -> None:
        sched = self.state.jobs[job.key]
        workers = self.fleet.workers(sorted(sched.gpus))
        job.attempt += 1
        job.workers = workers
        world = len(workers)
        root = job.checkpoint_root or storage.join(str(self.settings.work_dir), "checkpoints", job.key)
        ckpt = storage.join(root, job.uid)  # the workers resolve a pvc:// URI to their mount of it
        pb = job.status.prompt_bank
        # The first attempt looks the prompt up (if the budget allowed it); retries reuse its pick.
        bank_mode: PromptBankMode = "never"
        if sched.use_bank and pb is None:
            bank_mode = "always" if job.spec.prompt_bank == "always" else "auto"
        chosen = pb.prompt if pb is not None and pb.used else None
        coserve, tpot_slo_s = self._coserve_decision(job, workers, now)
        assignments: list[tuple[str, Assignment]] = []
        for rank, wid in enumerate(workers):
            assignments.append(
                (
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
                        checkpoint_dir=ckpt,
                        artifact_dir=job.artifact_dir,
                        eval_every=self.settings.eval_every,
                        checkpoint_every=self.settings.checkpoint_every,
                        progress_every=self.settings.progress_every,
                        proof=attempt_proof(self.settings.proof_key, job.key, job.attempt, rank),
                        owner_uid=job.uid,
                        prompt_bank=bank_mode,
                        bank_budget_s=sched.bank_budget_seconds,
                        initial_prompt=chosen,
                        coserve=coserve,
                        tpot_slo_s=tpot_slo_s,
                    ),
                )
            )
        predicted = now + self.estimator.t_warm(job.pool, sched.remaining_iterations, world)
        if coserve:  # at the slowest pod's co-serving rate (a data-parallel step waits for it)
            rates = [self.state.coserve_rate.get(g, 1.0) for g in sched.gpus]
            predicted = now + (predicted - now) / max(min(rates), 1e-3)
        self.state.start(job.key, now, predicted)
        placement = "coserved" if coserve else "dedicated"
        self.metrics.attempts.labels(job.llm, job.pool_namespace, placement).inc()
        job.started = now
        self.backend.mark_busy(job.pool, workers, True)
        self.lifecycle.running(job, now, predicted)
        setup_s = sched.bank_budget_seconds if bank_mode != "never" else 0.0  # the lookup reports nothing
        self._watch[job.key] = AttemptWatch(job.attempt, now, now, setup_s=setup_s)
        # Intent before effect: the attempt is in the job's stored status before any worker hears of it,
        # so a control plane that dies in between recovers this attempt instead of running it twice.
        self._unsent[job.key] = assignments
        self._push_unsent()

    def _push_unsent(self) -> None:
        """Push the assignments of dispatched attempts whose status is stored (retried every round)."""
        for key, assignments in list(self._unsent.items()):
            job = self.jobs.get(key)
            if job is None or job.terminal or not assignments or assignments[0][1].attempt != job.attempt:
                del self._unsent[key]
                continue
            if self.persist is not None and not self.persist(job):
                continue  # the attempt's start timeout bounds how long this may go on
            del self._unsent[key]
            failpoint(DISPATCH_AFTER_STATUS)
            for wid, assignment in assignments:
                self.bus.assign(wid, assignment)

    # -- bounded waits ------------------------------------------------------------------------------
    def _check_attempt_timeouts(self, records: dict[str, WorkerRecord], now: float) -> None:
        """Attempts that did not start, stalled, or whose result was lost (control.attempt_timeouts) are
        cancelled and retried from the checkpoint, or fail the job after the retry limit."""
        for key, watch in list(self._watch.items()):
            job = self.jobs.get(key)
            if (
                job is None
                or job.terminal
                or not job.workers
                or watch.attempt != job.attempt
                or key in self.recovering
            ):
                del self._watch[key]
                continue
            watch.observe_worker(key, records.get(job.workers[0]), now)  # rank 0 posts the result
            late = overdue(
                watch,
                self.timeouts,
                now,
                progress_every=self.settings.progress_every,
                guess_seconds_per_iteration=self.estimator.iteration_seconds(job.pool, len(job.workers)),
            )
            if late is None:
                continue
            reason, message = late
            del self._watch[key]
            self._unsent.pop(key, None)
            self.bus.cancel(key, job.attempt)
            log.warning("%s: %s", key, message)
            if job.attempt >= self.settings.max_attempts:
                self._fail(job, reason, f"{message}, the last of {job.attempt} attempts", now)
            else:
                self._stop_attempt(job, float(job.checkpointed), now)
                self.lifecycle.retrying(job, reason, message)
                if self.persist is not None:  # said in status (and an Event) even if retried this round
                    self.persist(job)

    def _coserve_decision(self, job: JobRecord, workers: list[str], now: float) -> tuple[bool, float | None]:
        """Co-serve the attempt (FlexLLM) when one of its pods serves inference right now: the job then
        runs in the token budget inference leaves each iteration, under the pool's TPOT SLO, instead of
        competing with inference for the whole device. Pods of the attempt without a serving engine tune
        dedicated and all-reduce with the co-served ones. Records the decision (and why not) in the
        job's status: a job that cannot be co-served while its pool serves says why."""
        job.status.co_served, job.status.co_serving_reason = False, None
        why = coservable(job.spec, job.llm)
        if why is None and not _co_serving_allowed(self.pools[job.pool]):
            why = f"WarmPool {job.pool} sets serving.coServing: false"
        if why is not None:
            mine = (r for w, r in self._records.items() if self.fleet.pool_of.get(w) == job.pool)
            if any(_serves_inference(r, now) for r in mine):
                job.status.co_serving_reason = f"tuned on dedicated GPUs: {why}"
            return False, None
        if not any(_serves_inference(self._records.get(w), now) for w in workers):
            return False, None
        job.status.co_served = True
        slo = self.serving.hold(job.pool).slo
        tpot_ms = slo.tpot_milliseconds if slo is not None else None
        return True, tpot_ms / 1000 if tpot_ms else None

    # -- endings ------------------------------------------------------------------------------------
    def _settle(self, job: JobRecord, sched: Job, now: float) -> None:
        """Take the job out of the scheduler's state; its warm GPUs go back to idle (GPUs still warming
        up for it stay in the pool, unheld), or to the cold pool for policies without runtime reuse."""
        self._close_segment(job, now)
        gids = list(sched.gpus)
        if sched.started_at is not None:
            self.state.finish(job.key, now, keep_warm=self.policy.keep_warm)
        elif sched.gpus:
            self.state.preempt(job.key, sched.done_iterations, now, keep_warm=self.policy.keep_warm)
            self.state.drop(job.key)
        elif job.key in self.state.pending[job.pool]:
            self.state.drop(job.key)
        self._return_to_cold(job.pool, gids)
        job.workers = []

    def _fail(self, job: JobRecord, reason: str, message: str, now: float) -> None:
        sched = self.state.jobs.get(job.key)
        if sched is not None:
            self._settle(job, sched, now)
        self.lifecycle.failed(job, reason, message, now)


COSERVE_RECENT_S = 60.0
"""A pod that answered a request this recently counts as serving inference (co-serve its jobs)."""


def _co_serving_allowed(pool: PoolConfig) -> bool:
    return pool.serving is None or pool.serving.co_serving


def _coserve_model(rec: WorkerRecord) -> CoServeModel:
    """FlexLLM's GPU model on CUDA pods (and pods that do not say), the measured CPU model on CPU pods."""
    cost = rec.serving.cost if rec.serving is not None else None
    return CoServeModel("cpu" if cost is not None and cost.device == "cpu" else "gpu")


def _serves_inference(rec: WorkerRecord | None, now: float) -> bool:
    if rec is None or rec.serving is None:
        return False
    s = rec.serving
    recent = s.last_request_at is not None and now - s.last_request_at < COSERVE_RECENT_S
    return bool(s.running or s.waiting or s.utilization > 0 or recent)
