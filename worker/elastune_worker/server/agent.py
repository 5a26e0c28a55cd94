"""The worker's job loop: register, heartbeat, pop assignments, run them, report (DESIGN.md §5 pull model).

One assignment at a time. Any failure of a job — bad dataset, unreachable storage channel, a peer that
died — is reported on the job's event stream with a CamelCase reason, and the worker goes back to
READY for the next job: it never exits because of a job. A model that does not load leaves the worker
FAILED (it cannot serve anything) but alive, reporting why on /readyz and in its record.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastune_contract import storage
from elastune_contract.api.tuningjob import TuningJobSpec
from elastune_contract.protocol import (
    HEARTBEAT_SECONDS,
    Assignment,
    Bus,
    Event,
    ServingState,
    WorkerRecord,
    WorkerState,
)
from elastune_contract.vocabulary import Reason
from elastune_worker.comm import (
    ChannelError,
    CollectiveAborted,
    CollectiveTimeout,
    StorageAllReduce,
    make_channel,
)
from elastune_worker.server.metrics import WorkerMetrics
from elastune_worker.server.models import LoadedModel, ModelLoadError, load_model
from elastune_worker.serving.frontend.messages import EngineOp
from elastune_worker.storage import s3
from elastune_worker.tuning.data import DatasetError, load_dataset, split
from elastune_worker.tuning.trainer import CheckpointMismatch, StepInfo, Trainer, TuningConfig

log = logging.getLogger("elastune.worker")

# Failure reasons a worker reports (besides DatasetError's DatasetNotFound / DatasetMalformed / ...).
INVALID_ASSIGNMENT = Reason.INVALID_ASSIGNMENT
INVALID_SPEC = Reason.INVALID_SPEC
CHANNEL_UNREACHABLE = Reason.CHANNEL_UNREACHABLE
COLLECTIVE_TIMEOUT = Reason.COLLECTIVE_TIMEOUT
CHECKPOINT_MISMATCH = Reason.CHECKPOINT_MISMATCH
WORKER_ERROR = Reason.WORKER_ERROR
RESULT_POST_SECONDS = 60.0
"""How long a worker keeps trying to post an attempt's result (succeeded or failed) through a Redis
blip, staying BUSY on the attempt meanwhile; then it gives up and the control plane, seeing the worker
READY without a result, retries the attempt (ResultLost). Below the control plane's stall floor."""


class Cancelled(Exception):
    pass


@dataclass
class AgentConfig:
    worker_id: str
    pool: str
    model: str
    url: str = ""
    poll_seconds: float = 1.0
    on_loaded: Callable[[LoadedModel], None] | None = None
    """Called with the loaded model before the worker reports READY (starts the serving engine)."""
    serving_state: Callable[[], ServingState | None] | None = None
    """What the worker serves right now, published with every heartbeat."""
    on_heartbeat: Callable[[], None] | None = None
    """Runs before each heartbeat's publish (applies the control plane's adapter placement)."""
    engine_call: Callable[[], Callable[[EngineOp, Any], Any] | None] | None = None
    """A call into the serving engine (run between its steps), or None while no engine serves:
    co-served assignments run through it."""


