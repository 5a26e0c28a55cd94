"""The one engine loop: it applies the front end's messages (``messages.EngineInput``) to an
``LLMEngine``, steps it while there is work and emits what happened (``messages.EngineOutput``). The
engine thread (``async_engine.py``) and the engine process (``engine_process.py``) run it; they differ
only in how messages travel. Calls beyond adapter management (the worker's co-served tuning) go to the
``CallHandler`` the engine was started with (coserve/calls.py): the engine never imports co-serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastune_worker.engine.frontend.messages import (
    AbortRequest,
    AddRequest,
    CallReply,
    EngineCall,
    EngineInput,
    EngineOp,
    EngineOutput,
    RequestErrored,
    RequestRefused,
    Shutdown,
    StatsUpdate,
    StepOutputs,
)

if TYPE_CHECKING:
    from elastune_worker.engine.llm_engine import LLMEngine

log = logging.getLogger("elastune.serving")

Receive = Callable[[bool], EngineInput | None]
"""The next message; ``True``: wait for one, ``False``: None when none is pending. A ``Shutdown`` when
the sender is gone."""
Emit = Callable[[EngineOutput], None]
CallHandler = Callable[["LLMEngine", EngineOp, Any], Any]
"""Runs the engine calls that are not adapter management, between steps (the worker's:
``elastune_worker.coserve.calls.CoServeCalls``)."""


class EngineLoop:
    def __init__(
        self, engine: LLMEngine, receive: Receive, emit: Emit, calls: CallHandler | None = None
    ) -> None:
        self.engine, self.receive, self.emit, self.calls = engine, receive, emit, calls

    def run(self) -> None:
        """Until a ``Shutdown``: every pending message is applied before the next step; idle, the loop
        blocks on the next message, having emitted the stats once."""
        engine = self.engine
        fresh = False  # the front end's stats reflect the engine's state
        while True:
            idle = not engine.has_work()
            if idle and not fresh:  # about to block: the last aborts/finishes must show in the metrics
                self.emit(StatsUpdate(engine.stats()))
                fresh = True
            msg = self.receive(idle)
            if msg is not None:
                if isinstance(msg, Shutdown):
                    return
                fresh = False
                self.apply(msg)
                continue  # drain every pending message before the next step
            self.step()

    def apply(self, msg: EngineInput) -> None:
        engine = self.engine
        if isinstance(msg, AddRequest):
            try:
                engine.add_request(
                    msg.request_id,
                    msg.prompt,
                    msg.params,
                    priority=msg.priority,
                    extra_key=msg.extra_key,
                    adapter=msg.adapter,
                    tenant=msg.tenant,
                )
            except ValueError as exc:  # bad input is the caller's: hand the error back
                self.emit(RequestRefused(msg.request_id, str(exc)))
            except Exception as exc:
                log.exception("adding request %s failed", msg.request_id)
                self.emit(RequestErrored(msg.request_id, f"{type(exc).__name__}: {exc}"))
        elif isinstance(msg, AbortRequest):
            engine.abort(msg.request_id)
        elif isinstance(msg, EngineCall):
            try:
                result, error = engine_call(engine, msg.op, msg.arg, self.calls), None
            except Exception as exc:
                result, error = None, exc
            self.emit(CallReply(msg.call_id, result, error, engine.stats()))

    def step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as exc:  # a bug in a step: fail the requests in flight, keep serving
            log.exception("engine step failed")
            for rid in engine.unfinished_request_ids():
                engine.abort(rid)
                self.emit(RequestErrored(rid, f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        self.emit(StepOutputs(outputs, engine.stats()))


def engine_call(engine: LLMEngine, op: EngineOp, arg: Any, calls: CallHandler | None = None) -> Any:
    """Runs an ``EngineCall`` on the engine: adapter management here, the rest (co-served tuning) by
    ``calls``."""
    if op is EngineOp.LOAD_LORA:  # (name, path) or (name, path, namespace)
        name, path, *namespace = arg
        return engine.load_lora(name, path, *namespace)
    if op is EngineOp.UNLOAD_LORA:  # name or (name, namespace)
        return engine.unload_lora(*arg) if isinstance(arg, tuple) else engine.unload_lora(arg)
    if calls is None:
        raise RuntimeError(f"this engine takes no {op.value} call (it was started without a call handler)")
    return calls(engine, op, arg)
