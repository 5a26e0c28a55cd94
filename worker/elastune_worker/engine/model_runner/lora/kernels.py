"""A batch's LoRA deltas over the device slots, with the two kernels multi-LoRA serving uses.

- ``padded`` (Punica): every adapter is read at the batch's max rank R. One-token rows (decodes) go
  through one batched gather-matmul (BGMV: cost ∝ decode rows × R); prefill chunks per adapter segment
  at R (SGMV). Cheap when ranks are alike, wasteful when one rank-64 adapter joins rank-8 ones.
- ``unpadded`` (S-LoRA's MBGMV): rows grouped per adapter, each at its own rank: cost ∝ Σ ranks.

Base-model rows (no adapter) get no delta with either kernel. On CUDA both run as Triton's segmented
launches by default (sgmv.py: two launches per target and layer instead of four per adapter), where
they differ in the rank each adapter is read at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from elastune_worker.engine.model_runner.lora import sgmv
from elastune_worker.engine.model_runner.lora.cpu_workers import CpuLoRAPool
from elastune_worker.engine.model_runner.lora.slots import DeviceLoRAs
from elastune_worker.engine.model_runner.lora.weights import LoRAWeights

LoraKernel = Literal["padded", "unpadded"]


def rows_by_slot(row_slots: list[int]) -> dict[int, list[int]]:
    """The batch rows of each device slot in use (rows of slot -1, no device adapter, left out)."""
    by_slot: dict[int, list[int]] = {}
    for row, s in enumerate(row_slots):
        if s >= 0:
            by_slot.setdefault(s, []).append(row)
    return by_slot


def segment_groups(
    by_slot: dict[int, list[int]], slot_ranks: list[int], kernel: LoraKernel
) -> list[tuple[int, list[int], int]]:
    """(slot, rows, rank read) of each adapter for the Triton launches: ``padded`` reads every adapter at
    the batch's max rank, ``unpadded`` at its own (eager steps and the graphs' tile table alike)."""
    top = max((slot_ranks[s] for s in by_slot), default=0)
    return [(s, rows, top if kernel == "padded" else slot_ranks[s]) for s, rows in by_slot.items()]


@dataclass
class LoRABatch:
    """Which rows of the step's flat token batch use which device slot."""

    slots: DeviceLoRAs
    kernel: LoraKernel
    groups: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)
    """(slot, row indices, rank) of every adapter in the batch, over all of its rows."""
    prefill_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(slot, row indices) of its rows in prefill chunks (padded kernel)."""
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    """One-token rows and their slots (padded kernel's BGMV)."""
    max_rank: int = 0
    host: list[tuple[LoRAWeights, torch.Tensor]] = field(default_factory=list)
    """CaraServe's CPU path: (host weights, rows) of adapters whose copy to the device is in flight."""
    cpu_pool: CpuLoRAPool | None = None
    """The CPU LoRA processes computing that path (None: this process computes it)."""
    tiles: sgmv.SegmentTiles | None = None
    """The Triton backend's tiles of the device rows (None: the torch loops above serve)."""

    @classmethod
    def build(
        cls,
        slots: DeviceLoRAs,
        kernel: LoraKernel,
        row_slots: list[int],
        one_token: list[bool],
        host: list[tuple[LoRAWeights, list[int]]] = (),  # type: ignore[assignment]
        cpu_pool: CpuLoRAPool | None = None,
        backend: sgmv.LoraBackend = "torch",
    ) -> LoRABatch | None:
        """``row_slots``: the device slot of each row (-1: none: base model, or an adapter on the CPU
        path); ``one_token``: whether a row is a one-token chunk (a decode); ``host``: rows whose delta
        comes from host weights; ``backend``: the device rows' launches (sgmv.py). None when no row
        uses an adapter."""
        dev = slots.device
        batch = cls(slots, kernel, cpu_pool=cpu_pool)
        batch.host = [(w, torch.tensor(rows, device=dev)) for w, rows in host if rows]
        if all(s < 0 for s in row_slots):
            return batch if batch.host else None
        by_slot = rows_by_slot(row_slots)
        batch.max_rank = max(slots.rank[s] for s in by_slot)
        if backend == "triton":
            batch.tiles = sgmv.build_tiles(segment_groups(by_slot, slots.rank, kernel), slots.max_rank, dev)
            return batch
        batch.groups = [(s, torch.tensor(rows, device=dev), slots.rank[s]) for s, rows in by_slot.items()]
        if kernel == "padded":
            dec = [(r, s) for r, s in enumerate(row_slots) if s >= 0 and one_token[r]]
            if dec:
                batch.decode_rows = torch.tensor([r for r, _ in dec], device=dev)
                batch.decode_slots = torch.tensor([s for _, s in dec], device=dev)
            pre: dict[int, list[int]] = {}
            for r, s in enumerate(row_slots):
                if s >= 0 and not one_token[r]:
                    pre.setdefault(s, []).append(r)
            batch.prefill_groups = [(s, torch.tensor(rows, device=dev)) for s, rows in pre.items()]
        return batch

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> None:
        """out[rows] += x[rows] @ Aᵀ @ (B·scaling)ᵀ for every adapter row of the batch (in place; ``out``
        may be a column slice of a fused projection's output)."""
        key = (layer, target)
        for w, rows in self.host:  # computed on the CPU from the host copy, added to the device output
            a_h, bt_h = w.a.get(key), w.b_t.get(key)
            if a_h is not None and bt_h is not None:
                xs = x.index_select(0, rows).to("cpu", torch.float32)
                delta = self.cpu_pool.delta(w, key, xs) if self.cpu_pool is not None else (xs @ a_h.T) @ bt_h
                out.index_add_(0, rows, delta.to(out.device, out.dtype))
        if self.max_rank == 0:
            return
        a_all, b_all = self.slots.a.get(key), self.slots.b.get(key)
        if a_all is None or b_all is None:
            return
        if self.tiles is not None:
            sgmv.add(out, x, a_all, b_all, self.tiles)
            return
        if self.kernel == "unpadded":
            for slot, rows, rank in self.groups:
                xs = x.index_select(0, rows)
                delta = (xs @ a_all[slot, :rank].T) @ b_all[slot, :rank]  # b_all: [slots, rank, out]
                out.index_add_(0, rows, delta)
            return
        r = self.max_rank
        if self.decode_rows is not None and self.decode_slots is not None:
            xs = x.index_select(0, self.decode_rows)  # (n, in)
            a = a_all[self.decode_slots, :r]  # (n, r, in): the gather of BGMV
            b = b_all[self.decode_slots, :r]  # (n, r, out)
            delta = torch.bmm(torch.bmm(a, xs.unsqueeze(-1)).transpose(1, 2), b).squeeze(1)
            out.index_add_(0, self.decode_rows, delta)
        for slot, rows in self.prefill_groups:
            xs = x.index_select(0, rows)
            delta = (xs @ a_all[slot, :r].T) @ b_all[slot, :r]
            out.index_add_(0, rows, delta)
