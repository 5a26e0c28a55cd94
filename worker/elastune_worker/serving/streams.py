"""The caller side of an engine that runs elsewhere (a thread or a process): one asyncio queue per
request, filled from the engine's side, read by ``generate``; leaving ``generate`` early aborts."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncGenerator
from concurrent.futures import Future
from typing import Any

from elastune_worker.serving.engine import RequestFailed, RequestOutput
from elastune_worker.serving.sampling import SamplingParams

Command = tuple[str, Any]


class RequestStreams:
    """Subclasses send commands to their engine (``_send``) and call ``_deliver`` / ``_deliver_many``
    from the thread that receives the engine's outputs."""

    def __init__(self) -> None:
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._calls: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()

    def _send(self, cmd: Command) -> None:
        raise NotImplementedError

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
        lora: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already running")
            self._sinks[request_id] = (loop, sink)
        finished = False
        try:
            self._send(("add", (request_id, prompt, params, priority, extra_key, lora)))
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
                self._send(("abort", request_id))

    async def call(self, op: str, arg: Any) -> Any:
        """Run ``engine_call(engine, op, arg)`` on the engine's side (between steps) and return its result
        (or raise its exception): adapter management."""
        fut: Future[Any] = Future()
        token = uuid.uuid4().hex
        with self._lock:
            self._calls[token] = fut
        self._send(("call", (token, op, arg)))
        return await asyncio.wrap_future(fut)

    def _resolve(self, token: str, error: BaseException | None, result: Any) -> None:
        with self._lock:
            fut = self._calls.pop(token, None)
        if fut is not None:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

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
                    self._send(("abort", rid))

    def _waiting(self) -> list[str]:
        with self._lock:
            return list(self._sinks)


def engine_call(engine: Any, op: str, arg: Any) -> Any:
    """The engine-side half of ``RequestStreams.call`` (``engine`` is an ``LLMEngine``)."""
    if op == "load_lora":
        name, path = arg
        return engine.load_lora(name, path)
    if op == "unload_lora":
        return engine.unload_lora(arg)
    if op.startswith("coserve_"):
        return _coserve_call(engine, op, arg)
    raise ValueError(f"unknown engine call {op!r}")


def _coserve_call(engine: Any, op: str, arg: Any) -> Any:
    """A co-served tuning assignment (serving.coserve_task): start, poll, finish, stop."""
    from elastune_worker.serving.coserve_task import CoServeTask

    if op == "coserve_start":
        engine.coserve_task = CoServeTask(engine, arg)
        return engine.coserve_task.poll()
    task = engine.coserve_task
    if task is None:
        raise RuntimeError("no co-served job on this engine")
    if op == "coserve_poll":
        return task.poll()
    engine.coserve_task = None
    if op == "coserve_finish":
        return task.finish(arg)
    if op == "coserve_stop":
        task.stop()
        return None
    raise ValueError(f"unknown engine call {op!r}")


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)
