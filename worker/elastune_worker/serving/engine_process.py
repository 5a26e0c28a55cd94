"""The engine in its own process, as vLLM runs its EngineCore: the HTTP server's Python (parsing,
SSE chunks, sockets) and the engine's Python (scheduling, batching, detokenizing) then run in parallel
instead of taking turns on one interpreter lock.

The parent keeps the same interface as ``AsyncEngine`` (``generate`` yields ``RequestOutput``s; leaving
early aborts). Commands go to the child over one pipe; after every step the child sends the step's
outputs and its stats back over another, read by a thread of the parent that hands each output to
its request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
from collections.abc import AsyncGenerator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from elastune_worker.serving.config import EngineConfig
from elastune_worker.serving.engine import EngineStats, LLMEngine, RequestOutput
from elastune_worker.serving.sampling import SamplingParams

log = logging.getLogger("elastune.serving")


class EngineError(RuntimeError):
    """The engine process failed or is gone."""


def _child(
    path: str, config: EngineConfig, threads: int | None, commands: Connection, results: Connection
) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    try:
        engine = LLMEngine(Path(path), config)
    except Exception as exc:
        results.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    results.send(("ready", (engine.max_model_len, engine.vocab_size)))
    while True:
        if not engine.has_unfinished() or commands.poll(0):
            try:
                kind, arg = commands.recv()
            except EOFError:
                return
            if kind == "stop":
                return
            if kind == "add":
                rid, prompt, params, priority, extra_key = arg
                try:
                    engine.add_request(rid, prompt, params, priority=priority, extra_key=extra_key)
                except Exception as exc:
                    results.send(("error", (rid, f"{exc}")))
            elif kind == "abort":
                engine.abort(arg)
            continue  # drain every pending command before the next step
        try:
            outputs = engine.step()
        except Exception as exc:  # a bug in a step: fail the requests in flight, keep serving
            log.exception("engine step failed")
            for rid in list(engine.scheduler.requests):
                engine.abort(rid)
                results.send(("failed", (rid, f"engine step failed: {type(exc).__name__}: {exc}")))
            continue
        results.send(("step", (outputs, engine.stats())))


class ProcessEngine:
    """``AsyncEngine``'s interface over an engine process."""

    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig,
        *,
        tokenizer: Any = None,
        threads: int | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process holding threads and torch state
        child_commands, self._commands = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self._results, child_results = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_child,
            args=(str(model_path), config, threads, child_commands, child_results),
            name="elastune-engine",
            daemon=True,
        )
        self.proc.start()
        kind, arg = self._results.recv()
        if kind != "ready":
            raise EngineError(f"the engine process failed to start: {arg}")
        self.max_model_len, self.vocab_size = arg
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.tokenizer = tokenizer
        self._stats = EngineStats()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
        self._reader.start()

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def stats(self) -> EngineStats:
        return self._stats

    def _send(self, msg: tuple[str, Any]) -> None:
        with self._send_lock:
            self._commands.send(msg)

    async def generate(
        self,
        request_id: str,
        prompt: list[int] | str,
        params: SamplingParams,
        *,
        priority: int = 0,
        extra_key: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        if not self.proc.is_alive():
            raise EngineError("the engine process is gone")
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already running")
            self._sinks[request_id] = (loop, sink)
        self._send(("add", (request_id, prompt, params, priority, extra_key)))
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
            if not finished and self.proc.is_alive():
                self._send(("abort", request_id))

    def _deliver(self, rid: str, item: Any) -> None:
        with self._lock:
            target = self._sinks.get(rid)
        if target is not None:
            loop, sink = target
            loop.call_soon_threadsafe(sink.put_nowait, item)

    def _read(self) -> None:
        while True:
            try:
                kind, arg = self._results.recv()
            except (EOFError, OSError):
                break
            if kind == "step":
                outputs, self._stats = arg
                for o in outputs:
                    self._deliver(o.request_id, o)
            elif kind == "error":  # the request was refused (bad input): the caller's 4xx
                rid, message = arg
                self._deliver(rid, ValueError(message))
            elif kind == "failed":  # the engine failed while running it
                rid, message = arg
                self._deliver(rid, EngineError(message))
        with self._lock:  # the engine process died: nobody waits forever
            sinks = list(self._sinks)
        for rid in sinks:
            self._deliver(rid, EngineError("the engine process exited"))

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self._send(("stop", None))
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
