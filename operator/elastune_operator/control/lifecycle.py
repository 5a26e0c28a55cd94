"""The TuningJob lifecycle: conditions, status fields and the Prompt Bank block, one transition each.

Only status lives here: the scheduler's state, the workers and the bus belong to the core and the fleet,
which call these transitions when something happened. Every reason comes from the shared vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from elastune_contract.api import units
from elastune_contract.api.common import ConditionStatus, set_condition
from elastune_contract.api.tuningjob import PromptBankStatus
from elastune_contract.protocol import Event, PromptBankReport
from elastune_contract.vocabulary import PROMPT_BANK_SKIP_REASONS, ConditionType, Reason
from elastune_operator.control.records import JobRecord
from elastune_operator.metrics import ControlMetrics

log = logging.getLogger("elastune.control")

C = ConditionType


class JobLifecycle:
    """Writes a job's status for each transition and hands it to ``on_status`` (the operator patches
    the resource; local mode prints and saves it)."""

    def __init__(self, metrics: ControlMetrics, on_status: Callable[[JobRecord], None]) -> None:
        self.metrics = metrics
        self.on_status = on_status

    # -- acceptance and scheduling ------------------------------------------------------------------
    def accepted(self, job: JobRecord) -> None:
        """Accepted; the core emits once the Prompt Bank verdict is in the status too."""
        job.status.observed_generation = job.generation
        self.condition(job, C.ACCEPTED, "True", Reason.VALIDATED, "spec is valid; waiting for the scheduler")
        self.condition(job, C.SCHEDULED, "False", Reason.PENDING, "waiting for warm GPUs")
        self.condition(job, C.SUCCEEDED, "Unknown", Reason.PENDING, "")
        self.metrics.jobs_submitted.labels(job.llm, job.pool_namespace).inc()

    def warm_gpus_assigned(self, job: JobRecord, count: int) -> None:
        self.condition(
            job, C.SCHEDULED, "True", Reason.WARM_GPUS_ASSIGNED, f"{count} warm GPU(s) of pool {job.pool}"
        )
        self.emit(job)

    def pool_growing(self, job: JobRecord, count: int, *, held_for_job: bool) -> None:
        """Algorithm 2 grows the pool (B_l += A); Algorithm 1 then hands out the warm GPUs."""
        self.condition(
            job,
            C.SCHEDULED,
            "True" if held_for_job else "False",
            Reason.POOL_GROWING,
            f"pool {job.pool} is warming up {count} more GPU(s) from the cold pool",
        )
        self.emit(job)

    def running(self, job: JobRecord, now: float, predicted: float) -> None:
        st = job.status
        world = len(job.workers)
        st.attempts = job.attempt
        st.allocated_gpus, st.pods = world, list(job.workers)
        st.start_time = st.start_time or _ts(now)
        st.predicted_completion_time = _ts(predicted)
        self.condition(
            job, C.SCHEDULED, "True", Reason.WARM_GPUS_ASSIGNED, f"{world} warm GPU(s) of pool {job.pool}"
        )
        resumed = f", resuming at iteration {job.checkpointed}" if job.attempt > 1 else ""
        ended = next((c for c in st.conditions if c.type == C.RUNNING and c.status == "False"), None)
        if resumed and ended is not None and ended.reason != Reason.PENDING:
            resumed += f" after {ended.reason}"  # why the last attempt ended, in the status that stays
        self.condition(
            job,
            C.RUNNING,
            "True",
            Reason.TUNING,
            f"attempt {job.attempt} on {', '.join(job.workers)}{resumed}",
        )
        self.emit(job)

    # -- the Prompt Bank ----------------------------------------------------------------------------
    def bank_skipped(self, job: JobRecord, reason: str, message: str) -> None:
        """The latency budget said no (or the spec said never): the job tunes from its own prompt."""
        job.status.prompt_bank = PromptBankStatus(used=False, reason=reason, message=message)
        self.metrics.bank_lookups.labels(job.llm, job.pool_namespace, "skipped").inc()

    def bank_reported(self, job: JobRecord, report: PromptBankReport) -> None:
        """The worker's lookup outcome (its pick, or why the bank could not serve)."""
        job.status.prompt_bank = PromptBankStatus(
            used=report.used,
            prompt=report.prompt,
            score=_dec(report.score) if report.score is not None else None,
            evaluations=report.evaluations,
            latency_seconds=_dec(report.latency_seconds, 3) if report.latency_seconds is not None else None,
            reason=report.reason,
            message=report.message or None,
        )
        result = (
            "used" if report.used else ("skipped" if report.reason in PROMPT_BANK_SKIP_REASONS else "failed")
        )
        self.metrics.bank_lookups.labels(job.llm, job.pool_namespace, result).inc()
        if report.latency_seconds is not None:
            self.metrics.bank_latency.labels(job.llm, job.pool_namespace).observe(report.latency_seconds)

    # -- progress and retries -----------------------------------------------------------------------
    def progress(self, job: JobRecord, ev: Event, predicted_completion: float | None) -> None:
        st = job.status
        if ev.initial_value is not None:
            st.initial_metric = _dec(ev.initial_value)
            st.current_metric = st.current_metric or _dec(ev.initial_value)
        if ev.iterations is not None:
            st.iterations = ev.iterations
        if ev.value is not None:
            st.current_metric = _dec(ev.value)
        if predicted_completion is not None:
            st.predicted_completion_time = _ts(predicted_completion)
        self.emit(job)

    def retrying(self, job: JobRecord, reason: str, message: str) -> None:
        """The attempt failed in a way a retry from the checkpoint may fix."""
        self.condition(job, C.RUNNING, "False", reason, f"{message}; retrying from the checkpoint")
        self.emit(job)

    def worker_lost(
        self,
        job: JobRecord,
        worker: str,
        iterations: int,
        reason: str = Reason.WORKER_LOST,
        detail: str | None = None,
    ) -> None:
        """A bound worker is gone; ``reason`` and ``detail`` say how when its pod's status told."""
        how = f" ({detail})" if detail else ""
        self.condition(
            job,
            C.RUNNING,
            "False",
            reason,
            f"worker {worker} was lost at attempt {job.attempt}{how}; resuming from the checkpoint at "
            f"iteration {iterations} once GPUs are free",
        )
        self.condition(job, C.SCHEDULED, "False", Reason.RESCHEDULING, "waiting for GPUs after a lost worker")
        job.status.allocated_gpus, job.status.pods = 0, []
        self.emit(job)

    def attempt_lost(self, job: JobRecord) -> None:
        """The attempt in flight did not survive a control-plane restart."""
        self.condition(
            job,
            C.RUNNING,
            "False",
            Reason.ATTEMPT_LOST,
            f"attempt {job.attempt} did not survive the control-plane restart; resuming from the "
            f"checkpoint at iteration {job.checkpointed}",
        )
        self.emit(job)

    # -- endings ------------------------------------------------------------------------------------
    def succeeded(self, job: JobRecord, ev: Event, now: float) -> None:
        st = job.status
        st.iterations = ev.iterations
        st.current_metric = _dec(ev.value) if ev.value is not None else st.current_metric
        st.optimized_prompt = ev.prompt
        st.artifact_uri = _file_uri(ev.artifact) if ev.artifact else None
        why = ev.reason or Reason.COMPLETED
        self.finished(job, now, "True", why, f"{why} after {ev.iterations} iterations")

    def failed(self, job: JobRecord, reason: str, message: str, now: float) -> None:
        if not any(c.type == C.ACCEPTED for c in job.status.conditions):
            self.condition(
                job, C.ACCEPTED, "True" if reason != Reason.UNKNOWN_MODEL else "False", reason, message
            )
        self.finished(job, now, "False", reason, message)

    def finished(
        self, job: JobRecord, now: float, status: ConditionStatus, reason: str, message: str
    ) -> None:
        """Terminal: Succeeded True/False (and Failed), final figures, SLO met or not."""
        job.terminal = True
        st = job.status
        st.allocated_gpus, st.pods = 0, []
        st.completion_time = _ts(now)
        st.gpu_seconds = _dec(job.gpu_seconds, 1)
        st.slo_met = now <= job.deadline.at
        st.predicted_completion_time = None
        self.condition(job, C.RUNNING, "False", reason, "")
        self.condition(job, C.SUCCEEDED, status, reason, message)
        if status == "False":
            self.condition(job, C.FAILED, "True", reason, message)
        outcome = "succeeded" if status == "True" else "failed"
        self.metrics.jobs_finished.labels(job.llm, job.pool_namespace, outcome).inc()
        self.metrics.slo.labels(job.llm, job.pool_namespace, "met" if st.slo_met else "missed").inc()
        self.metrics.job_latency.labels(job.llm, job.pool_namespace).observe(now - job.created)
        self.emit(job)

    # -- tune -> serve ------------------------------------------------------------------------------
    def published(self, job: JobRecord, name: str) -> None:
        """The job's LoRAAdapter exists (created now, or by this job before a restart)."""
        self.condition(job, C.PUBLISHED, "True", Reason.PUBLISHED, f"LoRAAdapter {name}")
        self.emit(job)

    def publish_refused(self, job: JobRecord, reason: str, message: str) -> None:
        """output.publish did not become a LoRAAdapter (e.g. PublishNameTaken): said, never silent."""
        self.condition(job, C.PUBLISHED, "False", reason, message)
        self.emit(job)

    # -- helpers ------------------------------------------------------------------------------------
    def condition(
        self, job: JobRecord, ctype: str, status: ConditionStatus, reason: str, message: str
    ) -> None:
        job.status.conditions = set_condition(
            job.status.conditions, ctype, status, reason, message, observed_generation=job.generation
        )

    def emit(self, job: JobRecord) -> None:
        try:
            self.on_status(job)
        except Exception:  # a status sink must never break the round
            log.exception("status callback failed for %s", job.key)


def status_dict(job: JobRecord) -> dict[str, Any]:
    """The status as the operator writes it (camelCase, no nulls)."""
    return job.status.model_dump(by_alias=True, exclude_none=True, mode="json")


def is_terminal(job: JobRecord) -> bool:
    """A job whose persisted status already says it ended (Succeeded True or False)."""
    done = next((c for c in job.status.conditions if c.type == C.SUCCEEDED), None)
    return done is not None and done.status != "Unknown"


def succeeded(job: JobRecord) -> bool:
    """A job whose status says it succeeded."""
    return any(c.type == C.SUCCEEDED and c.status == "True" for c in job.status.conditions)


def _dec(value: float, places: int = 4) -> str:
    return units.format_decimal(round(float(value), places))


def _ts(unix: float) -> str:
    return units.format_timestamp(datetime.fromtimestamp(unix, UTC))


def _file_uri(path: str) -> str:
    return path if "://" in path else "file://" + str(Path(path).resolve())
