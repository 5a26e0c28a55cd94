"""The adapter tiers: host memory (max CPU adapters, LRU over registered adapters read from storage) and
the device (max adapters in fixed slots, LRU; an adapter that running requests use is never evicted).

Device slots are preallocated buffers per (layer, target): A of shape (slots, max rank, in) and
(B×scaling)ᵀ of shape (slots, max rank, out); an adapter of rank r fills the first r rows of its slot
in both and the rest stays zero, so the padded kernel can read any slot at the batch's max rank.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from elastune_worker.engine.model_runner.lora.copies import CopyTiming, DeviceCopies
from elastune_worker.engine.model_runner.lora.weights import AdapterError, LoRAWeights


@dataclass
class Registered:
    name: str
    path: str
    rank: int


class HostLoRAs:
    """Registered adapters (name → storage path) and an LRU of those read into host memory."""

    def __init__(self, max_cpu_loras: int, read: Callable[[str, str], LoRAWeights]) -> None:
        self.max_cpu_loras = max_cpu_loras
        self._read = read
        self.registered: dict[str, Registered] = {}
        self.cache: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.storage_loads = 0
        """Re-reads from storage of adapters evicted from host memory."""
        self.loads = 0
        """Reads from storage into host memory (registrations and re-reads)."""
        self.load_seconds = 0.0
        self.evictions = 0

    def register(self, name: str, path: str) -> LoRAWeights:
        """Reads and checks it now (a bad artifact is refused at registration, not at its first request)."""
        if name in self.registered and self.registered[name].path != path:
            raise AdapterError(f"adapter {name!r} is already loaded from {self.registered[name].path}")
        weights = self._timed_read(name, path)
        self.registered[name] = Registered(name, path, weights.rank)
        self._put(weights)
        return weights

    def unregister(self, name: str) -> None:
        self.registered.pop(name, None)
        self.cache.pop(name, None)

    def get(self, name: str) -> LoRAWeights:
        w = self.cache.get(name)
        if w is None:
            reg = self.registered.get(name)
            if reg is None:
                raise AdapterError(f"adapter {name!r} is not loaded")
            w = self._timed_read(name, reg.path)  # evicted from host memory: read again from storage
            self.storage_loads += 1
            self._put(w)
        else:
            self.cache.move_to_end(name)
        return w

    def _timed_read(self, name: str, path: str) -> LoRAWeights:
        started = time.perf_counter()
        w = self._read(name, path)
        self.loads += 1
        self.load_seconds += time.perf_counter() - started
        return w

    def _put(self, w: LoRAWeights) -> None:
        self.cache[w.name] = w
        self.cache.move_to_end(w.name)
        while len(self.cache) > self.max_cpu_loras:
            self.cache.popitem(last=False)
            self.evictions += 1


class DeviceLoRAs:
    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        shapes: dict[str, tuple[int, int]],
        num_layers: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.shapes, self.num_layers = shapes, num_layers
        self.device, self.dtype = device, dtype
        self.a = {
            (layer, t): torch.zeros(max_loras, max_rank, fan_in, device=device, dtype=dtype)
            for layer in range(num_layers)
            for t, (fan_in, _) in shapes.items()
        }
        # B transposed, [slots, rank, out] (peft's B is [out, rank]; the host keeps it so too,
        # LoRAWeights.b_t): a slot's first r ranks are one contiguous run, and all slots' B is one
        # [slots x rank, out] matrix without a copy (the graph path multiplies every slot at once,
        # cuda_graphs.GraphLoRA).
        self.b = {
            (layer, t): torch.zeros(max_loras, max_rank, fan_out, device=device, dtype=dtype)
            for layer in range(num_layers)
            for t, (_, fan_out) in shapes.items()
        }
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        """Resident adapters by LRU order (least recent first) → slot."""
        self.copies: CopyTiming = DeviceCopies()
        """Which copies are in flight: the real ones (benchmarks on a CPU inject an EMULATION)."""
        self._stream: Any = None
        self.wait_seconds = 0.0
        """Time steps spent waiting for copies (on-demand loading)."""
        self.rank = [0] * max_loras
        self._written = [0] * max_loras
        """Rows of each slot that may be non-zero (the largest rank written since they were zeroed)."""
        self.loads = 0
        """Copies host → device."""
        self.load_seconds = 0.0
        self.evictions = 0
        """Resident adapters pushed out of their slot by another (LRU)."""

    def free_slots(self) -> list[int]:
        used = set(self.slot_of.values())
        return [s for s in range(self.max_loras) if s not in used]

    def loading(self) -> set[str]:
        """Adapters whose copy is still in flight."""
        return self.copies.in_flight()

    def wait_copies(self, names: set[str]) -> None:
        """Block until the copies of ``names`` are done (on-demand loading), counted in wait_seconds."""
        started = time.perf_counter()
        self.copies.wait(names)
        self.wait_seconds += time.perf_counter() - started

    def _copy_stream(self) -> Any:
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def can_place(self, busy: set[str]) -> bool:
        return bool(self.free_slots()) or any(n not in busy for n in self.slot_of)

    def activate(self, names: Iterable[str], host: HostLoRAs, busy: set[str]) -> dict[str, int]:
        """Slots of ``names`` (all resident after the call; a new one may still be in flight, see
        ``loading``). Loading one evicts the least recently used resident adapter outside ``names`` and
        ``busy`` (adapters of running requests)."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise AdapterError(f"{len(wanted)} adapters in one batch, the device holds {self.max_loras}")
        for name in wanted:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            free = self.free_slots()
            if free:
                slot = free[0]
            else:
                keep = set(wanted) | busy
                victim = next((n for n in self.slot_of if n not in keep), None)
                if victim is None:
                    raise AdapterError("every device adapter slot is in use by running requests")
                slot = self.slot_of.pop(victim)
                self.copies.forget(victim)
                self.evictions += 1
            w = host.get(name)
            self._copy_in(slot, w)
            self.slot_of[name] = slot
        return {n: self.slot_of[n] for n in wanted}

    def evict(self, name: str) -> None:
        self.copies.forget(name)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.rank[slot] = 0

    def _copy_in(self, slot: int, w: LoRAWeights) -> None:
        """Host → device. On CUDA the copy runs on a side stream from pinned memory (LoRAWeights.staging)
        and the adapter counts as loading until its event completes (CaraServe's window for the CPU
        path); on CPU it is a memory copy, done when it returns (an injected EmulatedCopies gives it a
        GPU's copy time). Only the rows a larger previous adapter left past this rank are zeroed: the
        padded kernel reads every slot at the batch's max rank, so they must be zeros."""
        started = time.perf_counter()
        stream = self._copy_stream()
        on_cuda = stream is not None
        sources = w.staging(self.dtype) if on_cuda else {k: (w.a[k], w.b_t[k]) for k in w.a}
        stale = self._written[slot] > w.rank
        with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
            for key, a in self.a.items():
                b = self.b[key]
                src = sources.get(key)
                if src is None:  # a target this adapter does not have: its whole slot must read zero
                    if self._written[slot]:
                        a[slot, : self._written[slot]].zero_()
                        b[slot, : self._written[slot]].zero_()
                    continue
                if stale:
                    a[slot, w.rank : self._written[slot]].zero_()
                    b[slot, w.rank : self._written[slot]].zero_()
                a[slot, : w.rank].copy_(src[0], non_blocking=on_cuda)
                b[slot, : w.rank].copy_(src[1], non_blocking=on_cuda)
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record(stream)
        self.copies.started(w.name, w.rank, event)
        self.rank[slot] = w.rank
        self._written[slot] = w.rank
        self.loads += 1
        self.load_seconds += time.perf_counter() - started
