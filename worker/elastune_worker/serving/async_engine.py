"""The engine on its own thread, for asyncio callers (the HTTP API).

One thread owns the ``LLMEngine`` and steps it while there is work; requests and aborts reach it
through a queue, outputs go back to each request's asyncio queue on the caller's loop. Iterating a
request yields its outputs until it finishes; leaving the iteration early (the client went away, the
task was cancelled) aborts it, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from typing import Any

from elastune_worker.serving.engine import EngineStats, LLMEngine, RequestOutput
from elastune_worker.serving.sampling import SamplingParams

log = logging.getLogger("elastune.serving")

_Command = tuple[str, Any]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._sinks: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._lock = threading.Lock()
        self._stats = engine.stats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # -- caller side --------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def encode(self, prompt: str) -> list[int]:
        return self.engine.encode(prompt)

    async def generate(
        self,
        request_id: str,
        prompt: list[int] | str,
        params: SamplingParams,
        *,
        priority: int = 0,
        extra_key: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already running")
            self._sinks[request_id] = (loop, sink)
        self._commands.put(("add", (request_id, prompt, params, priority, extra_key)))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._sinks.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def close(self) -> None:
        self._stop.set()
        self._commands.put(("noop", None))
        self._thread.join(timeout=10)

    # -- engine thread ------------------------------------------------------------------------------
    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._sinks.get(rid)
        if target is not None:
            loop, sink = target
            loop.call_soon_threadsafe(sink.put_nowait, item)

    def _apply(self, cmd: _Command) -> None:
        kind, arg = cmd
        if kind == "add":
            rid, prompt, params, priority, extra_key = arg
            try:
                self.engine.add_request(rid, prompt, params, priority=priority, extra_key=extra_key)
            except Exception as exc:  # bad input is the caller's: hand the error back
                self._deliver(rid, exc)
        elif kind == "abort":
            self.engine.abort(arg)

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            block = not eng.has_unfinished()
            try:
                cmd = self._commands.get(block=block, timeout=None if block else 0)
                self._apply(cmd)
                while True:  # everything else that arrived meanwhile
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not eng.has_unfinished():
                self._stats = eng.stats()
                continue
            try:
                outputs = eng.step()
            except Exception as exc:  # a bug in a step: fail the requests in flight, keep serving
                log.exception("engine step failed")
                for rid in list(eng.scheduler.requests):
                    eng.abort(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}"))
                continue
            for o in outputs:
                self._deliver(o.request_id, o)
            self._stats = eng.stats()
