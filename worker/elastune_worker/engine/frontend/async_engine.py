"""The engine on its own thread, for asyncio callers (the HTTP API).

One thread owns the ``LLMEngine`` and runs the engine loop (engine_loop.py) on it; the typed messages
(messages.py) reach it through a queue, outputs go back to each request's asyncio queue on the
caller's loop. Iterating a request yields its outputs until it finishes; leaving the iteration early
(the client went away, the task was cancelled) aborts it, which frees its KV blocks at once.
"""

from __future__ import annotations

import queue
import threading

from elastune_worker.engine.frontend.engine_loop import CallHandler, EngineLoop
from elastune_worker.engine.frontend.messages import EngineInput, Shutdown
from elastune_worker.engine.frontend.streams import RequestStreams
from elastune_worker.engine.llm_engine import LLMEngine
from elastune_worker.engine.profile import profile_costs


class AsyncEngine(RequestStreams):
    def __init__(self, engine: LLMEngine, calls: CallHandler | None = None) -> None:
        """``calls``: the engine calls beyond adapter management (engine_loop.CallHandler)."""
        super().__init__()
        self.engine = engine
        self.config = engine.config
        self.max_model_len, self.vocab_size = engine.max_model_len, engine.vocab_size
        self.tokenizer = engine.tokenizer
        self.cost = engine.cost = profile_costs(engine)
        self._inbox: queue.Queue[EngineInput] = queue.Queue()
        self._stats = engine.stats()
        # The loop's messages reach ``_receive`` on the engine thread itself: no copy, no hop.
        self._loop = EngineLoop(engine, self._next, self._receive, calls)
        self._thread = threading.Thread(target=self._loop.run, name="engine", daemon=True)
        self._thread.start()

    # -- caller side --------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.engine.encode(prompt)

    def close(self) -> None:
        self._send(Shutdown())
        self._thread.join(timeout=10)

    def _send(self, msg: EngineInput) -> None:
        self._inbox.put(msg)

    # -- engine thread ------------------------------------------------------------------------------
    def _next(self, block: bool) -> EngineInput | None:
        try:
            return self._inbox.get(block=block)
        except queue.Empty:
            return None