class Agent:
    def __init__(self, cfg: AgentConfig, bus: Bus, metrics: WorkerMetrics | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.metrics = metrics or WorkerMetrics()
        self.record = WorkerRecord(
            id=cfg.worker_id,
            pool=cfg.pool,
            model=cfg.model,
            state=WorkerState.STARTING,
            url=cfg.url,
            pid=os.getpid(),
            started_at=_process_start_time(),
        )
        self.loaded: LoadedModel | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # -- state shared with the HTTP server --------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.record.state in (WorkerState.READY, WorkerState.BUSY)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return self.record.model_dump(mode="json")

    def _set(self, **fields: object) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self.record, k, v)
        self._publish()

    def _publish(self) -> None:
        try:
            with self._lock:
                record = self.record.model_copy()
            if self.cfg.serving_state is not None:
                record.serving = self.cfg.serving_state()
            self.bus.publish_worker(record)
        except Exception as exc:  # Redis down: keep working, the heartbeat retries
            log.warning("cannot publish worker record: %s", exc)

    # -- lifecycle ----------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def load(self) -> bool:
        """Load the runtime and weights; the worker is warm (READY) afterwards."""
        self._publish()
        try:
            self.loaded = load_model(self.cfg.model)
        except ModelLoadError as exc:
            log.error("%s", exc)
            self._set(state=WorkerState.FAILED, reason=exc.reason, message=str(exc))
            return False
        if self.cfg.on_loaded is not None:
            self.cfg.on_loaded(self.loaded)
        self.metrics.model_load.set(self.loaded.load_seconds)
        self.metrics.ready.set(1)
        self._set(state=WorkerState.READY, ready_at=time.time())
        log.info(
            "warm: %s loaded from %s in %.1f s", self.cfg.model, self.loaded.path, self.loaded.load_seconds
        )
        return True

    def heartbeat_forever(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            if self.cfg.on_heartbeat is not None and self.ready:
                try:
                    self.cfg.on_heartbeat()
                except Exception as exc:  # Redis down or the engine gone: the heartbeat goes on
                    log.warning("heartbeat task failed: %s", exc)
            self._publish()

    def run_forever(self) -> None:
        threading.Thread(target=self.heartbeat_forever, name="heartbeat", daemon=True).start()
        if not self.load():
            self._stop.wait()  # stay up and keep reporting why (readiness stays false)
            return
        while not self._stop.is_set():
            try:
                assignment = self.bus.pop_assignment(self.cfg.worker_id, timeout=self.cfg.poll_seconds)
            except Exception as exc:
                log.warning("cannot read assignments (%s); retrying", exc)
                self._stop.wait(1.0)
                continue
            if assignment is not None:
                self.run_assignment(assignment)

    # -- one job ------------------------------------------------------------------------------------
    def _event(self, a: Assignment, type_: str, **fields: object) -> Event:
        return Event(
            type=type_, job=a.job, attempt=a.attempt, rank=a.rank, worker=self.cfg.worker_id, **fields
        )  # type: ignore[arg-type]

    def _post(self, event: Event) -> None:
        """Progress may be lost (the next event says more); a result is retried with backoff for up to
        RESULT_POST_SECONDS, so a Redis blip does not lose it."""
        final = event.type in ("succeeded", "failed")
        deadline = time.monotonic() + (RESULT_POST_SECONDS if final else 0.0)
        delay = 0.2
        while True:
            try:
                self.bus.post(event)
                return
            except Exception as exc:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    log.error("cannot post %s event of %s: %s", event.type, event.job, exc)
                    return
                log.warning("cannot post %s event of %s (%s); retrying", event.type, event.job, exc)
                self._stop.wait(min(delay, left))
                delay = min(2 * delay, 5.0)

    def run_assignment(self, a: Assignment) -> str:
        """Run one assignment to its end; returns the outcome (succeeded | failed | cancelled)."""
        self._set(state=WorkerState.BUSY, job=a.job, attempt=a.attempt, rank=a.rank, world=a.world)
        self.metrics.busy.set(1)
        outcome = "failed"
        try:
            if self.bus.cancelled(a.job, a.attempt):
                raise Cancelled()
            coserve = a.coserve and self._engine_call() is not None
            if a.coserve and not coserve:  # its peers may co-serve: the all-reduce is the same either way
                log.info("job %s: this worker serves no inference; rank %d runs dedicated", a.job, a.rank)
            if not coserve:
                self._post(self._event(a, "started", coserved=False))
            self._train(a, coserve)  # a co-served attempt posts "started" once the engine took it
            outcome = "succeeded"
        except Cancelled:
            outcome = "cancelled"
            self._post(self._event(a, "cancelled"))
        except Exception as exc:
            reason, message = classify_failure(exc)
            if reason == WORKER_ERROR:
                log.error("job %s failed:\n%s", a.job, traceback.format_exc())
            else:
                log.warning("job %s failed: %s: %s", a.job, reason, message)
            self._post(self._event(a, "failed", reason=reason, message=message))
        finally:
            self.metrics.jobs.labels(outcome).inc()
            self.metrics.busy.set(0)
            self._set(state=WorkerState.READY, job=None, attempt=None, rank=None, world=None)
        return outcome

    def _engine_call(self) -> Callable[[EngineOp, Any], Any] | None:
        return self.cfg.engine_call() if self.cfg.engine_call is not None else None

    def _train(self, a: Assignment, coserve: bool = False) -> None:
        assert self.loaded is not None
        if a.model != self.cfg.model:
            raise _Fail(
                INVALID_ASSIGNMENT, f"job needs model {a.model!r}, this worker holds {self.cfg.model!r}"
            )
        published = _published_uri(a.artifact_dir)
        a = _with_local_paths(a)
        try:
            spec = TuningJobSpec.model_validate(a.spec)
        except ValueError as exc:
            raise _Fail(INVALID_SPEC, f"spec does not validate: {exc}") from exc
        out = spec.output
        if out and out.uri and s3.is_s3(out.uri):  # staged at artifact_dir, then uploaded by rank 0
            published = out.uri
            if a.rank == 0:  # a missing bucket or refused credentials fail the job now, not after tuning
                s3.check_bucket(out.uri, out.secret_name)
        records = load_dataset(a.dataset)
        train, evals = split(records, a.eval_fraction, a.max_eval, a.seed)
        max_length = self._max_length(spec.hyperparameters.virtual_tokens)
        init_text = a.initial_prompt if a.initial_prompt is not None else spec.initial_prompt
        bank_report = None
        if a.prompt_bank != "never":
            # Every rank runs the same deterministic lookup (same bank, model and eval samples), so all
            # start from the same prompt without another round trip; rank 0 reports it.
            selection = self._select_prompt(a, spec, evals, max_length)
            init_text, bank_report = selection.prompt, selection.to_report()
        cfg = TuningConfig.from_spec(
            spec,
            eval_every=a.eval_every,
            checkpoint_every=a.checkpoint_every,
            seed=a.seed,
            max_length=max_length,
            init_text=init_text,
        )
        cancelled = _CancelCheck(self.bus, a.job, a.attempt)
        if coserve:
            from elastune_worker.serving.coserve.task import CoServeRefused

            call = self._engine_call()
            assert call is not None
            try:
                self._coserve(a, call, cfg, train, evals, bank_report, cancelled, published)
                return
            except CoServeRefused as exc:
                log.warning(
                    "job %s: the serving engine refused to co-serve it (%s); tuning dedicated", a.job, exc
                )
                self._post(self._event(a, "started", coserved=False, message=f"co-serving refused: {exc}"))
        allreduce = None
        if a.world > 1:
            allreduce = StorageAllReduce(
                make_channel(a.channel_url),
                a.comm_job,
                a.rank,
                a.world,
                timeout_s=a.collective_timeout_s,
                should_abort=cancelled,
            )
        trainer = Trainer(
            self.loaded.path,
            cfg,
            train,
            evals,
            worker=a.rank,
            world=a.world,
            allreduce=allreduce,
            checkpoint_dir=a.checkpoint_dir,
            device=self.loaded.device,
            base_model=self.loaded.model,
        )
        lead = a.rank == 0
        if lead:
            initial = trainer.evaluate() if trainer.iterations == 0 and trainer.records_eval else None
            start = trainer.iterations
            self._post(
                self._event(
                    a,
                    "progress",
                    iterations=start,
                    checkpointed=start,
                    resumed_from=start,
                    metric=cfg.metric,
                    initial_value=initial,
                    prompt_bank=bank_report,
                )
            )
        window: list[float] = []

        def on_step(info: StepInfo) -> None:
            self.metrics.steps.inc()
            self.metrics.compute.observe(info.seconds)
            self.metrics.sync.observe(info.sync_seconds)
            window.append(info.seconds + info.sync_seconds)
            if cancelled():
                raise Cancelled()
            if lead and (info.value is not None or len(window) >= a.progress_every):
                ckpt = info.iterations - info.iterations % cfg.checkpoint_every
                self._post(
                    self._event(
                        a,
                        "progress",
                        iterations=info.iterations,
                        checkpointed=ckpt,
                        loss=info.loss,
                        metric=info.metric,
                        value=info.value,
                        seconds_per_iteration=sum(window) / len(window),
                        sync_seconds=info.sync_seconds,
                    )
                )
                window.clear()

        try:
            result = trainer.run(progress_cb=on_step)
        except CollectiveAborted as exc:
            raise Cancelled() from exc
        if not lead:
            return
        if cancelled():  # the control plane gave this attempt up: its retry owns the artifact
            raise Cancelled()
        trainer.save_artifact(a.artifact_dir)
        _upload(a, a.artifact_dir, published)
        projection = trainer.prompt_projection()
        self._post(
            self._event(
                a,
                "succeeded",
                iterations=result.iterations,
                checkpointed=result.iterations,
                metric=result.metric,
                value=result.value,
                metrics=result.metrics,
                reason=result.termination_reason,
                prompt=projection[0] if projection else None,
                artifact=published or str(Path(a.artifact_dir).resolve()),
            )
        )

    def _coserve(
        self,
        a: Assignment,
        call: Callable[[EngineOp, Any], Any],
        cfg: TuningConfig,
        train: list,
        evals: list,
        bank_report: Any,
        cancelled: Callable[[], bool],
        published: str | None = None,
    ) -> None:
        """The assignment inside the serving engine's iterations (serving.coserve.task): started, polled
        for progress, checkpoints and cancellation every poll, finished with the artifact."""
        from elastune_worker.serving.coserve.task import DEFAULT_TPOT_SLO_S, CoServeRequest

        req = CoServeRequest(
            a.job, cfg, train, evals, a.checkpoint_dir, a.tpot_slo_s or DEFAULT_TPOT_SLO_S, rank=a.rank,
            world=a.world, channel_url=a.channel_url, comm_job=a.comm_job,
            collective_timeout_s=a.collective_timeout_s,
        )  # fmt: skip
        lead = a.rank == 0
        p = call(EngineOp.COSERVE_START, req)  # raises CoServeRefused before anything ran
        self._post(self._event(a, "started", coserved=True))
        if lead:
            self._post(
                self._event(
                    a, "progress", iterations=p.iterations, checkpointed=p.iterations,
                    resumed_from=p.iterations, metric=cfg.metric, prompt_bank=bank_report,
                )
            )  # fmt: skip
        # Data parallel: a step waits for the all-reduce, applied at the next poll when the engine has no
        # requests to step for, so poll often (a poll is one message to the engine process).
        poll_s = min(self.cfg.poll_seconds, 0.5 if a.world == 1 else 0.02)
        reported, t_reported = p.iterations, time.monotonic()
        while not p.done:
            if cancelled() or self._stop.is_set():
                call(EngineOp.COSERVE_STOP, None)
                raise Cancelled()
            time.sleep(poll_s)
            p = call(EngineOp.COSERVE_POLL, None)
            if p.iterations - reported >= a.progress_every or (p.done and p.iterations > reported):
                now = time.monotonic()
                self.metrics.steps.inc(p.iterations - reported)
                if lead:
                    self._post(
                        self._event(
                            a, "progress", iterations=p.iterations, checkpointed=p.checkpointed,
                            loss=p.loss, seconds_per_iteration=(now - t_reported) / (p.iterations - reported),
                        )
                    )  # fmt: skip
                reported, t_reported = p.iterations, now
        if p.dropped is not None:
            call(EngineOp.COSERVE_STOP, None)
            raise RuntimeError(f"the serving engine gave the co-served job up: {p.dropped}")
        r = call(EngineOp.COSERVE_FINISH, a.artifact_dir)
        if r is None:  # not rank 0
            return
        _upload(a, r.artifact, published)
        self._post(
            self._event(
                a, "succeeded", iterations=r.iterations, checkpointed=r.iterations, metric=r.metric,
                value=r.value, metrics=r.metrics, reason=r.termination_reason, prompt=r.prompt,
                artifact=published or r.artifact,
            )
        )  # fmt: skip

    def _select_prompt(self, a: Assignment, spec: TuningJobSpec, evals: list, max_length: int) -> Any:
        """The Prompt Bank's pick for this job, or its own initial prompt with the reason (never raises
        for a missing/empty bank or unusable eval samples: select_initial_prompt falls back)."""
        from elastune_worker.bank import bank_dir, select_initial_prompt

        assert self.loaded is not None
        return select_initial_prompt(
            bank_dir(str(self.loaded.path.resolve())),
            self.loaded.model,
            self.loaded.tokenizer,
            evals,
            spec.initial_prompt,
            mode=a.prompt_bank,
            budget_s=a.bank_budget_s,
            virtual_tokens=spec.hyperparameters.virtual_tokens,
            layout="soft" if spec.method == "promptTuning" else "text",
            max_length=max_length,
        )

    def _max_length(self, virtual_tokens: int) -> int:
        """Input+target tokens per sample: the default, capped so the virtual tokens still fit the
        model's context (small models have short ones)."""
        assert self.loaded is not None
        config = self.loaded.model.config
        context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        default = TuningConfig.max_length
        if context is None:
            return default
        room = context - virtual_tokens
        if room < 16:
            raise _Fail(
                INVALID_SPEC,
                f"spec.hyperparameters.virtualTokens ({virtual_tokens}) leaves {room} of the model's "
                f"{context} positions for the input and target; use fewer virtual tokens",
            )
        return min(default, room)


def _upload(a: Assignment, local: str, published: str | None) -> None:
    """An s3:// output: the saved artifact goes to the bucket (with the Secret the spec names) before
    the job is reported succeeded, so its status never names an artifact that is not there."""
    if published and s3.is_s3(published):
        output = a.spec.get("output") or {}
        s3.upload(local, published, output.get("secretName"))


def _with_local_paths(a: Assignment) -> Assignment:
    """The assignment with its checkpoint and artifact locations as paths in this pod: a pvc:// URI is
    the claim's mount, through the one resolver the adapter loader (serving.runner.lora.storage) reads by."""
    try:
        ckpt, out = (str(storage.local_path(u)) for u in (a.checkpoint_dir, a.artifact_dir))
    except ValueError as exc:
        raise _Fail(INVALID_ASSIGNMENT, f"checkpoint or artifact location: {exc}") from exc
    return a.model_copy(update={"checkpoint_dir": ckpt, "artifact_dir": out})


def _published_uri(location: str) -> str | None:
    """What the succeeded event reports for an artifact written to ``location``: a storage URI as given
    (pvc://: readable from any pod that mounts the claim, unlike this pod's path); None for a path or
    file:// URI (the path written is reported, as before)."""
    try:
        loc = storage.parse(location)
    except ValueError:
        return None
    return None if loc.scheme in ("", storage.FILE) else str(loc)


class _Fail(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _CancelCheck:
    """bus.cancelled(), at most every 0.25 s: called once per step and while polling peers."""

    def __init__(self, bus: Bus, job: str, attempt: int) -> None:
        self.bus, self.job, self.attempt = bus, job, attempt
        self._next = 0.0
        self._value = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self._value and now >= self._next:
            self._next = now + 0.25
            try:
                self._value = self.bus.cancelled(self.job, self.attempt)
            except Exception:
                self._value = False  # Redis hiccup: the collective timeout still bounds the wait
        return self._value


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """(reason, message) of a failed assignment, the reason a CamelCase constant for the job's status."""
    if isinstance(exc, _Fail):
        return exc.reason, str(exc)
    if isinstance(exc, DatasetError | s3.StorageError):
        return exc.reason, str(exc)
    if isinstance(exc, ChannelError):
        return CHANNEL_UNREACHABLE, f"gradient storage channel: {exc}"
    if isinstance(exc, CollectiveTimeout):
        return COLLECTIVE_TIMEOUT, str(exc)
    if isinstance(exc, CheckpointMismatch):
        return CHECKPOINT_MISMATCH, str(exc)
    if isinstance(exc, ValueError):  # config checks: context too long, bad combination of fields
        return INVALID_SPEC, str(exc)
    return WORKER_ERROR, f"{type(exc).__name__}: {exc}"


def default_worker_id(pool: str) -> str:
    """POD_NAME (downward API) on Kubernetes, else <pool>-<host>-<pid>."""
    return os.environ.get("POD_NAME") or f"{pool}-{socket.gethostname()}-{os.getpid()}"


def _process_start_time() -> float:
    """When this process started (T_cold counts the interpreter and imports, not just the weights)."""
    try:
        ticks = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
