"""A tuning assignment co-served inside a serving engine (issue 13), on the engine's side.

The worker's agent sends a ``CoServeRequest`` through the engine's call channel (``coserve_start``,
routed here by ``calls.CoServeCalls``); this module builds the dedicated trainer (its own PEFT model over
the same model directory), wraps it in ``CoServedJob`` and attaches it, with a ``CoServePlanner`` whose
latency lines start from the engine's profiled costs and are refitted online, as the engine's step hook
(``hook.CoServeHook``). The engine then runs the job's forward windows and layer-wise backward in the
budget its inference leaves each iteration (FlexLLM §6). The agent polls
(``coserve_poll``): each poll writes a checkpoint when the job crossed a ``checkpointEvery`` boundary, so
a pod dying mid-job resumes from it like a dedicated run. ``coserve_finish`` evaluates once, writes the
final checkpoint and the artifact.

Data-parallel jobs (world > 1) co-serve one shard per worker and all-reduce through the storage channel
(``CoServedJob``); rank 0 evaluates and writes checkpoints and the artifact, as in a dedicated run.

Not co-served: evaluations between steps (an evaluation would stall inference for its whole duration),
so a target metric can only be checked at the end; the control plane co-serves jobs that stop on
maxIterations (``elastune_contract.coserve.coservable``). Building the trainer and the final evaluation
run between engine steps, so inference pauses for them once per job (a second or two on the tiny
models here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from elastune_contract.coserve import COSERVABLE_METHODS
from elastune_worker.comm import StorageAllReduce, make_channel
from elastune_worker.coserve.hook import CoServeHook
from elastune_worker.coserve.job import CoServedJob
from elastune_worker.coserve.planner import CoServeConfig, CoServePlanner, LatencyModel
from elastune_worker.engine.llm_engine import LLMEngine
from elastune_worker.tuning.data import Record
from elastune_worker.tuning.trainer import MAX_ITERATIONS, Trainer, TuningConfig

log = logging.getLogger("elastune.serving")

DEFAULT_TPOT_SLO_S = 0.1
"""The iteration latency target when the pool names no TPOT SLO (100 ms: a fluent stream)."""


@dataclass(frozen=True)
class CoServeRequest:
    """Everything the engine's side needs to run one co-served assignment (picklable)."""

    job: str
    cfg: TuningConfig
    train: list[Record]
    evals: list[Record]
    checkpoint_dir: str
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S
    rank: int = 0
    world: int = 1
    channel_url: str | None = None
    """The storage channel of the gradient all-reduce (world > 1), as for a dedicated attempt."""
    comm_job: str = ""
    collective_timeout_s: float = 30.0


class CoServeRefused(Exception):
    """The engine cannot co-serve this assignment (the worker then tunes it dedicated and says why)."""


@dataclass(frozen=True)
class CoServeProgress:
    job: str
    iterations: int
    loss: float | None
    checkpointed: int
    tokens_trained: int
    done: bool
    dropped: str | None
    """Why the engine gave the job up (its step failed); None while it runs or after it finished."""


@dataclass(frozen=True)
class CoServeResult:
    iterations: int
    metric: str
    value: float
    metrics: dict[str, float]
    termination_reason: str
    prompt: str | None
    artifact: str


class CoServeTask:
    def __init__(self, engine: LLMEngine, req: CoServeRequest) -> None:
        """Raises ``CoServeRefused`` for what this engine cannot co-serve; other errors (the data, the
        checkpoint) are the job's and fail it as they would a dedicated attempt."""
        if engine.hook_pending():
            raise CoServeRefused("this engine already co-serves a job")
        if req.cfg.method not in COSERVABLE_METHODS:
            raise CoServeRefused(f"method {req.cfg.method!r} cannot be co-served")
        self.engine, self.req = engine, req
        allreduce = None
        if req.world > 1:
            if req.channel_url is None:
                raise ValueError("a data-parallel co-served job needs the storage channel's URL")
            allreduce = StorageAllReduce(
                make_channel(req.channel_url), req.comm_job, req.rank, req.world,
                timeout_s=req.collective_timeout_s, should_abort=lambda: self.job.reason is not None,
            )  # fmt: skip
        self.trainer = Trainer(
            engine.model_path,
            req.cfg,
            req.train,
            req.evals,
            worker=req.rank,
            world=req.world,
            allreduce=allreduce,
            checkpoint_dir=req.checkpoint_dir,
            device=engine.runner.device,
        )
        try:
            self.job = CoServedJob(self.trainer, served_model_dir=engine.model_path)
        except (TypeError, ValueError) as exc:  # an architecture the runner cannot split into layers
            raise CoServeRefused(str(exc)) from exc
        cost = getattr(engine, "cost", None)
        per_token = max(cost.prefill_s_per_token, 1e-6) if cost is not None else 1e-4
        base = cost.decode_step_base_s if cost is not None else 0.005
        self.planner = CoServePlanner(  # the finetuning lines start from the engine's, refitted online
            CoServeConfig(tpot_slo_s=req.tpot_slo_s),
            LatencyModel(base, per_token),
            forward=LatencyModel(base, per_token),
            backward=LatencyModel(base, per_token),
        )
        self.checkpointed = self.trainer.iterations
        self.hook = CoServeHook(self.job, self.planner)
        engine.attach_hook(self.hook)
        log.info("co-serving %s from iteration %d", req.job, self.trainer.iterations)

    def poll(self) -> CoServeProgress:
        self.job.state()  # applies an all-reduced step that came back while the engine had no requests
        t = self.trainer
        every = t.cfg.checkpoint_every
        if t.iterations - t.iterations % every > self.checkpointed:
            t.save_checkpoint()  # between engine steps: the job's optimizer state is consistent here
            self.checkpointed = t.iterations
        loss = t.history[-1]["loss"] if t.history else None
        return CoServeProgress(
            self.req.job, t.iterations, loss, self.checkpointed, self.job.tokens_trained,
            self.job.done, self.job.reason,
        )  # fmt: skip

    def finish(self, artifact_dir: str) -> CoServeResult | None:
        """The final evaluation, checkpoint and artifact on rank 0 (None on the other ranks, which hold
        the same parameters: they only detach)."""
        if not self.job.done or self.job.reason is not None:
            raise RuntimeError(f"the co-served job {self.req.job} has not finished")
        self.engine.detach_hook()
        t = self.trainer
        if self.req.rank != 0:
            return None
        t.save_checkpoint()
        result = t.finish(MAX_ITERATIONS)
        out = t.save_artifact(artifact_dir)
        projection = t.prompt_projection()
        return CoServeResult(
            result.iterations, result.metric, result.value, dict(result.metrics), result.termination_reason,
            projection[0] if projection else None, str(Path(out).resolve()),
        )  # fmt: skip

    def stop(self) -> None:
        """Cancelled: detach; the last checkpoint stays for a resume elsewhere."""
        if self.engine.detach_hook() is self.hook and not self.job.done:
            self.job.drop("cancelled")
