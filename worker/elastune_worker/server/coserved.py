"""A training plan run inside the serving engine's iterations (coserve.task): started through
the engine, polled for progress, checkpoints and cancellation, finished with the artifact. The engine
may refuse it (CoServeRefused, raised before anything ran): the agent then runs it dedicated."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from elastune_worker.engine.frontend.messages import EngineOp
from elastune_worker.server.job_events import JobReporter
from elastune_worker.server.metrics import WorkerMetrics
from elastune_worker.server.outcomes import Cancelled
from elastune_worker.server.training_plan import TrainingPlan

EngineCall = Callable[[EngineOp, Any], Any]
"""A call into the serving engine, run between its steps."""


def run_coserved(
    plan: TrainingPlan,
    call: EngineCall,
    reporter: JobReporter,
    cancelled: Callable[[], bool],
    stopping: threading.Event,
    metrics: WorkerMetrics,
    poll_seconds: float,
) -> None:
    from elastune_worker.coserve.task import DEFAULT_TPOT_SLO_S, CoServeRequest

    a, cfg = plan.assignment, plan.config
    req = CoServeRequest(
        a.job, cfg, plan.train, plan.evals, a.checkpoint_dir, a.tpot_slo_s or DEFAULT_TPOT_SLO_S,
        rank=a.rank, world=a.world, channel_url=a.channel_url, comm_job=a.comm_job,
        collective_timeout_s=a.collective_timeout_s,
    )  # fmt: skip
    p = call(EngineOp.COSERVE_START, req)  # raises CoServeRefused before anything ran
    reporter.report("started", coserved=True)
    if plan.lead:
        reporter.report(
            "progress", iterations=p.iterations, checkpointed=p.iterations, resumed_from=p.iterations,
            metric=cfg.metric, prompt_bank=plan.bank_report,
        )  # fmt: skip
    # Data parallel: a step waits for the all-reduce, applied at the next poll when the engine has no
    # requests to step for, so poll often (a poll is one message to the engine process).
    poll_s = min(poll_seconds, 0.5 if a.world == 1 else 0.02)
    reported, t_reported = p.iterations, time.monotonic()
    while not p.done:
        if cancelled() or stopping.is_set():
            call(EngineOp.COSERVE_STOP, None)
            raise Cancelled()
        time.sleep(poll_s)
        p = call(EngineOp.COSERVE_POLL, None)
        if p.iterations - reported >= a.progress_every or (p.done and p.iterations > reported):
            now = time.monotonic()
            metrics.steps.inc(p.iterations - reported)
            if plan.lead:
                reporter.report(
                    "progress", iterations=p.iterations, checkpointed=p.checkpointed, loss=p.loss,
                    seconds_per_iteration=(now - t_reported) / (p.iterations - reported),
                )  # fmt: skip
            reported, t_reported = p.iterations, now
    if p.dropped is not None:
        call(EngineOp.COSERVE_STOP, None)
        raise RuntimeError(f"the serving engine gave the co-served job up: {p.dropped}")
    r = call(EngineOp.COSERVE_FINISH, a.artifact_dir)
    if r is None:  # not rank 0
        return
    reporter.report(
        "succeeded", iterations=r.iterations, checkpointed=r.iterations, metric=r.metric, value=r.value,
        metrics=r.metrics, reason=r.termination_reason, prompt=r.prompt, artifact=plan.publish(r.artifact),
    )  # fmt: skip
