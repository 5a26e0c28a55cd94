"""CaraServe's CPU LoRA processes (§4.2): while an adapter is copied to the device, its requests' LoRA
deltas are computed by separate CPU processes from the host copy.

- Shared memory: the engine writes a layer's input rows into one shared buffer and the workers write
  their deltas into another — no serialisation of activations; adapter weights are shared tensors too,
  handed to every worker once when the adapter first runs on the CPU path.
- Layer-wise synchronisation: each call (one target of one layer) signals the workers over pipes and
  waits for every slice to be done before the layer goes on.
- Profiling-guided parallelisation: a call's rows are split over as many workers as the rows need at
  ``rows_per_worker`` each (the most one core handles within its budget), up to the pool's size.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing.connection
import os
from typing import Any

import torch
import torch.multiprocessing as tmp

from elastune_worker.engine.model_runner.cpu_binding import unbound_cpus
from elastune_worker.engine.model_runner.lora.weights import LoRAWeights


def _worker(conn: multiprocessing.connection.Connection, x: torch.Tensor, y: torch.Tensor) -> None:
    torch.set_num_threads(1)  # one core per process (CaraServe pins one process per core)
    adapters: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "add":
            _, name, weights = msg
            adapters[name] = weights
            conn.send(("ok",))
        elif kind == "drop":
            adapters.pop(msg[1], None)
        elif kind == "run":
            _, name, key, start, end, fan_in, fan_out = msg
            a, b_t = adapters[name][key]
            with torch.inference_mode():
                y[start:end, :fan_out] = (x[start:end, :fan_in] @ a.T) @ b_t
            conn.send(("done",))


class CpuLoRAPool:
    def __init__(self, workers: int, max_rows: int, max_dim: int, rows_per_worker: int = 64) -> None:
        if workers < 1:
            raise ValueError("a CPU LoRA pool needs at least one worker")
        self.rows_per_worker = rows_per_worker
        self.x = torch.zeros(max_rows, max_dim).share_memory_()
        self.y = torch.zeros(max_rows, max_dim).share_memory_()
        ctx = tmp.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[Any] = []
        for i in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(child, self.x, self.y), name=f"lora-cpu-{i}", daemon=True
            )
            proc.start()
            if proc.pid is not None and hasattr(os, "sched_setaffinity"):  # not on a bound engine's CPUs
                os.sched_setaffinity(proc.pid, unbound_cpus())
            self._conns.append(parent)
            self._procs.append(proc)
        self._known: set[str] = set()
        self.calls = 0

    def ensure(self, w: LoRAWeights) -> None:
        """Hand the adapter's host weights to every worker once (shared memory, not copies)."""
        if w.name in self._known:
            return
        shared = {k: (w.a[k].share_memory_(), w.b_t[k].share_memory_()) for k in w.a}
        for conn in self._conns:
            conn.send(("add", w.name, shared))
        for conn in self._conns:
            conn.recv()
        self._known.add(w.name)

    def forget(self, name: str) -> None:
        if name in self._known:
            for conn in self._conns:
                conn.send(("drop", name))
            self._known.discard(name)

    def delta(self, w: LoRAWeights, key: tuple[int, str], xs: torch.Tensor) -> torch.Tensor:
        """xs @ Aᵀ @ (B·scaling)ᵀ for ``xs`` (rows × in) on the CPU workers; waits for all slices."""
        self.ensure(w)
        n, fan_in = xs.shape
        fan_out = w.b_t[key].shape[1]
        if n > self.x.shape[0] or max(fan_in, fan_out) > self.x.shape[1]:
            raise ValueError(f"{n} rows of width {fan_in}->{fan_out} exceed the shared buffers")
        self.x[:n, :fan_in].copy_(xs)
        parts = min(len(self._conns), max(1, math.ceil(n / self.rows_per_worker)))
        step = math.ceil(n / parts)
        busy = []
        for i, conn in enumerate(self._conns[:parts]):
            start, end = i * step, min(n, (i + 1) * step)
            if start < end:
                conn.send(("run", w.name, key, start, end, fan_in, fan_out))
                busy.append(conn)
        for conn in busy:
            conn.recv()
        self.calls += 1
        return self.y[:n, :fan_out].clone()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
