"""The engine on its own thread, for asyncio callers (the HTTP API).

One thread owns the ``LLMEngine`` and steps it while there is work; requests and aborts reach it
through a queue, outputs go back to each request's asyncio queue on the caller's loop. Iterating a
request yields its outputs until it finishes; leaving the iteration early (the client went away, the
task was cancelled) aborts it, which frees its KV blocks at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from elastune_worker.serving.engine import EngineStats, LLMEngine
from elastune_worker.serving.profile import profile_costs
from elastune_worker.serving.streams import Command, RequestStreams, engine_call

log = logging.getLogger("elastune.serving")


class AsyncEngine(RequestStreams):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self.config = engine.config
        self.cost = engine.cost = profile_costs(engine)
        self._commands: queue.Queue[Command] = queue.Queue()
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

    def stats(self) -> EngineStats:
        return self._stats

    def close(self) -> None:
        self._stop.set()
        self._commands.put(("noop", None))
        self._thread.join(timeout=10)

    # -- engine thread ------------------------------------------------------------------------------
    def _send(self, cmd: Command) -> None:
        self._commands.put(cmd)

    def _apply(self, cmd: Command) -> None:
        kind, arg = cmd
        if kind == "add":
            rid, prompt, params, priority, extra_key, lora = arg
            try:
                self.engine.add_request(
                    rid, prompt, params, priority=priority, extra_key=extra_key, lora=lora
                )
            except Exception as exc:  # bad input is the caller's: hand the error back
                self._deliver(rid, exc)
        elif kind == "abort":
            self.engine.abort(arg)
        elif kind == "call":
            token, op, call_arg = arg
            try:
                result, error = engine_call(self.engine, op, call_arg), None
            except Exception as exc:
                result, error = None, exc
            self._stats = self.engine.stats()  # before the caller resumes: it sees the change
            self._resolve(token, error, result)

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            block = not eng.has_work()
            try:
                cmd = self._commands.get(block=block, timeout=None if block else 0)
                self._apply(cmd)
                while True:  # everything else that arrived meanwhile
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not eng.has_work():
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
            self._deliver_many(outputs)
            self._stats = eng.stats()
