"""The engine on its own thread, for asyncio callers (the HTTP API).

One thread owns the ``LLMEngine`` and runs the engine loop (engine_loop.py) on it; the typed messages
(messages.py) reach it through a queue, outputs go back to each request's asyncio queue on the
caller's loop. Iterating a request yields its outputs until it finishes; leaving the iteration early
(the client went away, the task was cancelled) aborts it, which frees its KV blocks at once.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from elastune_worker.serving.core.engine import LLMEngine
from elastune_worker.serving.core.profile import profile_costs
from elastune_worker.serving.frontend.engine_loop import EngineLoop
from elastune_worker.serving.frontend.messages import EngineInput, Shutdown
from elastune_worker.serving.frontend.streams import RequestStreams


class AsyncEngine(RequestStreams):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self.config = engine.config
        self.cost = engine.cost = profile_costs(engine)
        self._inbox: queue.Queue[EngineInput] = queue.Queue()
        self._stats = engine.stats()
        # The loop's messages reach ``_receive`` on the engine thread itself: no copy, no hop.
        self._loop = EngineLoop(engine, self._next, self._receive)
        self._thread = threading.Thread(target=self._loop.run, name="engine", daemon=True)
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
