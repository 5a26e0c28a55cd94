"""The caller side of an engine that runs elsewhere (a thread or a process): one asyncio queue per
request, filled from the engine's side, read by ``generate``; leaving ``generate`` early aborts. What
crosses to the engine and back are the typed messages of ``messages.py``; the engine's side is
``engine_loop.EngineLoop``."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncGenerator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from elastune_contract.protocol import ServingCost
from elastune_worker.engine.core.adapter_ref import AdapterRef
from elastune_worker.engine.core.config import EngineConfig
from elastune_worker.engine.core.outputs import RequestFailed, RequestOutput
from elastune_worker.engine.core.sampling import SamplingParams
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
    StatsUpdate,
    StepOutputs,
)

if TYPE_CHECKING:
    from elastune_worker.engine.llm_engine import EngineStats


class EngineError(RuntimeError):
    """The engine failed while it ran a request, or it is gone."""


class RequestStreams:
    """An engine that runs on its own (a thread: ``AsyncEngine``; a process: ``ProcessEngine``), seen
    from the caller. Subclasses set what they learn of the engine (below), send messages to it
    (``_send``) and hand each message of the engine to ``_receive``, from the thread that gets them."""

    max_model_len: int
    vocab_size: int
    tokenizer: Any
    cost: ServingCost
    config: EngineConfig

    def __init__(self) -> None:
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._calls: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()
        self._stats: EngineStats | None = None

    def _send(self, msg: EngineInput) -> None:
        raise NotImplementedError

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def close(self) -> None:
        """Stop the engine (its thread or process)."""
        raise NotImplementedError

    def stats(self) -> EngineStats:
        """The engine's stats after its last step, idle moment or call."""
        assert self._stats is not None, "the engine has sent no stats yet"
        return self._stats

    def _can_abort(self) -> bool:
        return True

    async def generate(
        self,
        request_id: str,
        prompt: list[int] | str,
        params: SamplingParams,
        *,
        priority: int = 0,
        extra_key: str | None = None,
        adapter: AdapterRef | None = None,
        tenant: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already running")
            self._sinks[request_id] = (loop, sink)
        finished = False
        try:
            self._send(AddRequest(request_id, prompt, params, priority, extra_key, adapter, tenant))
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # this request failed in a step (the others go on)
                    finished = True
                    raise RequestFailed(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._sinks.pop(request_id, None)
            if not finished and self._can_abort():
                self._send(AbortRequest(request_id))

    async def call(self, op: EngineOp, arg: Any = None) -> Any:
        """Run ``op`` on the engine (between steps: ``engine_loop.engine_call``) and return its result
        (or raise its exception): adapter management, co-served tuning."""
        fut: Future[Any] = Future()
        call_id = uuid.uuid4().hex
        with self._lock:
            self._calls[call_id] = fut
        self._send(EngineCall(call_id, op, arg))
        return await asyncio.wrap_future(fut)

    def _receive(self, msg: EngineOutput) -> None:
        """A message of the engine, on the thread that receives them."""
        if isinstance(msg, StepOutputs):
            self._stats = msg.stats
            self._deliver_many(msg.outputs)
        elif isinstance(msg, StatsUpdate):
            self._stats = msg.stats
        elif isinstance(msg, RequestRefused):  # the caller's 4xx
            self._deliver(msg.request_id, ValueError(msg.message))
        elif isinstance(msg, RequestErrored):  # the engine failed while running it
            self._deliver(msg.request_id, EngineError(msg.message))
        elif isinstance(msg, CallReply):
            self._stats = msg.stats  # before the caller resumes: it sees the change
            self._resolve(msg)

    def _resolve(self, reply: CallReply) -> None:
        with self._lock:
            fut = self._calls.pop(reply.call_id, None)
        if fut is not None:
            if reply.error is not None:
                fut.set_exception(reply.error)
            else:
                fut.set_result(reply.result)

    def _fail_calls(self, error: BaseException) -> None:
        with self._lock:
            pending, self._calls = self._calls, {}
        for fut in pending.values():
            fut.set_exception(error)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._sinks.get(rid)
        if target is not None:
            self._post(target[0], target[1].put_nowait, item)

    def _deliver_many(self, outputs: list[RequestOutput]) -> None:
        """One wake-up of each caller's event loop per engine step, not one per request (each
        wake-up is a write to the loop's self-pipe)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        with self._lock:
            for o in outputs:
                target = self._sinks.get(o.request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], o))
        for loop, items in batches.items():
            self._post(loop, _put_all, items)

    def _post(self, loop: asyncio.AbstractEventLoop, callback: Any, arg: Any) -> None:
        """Hand ``arg`` to the caller's loop. A loop that was closed has nobody reading its requests
        any more: they are aborted (their KV blocks freed) and the engine carries on."""
        try:
            loop.call_soon_threadsafe(callback, arg)
        except RuntimeError:
            with self._lock:
                dead = [rid for rid, (sink_loop, _) in self._sinks.items() if sink_loop is loop]
                for rid in dead:
                    del self._sinks[rid]
            if self._can_abort():
                for rid in dead:
                    self._send(AbortRequest(rid))

    def _waiting(self) -> list[str]:
        with self._lock:
            return list(self._sinks)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)
