"""A training plan run by the worker's own trainer (not inside the serving engine): the trainer built
over the loaded model, with a gradient all-reduce when the job spans several workers, run to its end
with progress on the job's stream, the artifact saved and published by rank 0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from elastune_worker.comm import CollectiveAborted, StorageAllReduce, make_channel
from elastune_worker.server.job_events import JobReporter, StepProgress
from elastune_worker.server.metrics import WorkerMetrics
from elastune_worker.server.models import LoadedModel
from elastune_worker.server.outcomes import Cancelled
from elastune_worker.server.training_plan import TrainingPlan
from elastune_worker.tuning.trainer import Trainer


def build_trainer(plan: TrainingPlan, loaded: LoadedModel, cancelled: Callable[[], bool]) -> Trainer:
    """The trainer of ``plan``, resumed from the newest checkpoint under the assignment's checkpoint_dir
    when there is one; its peers' gradients through the job's storage channel when world > 1."""
    a = plan.assignment
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
    return Trainer(
        loaded.path,
        plan.config,
        plan.train,
        plan.evals,
        worker=a.rank,
        world=a.world,
        allreduce=allreduce,
        checkpoint_dir=a.checkpoint_dir,
        device=loaded.device,
        base_model=loaded.model,
    )


def run_dedicated(
    plan: TrainingPlan,
    loaded: LoadedModel,
    reporter: JobReporter,
    cancelled: Callable[[], bool],
    metrics: WorkerMetrics,
) -> None:
    trainer = build_trainer(plan, loaded, cancelled)
    if plan.lead:
        initial = trainer.evaluate() if trainer.iterations == 0 and trainer.records_eval else None
        start = trainer.iterations
        reporter.report(
            "progress",
            iterations=start,
            checkpointed=start,
            resumed_from=start,
            metric=plan.config.metric,
            initial_value=initial,
            prompt_bank=plan.bank_report,
        )
    progress = StepProgress(reporter, metrics, cancelled, plan.config.checkpoint_every)
    try:
        result = trainer.run(progress_cb=progress)
    except CollectiveAborted as exc:
        raise Cancelled() from exc
    if not plan.lead:
        return
    if cancelled():  # the control plane gave this attempt up: its retry owns the artifact
        raise Cancelled()
    artifact_dir = plan.assignment.artifact_dir
    trainer.save_artifact(artifact_dir)
    artifact = plan.publish(str(Path(artifact_dir).resolve()))
    projection = trainer.prompt_projection()
    reporter.report(
        "succeeded",
        iterations=result.iterations,
        checkpointed=result.iterations,
        metric=result.metric,
        value=result.value,
        metrics=result.metrics,
        reason=result.termination_reason,
        prompt=projection[0] if projection else None,
        artifact=artifact,
    )
