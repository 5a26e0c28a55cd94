"""The engine in its own process, as vLLM runs its EngineCore: the HTTP server's Python (parsing,
SSE chunks, sockets) and the engine's Python (scheduling, batching, detokenizing) then run in parallel
instead of taking turns on one interpreter lock.

The parent keeps the same interface as ``AsyncEngine`` (``generate`` yields ``RequestOutput``s; leaving
early aborts). The child runs the same engine loop (engine_loop.py); the typed messages (messages.py)
go to it over one pipe and come back over another (after every step: the step's outputs and its
stats), read by a thread of the parent that hands each output to its request's asyncio queue.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from elastune_worker.engine.core.config import EngineConfig
from elastune_worker.engine.frontend.engine_loop import CallHandler, EngineLoop
from elastune_worker.engine.frontend.messages import (
    EngineInput,
    EngineOutput,
    EngineReady,
    EngineStartFailed,
    Shutdown,
)
from elastune_worker.engine.frontend.streams import EngineError, RequestStreams
from elastune_worker.engine.llm_engine import EngineStats, LLMEngine
from elastune_worker.engine.model_runner.cpu_binding import bind_process
from elastune_worker.engine.model_runner.runner import pick_device
from elastune_worker.engine.profile import profile_costs

__all__ = ["EngineError", "ProcessEngine"]


def _child(
    path: str,
    config: EngineConfig,
    threads: int | None,
    cpus: tuple[int, ...] | None,
    calls: CallHandler | None,
    commands: Connection,
    results: Connection,
) -> None:
    import os

    import torch

    # The parent decides when the engine stops (after a drain: server/drain.py), so the engine leaves
    # the parent's process group: a signal sent to the whole group (Ctrl-C, a supervisor stopping the
    # worker) reaches the parent only, which drains first. The parent's own terminate()/kill() still
    # reach it, and it exits when the parent goes (EOF on the command pipe).
    os.setsid()
    try:
        # Bound before torch's first parallel kernel, so its OpenMP threads start on these CPUs.
        bound = cpus is not None and pick_device(config.device).type == "cpu" and bind_process(cpus)
        if bound and not threads and cpus:
            threads = len(cpus)  # one torch thread per bound CPU
        if threads:
            torch.set_num_threads(threads)
        engine = LLMEngine(Path(path), config)
        cost = engine.cost = profile_costs(engine)
    except Exception as exc:
        results.send(EngineStartFailed(f"{type(exc).__name__}: {exc}"))
        return
    threads = torch.get_num_threads()
    results.send(EngineReady(engine.max_model_len, engine.vocab_size, cost, cpus if bound else None, threads))

    def receive(block: bool) -> EngineInput | None:
        if not block and not commands.poll(0):
            return None
        try:
            msg: EngineInput = commands.recv()
        except EOFError:  # the parent is gone
            return Shutdown()
        return msg

    # Idle at first: the loop sends the stats before any request (adapter slots, KV capacity), which
    # the registry record and the control plane's placement read before the first request arrives.
    EngineLoop(engine, receive, results.send, calls).run()


class ProcessEngine(RequestStreams):
    """``AsyncEngine``'s interface over an engine process."""

    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig,
        *,
        tokenizer: Any = None,
        threads: int | None = None,
        cpus: tuple[int, ...] | None = None,
        calls: CallHandler | None = None,
    ) -> None:
        """``threads``: torch threads of the engine (default: one per bound CPU, else torch's);
        ``cpus``: bind the engine process there when it runs on the CPU (model_runner/cpu_binding.py);
        ``calls``: the engine calls beyond adapter management (engine_loop.CallHandler; it must pickle:
        the engine process gets a copy)."""
        super().__init__()
        self.config = config
        ctx = mp.get_context("spawn")  # no fork of a process holding threads and torch state
        child_commands, self._commands = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self._results, child_results = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_child,
            args=(str(model_path), config, threads, cpus, calls, child_commands, child_results),
            name="elastune-engine",
            daemon=True,
        )
        self.proc.start()
        ready: EngineReady | EngineStartFailed = self._results.recv()
        if isinstance(ready, EngineStartFailed):
            raise EngineError(f"the engine process failed to start: {ready.message}")
        self.max_model_len, self.vocab_size, self.cost = ready.max_model_len, ready.vocab_size, ready.cost
        self.engine_cpus, self.engine_threads = ready.cpus, ready.threads
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.tokenizer = tokenizer
        self._stats = EngineStats()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
        self._reader.start()

    def _send(self, msg: EngineInput) -> None:
        with self._send_lock:
            self._commands.send(msg)

    def _can_abort(self) -> bool:
        return self.proc.is_alive()

    def _read(self) -> None:
        while True:
            try:
                msg: EngineOutput = self._results.recv()
            except (EOFError, OSError):
                break
            self._receive(msg)
        self._fail_calls(EngineError("the engine process exited"))
        for rid in self._waiting():  # the engine process died: nobody waits forever
            self._deliver(rid, EngineError("the engine process exited"))

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self._send(Shutdown())
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
