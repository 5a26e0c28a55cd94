"""The engine loop's co-serving calls (``EngineOp.COSERVE_*``: start, poll, finish, stop), handed to the
engine as its call handler by the worker (server/pod.py), so the engine never imports co-serving. One
instance per engine: it holds that engine's assignment; it pickles, so an engine process gets its own.
The trainer (transformers, PEFT) is imported with the first assignment, not with the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastune_worker.engine.frontend.messages import EngineOp

if TYPE_CHECKING:
    from elastune_worker.coserve.task import CoServeTask
    from elastune_worker.engine.llm_engine import LLMEngine


class CoServeCalls:
    def __init__(self) -> None:
        self.task: CoServeTask | None = None
        """The co-served assignment running on the engine, if any."""

    def __call__(self, engine: LLMEngine, op: EngineOp, arg: Any) -> Any:
        if op is EngineOp.COSERVE_START:
            from elastune_worker.coserve.task import CoServeRefused, CoServeTask

            if self.task is not None:
                raise CoServeRefused("this engine already co-serves a job")
            self.task = CoServeTask(engine, arg)
            return self.task.poll()
        task = self.task
        if task is None:
            raise RuntimeError("no co-served job on this engine")
        if op is EngineOp.COSERVE_POLL:
            return task.poll()
        self.task = None
        if op is EngineOp.COSERVE_FINISH:
            return task.finish(arg)
        if op is EngineOp.COSERVE_STOP:
            task.stop()
            return None
        raise ValueError(f"unknown engine call {op!r}")
