"""The worker's job loop: register, heartbeat, pop assignments, run them, report (docs/design.md §5
pull model).

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

from elastune_common.bus import Bus
from elastune_contract.protocol import (
    HEARTBEAT_SECONDS,
    Assignment,
    ServingState,
    WorkerRecord,
    WorkerState,
    pod_worker_id,
)
from elastune_contract.vocabulary import Reason
from elastune_worker.server.coserved import EngineCall, run_coserved
from elastune_worker.server.dedicated import run_dedicated
from elastune_worker.server.job_events import JobReporter
from elastune_worker.server.metrics import WorkerMetrics
from elastune_worker.server.models import LoadedModel, ModelLoadError, load_model
from elastune_worker.server.outcomes import CancelCheck, Cancelled, classify_failure
from elastune_worker.server.training_plan import plan_training

log = logging.getLogger("elastune.worker")


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
    draining: Callable[[], bool] | None = None
    """True once the pod drains (SIGTERM): not ready, and no longer publishing its record."""
    on_heartbeat: Callable[[], None] | None = None
    """Runs before each heartbeat's publish (applies the control plane's adapter placement)."""
    engine_call: Callable[[], EngineCall | None] | None = None
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
    def draining(self) -> bool:
        return self.cfg.draining is not None and self.cfg.draining()

    @property
    def ready(self) -> bool:
        return self.record.state in (WorkerState.READY, WorkerState.BUSY) and not self.draining

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return self.record.model_dump(mode="json")

    def _set(self, **fields: object) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self.record, k, v)
        self._publish()

    def _publish(self) -> None:
        if self.draining:  # it left the registry: a heartbeat must not bring it back
            return
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
            if self.draining:  # out of the registry: no new assignment; the drain stops the loop
                self._stop.wait(0.2)
                continue
            try:
                assignment = self.bus.pop_assignment(self.cfg.worker_id, timeout=self.cfg.poll_seconds)
            except Exception as exc:
                log.warning("cannot read assignments (%s); retrying", exc)
                self._stop.wait(1.0)
                continue
            if assignment is not None:
                self.run_assignment(assignment)

    # -- one job ------------------------------------------------------------------------------------
    def run_assignment(self, a: Assignment) -> str:
        """Run one assignment to its end; returns the outcome (succeeded | failed | cancelled)."""
        self._set(state=WorkerState.BUSY, job=a.job, attempt=a.attempt, rank=a.rank, world=a.world)
        self.metrics.busy.set(1)
        reporter = JobReporter(self.bus, self.cfg.worker_id, a, self._stop)
        outcome = "failed"
        try:
            if self.bus.cancelled(a.job, a.attempt):
                raise Cancelled()
            coserve = a.coserve and self._engine_call() is not None
            if a.coserve and not coserve:  # its peers may co-serve: the all-reduce is the same either way
                log.info("job %s: this worker serves no inference; rank %d runs dedicated", a.job, a.rank)
            if not coserve:
                reporter.report("started", coserved=False)
            self._train(a, reporter, coserve)  # a co-served attempt posts "started" once the engine took it
            outcome = "succeeded"
        except Cancelled:
            outcome = "cancelled"
            reporter.report("cancelled")
        except Exception as exc:
            reason, message = classify_failure(exc)
            if reason == Reason.WORKER_ERROR:
                log.error("job %s failed:\n%s", a.job, traceback.format_exc())
            else:
                log.warning("job %s failed: %s: %s", a.job, reason, message)
            reporter.report("failed", reason=reason, message=message)
        finally:
            self.metrics.jobs.labels(outcome).inc()
            self.metrics.busy.set(0)
            self._set(state=WorkerState.READY, job=None, attempt=None, rank=None, world=None)
        return outcome

    def _engine_call(self) -> EngineCall | None:
        return self.cfg.engine_call() if self.cfg.engine_call is not None else None

    def _train(self, a: Assignment, reporter: JobReporter, coserve: bool) -> None:
        """The assignment's plan, run inside the serving engine when it co-serves and the engine takes
        it, else by the worker's own trainer."""
        assert self.loaded is not None
        plan = plan_training(a, self.loaded, self.cfg.model)
        cancelled = CancelCheck(self.bus, a.job, a.attempt)
        if coserve:
            from elastune_worker.coserve.task import CoServeRefused

            call = self._engine_call()
            assert call is not None
            try:
                run_coserved(plan, call, reporter, cancelled, self._stop, self.metrics, self.cfg.poll_seconds)
                return
            except CoServeRefused as exc:
                log.warning(
                    "job %s: the serving engine refused to co-serve it (%s); tuning dedicated", a.job, exc
                )
                reporter.report("started", coserved=False, message=f"co-serving refused: {exc}")
        run_dedicated(plan, self.loaded, reporter, cancelled, self.metrics)


def default_worker_id(pool: str) -> str:
    """POD_NAMESPACE/POD_NAME (downward API) on Kubernetes (``protocol.pod_worker_id``: pod names repeat
    across namespaces), POD_NAME alone without a namespace, else <pool>-<host>-<pid>."""
    pod = os.environ.get("POD_NAME")
    if pod:
        return pod_worker_id(os.environ.get("POD_NAMESPACE", ""), pod)
    return f"{pool}-{socket.gethostname()}-{os.getpid()}"


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
