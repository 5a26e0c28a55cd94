"""The engine in its own process, as vLLM runs its EngineCore: the HTTP server's Python (parsing,
SSE chunks, sockets) and the engine's Python (scheduling, batching, detokenizing) then run in parallel
instead of taking turns on one interpreter lock.

The parent keeps the same interface as ``AsyncEngine`` (``generate`` yields ``RequestOutput``s; leaving
early aborts). Commands go to the child over one pipe; after every step the child sends the step's
outputs and its stats back over another, read by a thread of the parent that hands each output to
its request's asyncio queue.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from elastune_worker.serving.config import EngineConfig
from elastune_worker.serving.cpu_binding import bind_process
from elastune_worker.serving.engine import EngineStats, LLMEngine
from elastune_worker.serving.model_runner import pick_device
from elastune_worker.serving.profile import profile_costs
from elastune_worker.serving.streams import Command, RequestStreams, engine_call

log = logging.getLogger("elastune.serving")


class EngineError(RuntimeError):
    """The engine process failed or is gone."""


def _child(
    path: str,
    config: EngineConfig,
    threads: int | None,
    cpus: tuple[int, ...] | None,
    commands: Connection,
    results: Connection,
) -> None:
    import torch

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
        results.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    ready = (engine.max_model_len, engine.vocab_size, cost, cpus if bound else None, torch.get_num_threads())
    results.send(("ready", ready))
    # The stats before any request (adapter slots, KV capacity): the registry record and the control
    # plane's placement read them before the first request arrives.
    results.send(("stats", engine.stats()))
    fresh = True  # the parent's stats reflect the engine's state
    while True:
        idle = not engine.has_work()
        if idle and not fresh:  # about to block: the last aborts/finishes must show in the metrics
            results.send(("stats", engine.stats()))
            fresh = True
        if idle or commands.poll(0):
            fresh = False
            try:
                kind, arg = commands.recv()
            except EOFError:
                return
            if kind == "stop":
                return
            if kind == "add":
                rid, prompt, params, priority, extra_key, lora = arg
                try:
                    engine.add_request(rid, prompt, params, priority=priority, extra_key=extra_key, lora=lora)
                except Exception as exc:
                    results.send(("error", (rid, f"{exc}")))
            elif kind == "abort":
                engine.abort(arg)
            elif kind == "call":
                token, op, call_arg = arg
                try:
                    result, error = engine_call(engine, op, call_arg), None
                except Exception as exc:
                    result, error = None, exc
                # The stats travel with the reply: the caller sees the change once its call returns.
                results.send(("reply", (token, error, result, engine.stats())))
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
    ) -> None:
        """``threads``: torch threads of the engine (default: one per bound CPU, else torch's);
        ``cpus``: bind the engine process there when it runs on the CPU (cpu_binding.py)."""
        super().__init__()
        self.config = config
        ctx = mp.get_context("spawn")  # no fork of a process holding threads and torch state
        child_commands, self._commands = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self._results, child_results = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_child,
            args=(str(model_path), config, threads, cpus, child_commands, child_results),
            name="elastune-engine",
            daemon=True,
        )
        self.proc.start()
        kind, arg = self._results.recv()
        if kind != "ready":
            raise EngineError(f"the engine process failed to start: {arg}")
        self.max_model_len, self.vocab_size, self.cost, self.engine_cpus, self.engine_threads = arg
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.tokenizer = tokenizer
        self._stats = EngineStats()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="engine-results", daemon=True)
        self._reader.start()

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def stats(self) -> EngineStats:
        return self._stats

    def _send(self, cmd: Command) -> None:
        with self._send_lock:
            self._commands.send(cmd)

    def _can_abort(self) -> bool:
        return self.proc.is_alive()

    def _read(self) -> None:
        while True:
            try:
                kind, arg = self._results.recv()
            except (EOFError, OSError):
                break
            if kind == "step":
                outputs, self._stats = arg
                self._deliver_many(outputs)
            elif kind == "stats":
                self._stats = arg
            elif kind == "error":  # the request was refused (bad input): the caller's 4xx
                rid, message = arg
                self._deliver(rid, ValueError(message))
            elif kind == "failed":  # the engine failed while running it
                rid, message = arg
                self._deliver(rid, EngineError(message))
            elif kind == "reply":
                token, error, result, self._stats = arg
                self._resolve(token, error, result)
        self._fail_calls(EngineError("the engine process exited"))
        for rid in self._waiting():  # the engine process died: nobody waits forever
            self._deliver(rid, EngineError("the engine process exited"))

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self._send(("stop", None))
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
