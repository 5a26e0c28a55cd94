"""Decode steps replayed from CUDA graphs: one graph per batch size of a ladder, captured at start-up
over static input buffers; a step of n decodes is padded to the smallest captured size >= n (padding
rows have context 0: they attend to nothing and write their K/V to a scratch slot no sequence owns).

A decode step launches hundreds of small kernels from Python; a replay launches them all at once, so
small batches are no longer bound by the CPU. The graph's attention is the Triton kernel that reads the
cache in place (triton_attention.py): its shapes depend on the batch size only, where the gather path's
depend on the contexts' lengths. Multi-LoRA decode runs inside the graph too: with the Triton LoRA
backend, the segmented kernels over a tile table of fixed length that each replay refills (GraphTiles:
only the step's adapters are read, each once, at its own rank or the batch's); with the torch backend,
GraphLoRA: every device slot's adapter over every row, masked per row (two matmuls per target; at 8B
with 8 slots of rank 64 on 7 targets that read 2.7 GB a step, a sixth of the weights, even for a batch
without adapters).

What a graph cannot replay (prefill chunks, mixed steps, soft-prompt embeddings, LoRA deltas computed on
the CPU, batches above the ladder) runs eager, and so does every step after any capture error: the
error is logged once and serving goes on without graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from elastune_worker.engine.model_runner.attention import AttentionMetadata
from elastune_worker.engine.model_runner.lora import sgmv
from elastune_worker.engine.model_runner.lora.kernels import (
    LoRABatch,
    LoraKernel,
    rows_by_slot,
    segment_groups,
)
from elastune_worker.engine.model_runner.lora.slots import DeviceLoRAs
from elastune_worker.engine.model_runner.triton_attention import PagedTiles

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, AttentionMetadata, LoRABatch | None], torch.Tensor]
"""The model over the KV cache: (tokens, metadata, LoRA) -> logits of ``metadata.logits_index``."""


def batch_ladder(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``max_batch`` (and ``max_batch`` itself):
    padding wastes at most 7 rows past 8, and a few dozen graphs share one memory pool."""
    ladder = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8))
    return [*ladder, max_batch]


def padded_batch(ladder: list[int], n: int) -> int | None:
    """The captured size a batch of ``n`` decodes replays at (None: larger than every graph)."""
    return next((b for b in ladder if b >= n), None)


@dataclass
class DecodeInputs:
    """One decode step on the host, padded to a captured batch size."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    lora_slots: list[int]
    """Device LoRA slot of each row (-1: none)."""


class GraphLoRA(LoRABatch):
    """LoRA deltas for a graph: each row's adapter picked by masking the columns of every slot's
    x·Aᵀ that are not its slot's, so the shapes depend on the batch size only. Exact selection (masked
    entries are zeros, not products with zero), and each adapter is read at the slots' full rank: the
    zero-padded ranks add zeros."""

    def __init__(self, slots: DeviceLoRAs, row_slots: torch.Tensor) -> None:
        super().__init__(slots, "padded")
        n_slots, rank = _slot_shape(slots)
        column_slot = torch.arange(n_slots * rank, device=row_slots.device) // rank
        self.column_mask = column_slot[None, :] == row_slots[:, None]  # [B, slots x rank]
        self.max_rank = rank

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> None:
        key = (layer, target)
        a_all, b_all = self.slots.a.get(key), self.slots.b.get(key)
        if a_all is None or b_all is None:
            return
        n_slots, rank, d_in = a_all.shape
        xa = x @ a_all.reshape(n_slots * rank, d_in).T  # [B, slots x rank]
        xa = torch.where(self.column_mask, xa, torch.zeros((), dtype=xa.dtype, device=xa.device))
        out.add_(xa @ b_all.view(n_slots * rank, -1))  # B is stored [slots, rank, out]: a view, no copy


class GraphTiles:
    """The Triton LoRA kernels' tile table for graphs: one static int32 buffer (row entries for the
    largest batch, then the tile columns at their most tiles), captured with every tile a padding tile
    and refilled before each replay from the step's rows' slots."""

    def __init__(self, slots: DeviceLoRAs, kernel: LoraKernel, max_batch: int) -> None:
        self.slots, self.kernel = slots, kernel
        self.rows_cap = sgmv.aligned_rows(max_batch)
        self.tiles_cap = sgmv.max_tiles(max_batch, slots.max_loras)
        self.table = torch.zeros(self.rows_cap + 4 * self.tiles_cap, dtype=torch.int32, device=slots.device)
        self.batch = LoRABatch(slots, kernel, max_rank=slots.max_rank)
        self.batch.tiles = sgmv.SegmentTiles(
            self.table[: self.rows_cap],
            self.table[self.rows_cap :],
            self.tiles_cap,
            sgmv.block_rank(slots.max_rank),
        )

    def fill(self, row_slots: list[int]) -> None:
        """The step's tiles (padded: every adapter at the batch's max rank; unpadded: its own)."""
        groups = segment_groups(rows_by_slot(row_slots), self.slots.rank, self.kernel)
        flat = sgmv.tile_table(groups, self.rows_cap, self.tiles_cap)
        self.table.copy_(torch.from_numpy(flat), non_blocking=True)


def _slot_shape(slots: DeviceLoRAs) -> tuple[int, int]:
    a = next(iter(slots.a.values()))
    return int(a.shape[0]), int(a.shape[1])


class DecodeGraphs:
    """The captured graphs and their static inputs. ``replay`` is valid after ``capture`` returned True."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        page_size: int,
        scratch_slot: int,
        device: torch.device,
        lora: DeviceLoRAs | None = None,
        lora_segments: LoraKernel | None = None,
    ) -> None:
        """``lora``: the device slots decodes may read; ``lora_segments``: replay them through the Triton
        LoRA kernels with this kernel's ranks (None: GraphLoRA, the torch ops)."""
        self.ladder = batch_ladder(max_batch)
        self.page_size = page_size
        self.scratch_slot = scratch_slot
        self.device = device
        self.lora = lora
        m = self.ladder[-1]

        def buf(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens = buf(m, dtype=torch.int64)
        self.positions = buf(m, dtype=torch.int64)
        self.slot_mapping = buf(m, dtype=torch.int64)
        self.context_lens = buf(m)
        self.block_tables = buf(m, max_blocks)
        self.lora_slots = buf(m, dtype=torch.int64)
        self.lora_tiles = GraphTiles(lora, lora_segments, m) if lora is not None and lora_segments else None
        # Constant inputs are buffers too: a graph reads its inputs' addresses, so none may be a
        # temporary that is freed (and its memory reused) after the capture.
        self.rows = torch.arange(m, dtype=torch.int32, device=device)
        self.rows64 = torch.arange(m, dtype=torch.int64, device=device)
        self.ones = torch.ones(m, dtype=torch.int32, device=device)
        self.zeros = buf(m)
        self.graphs: dict[int, Callable[[], None]] = {}
        """The replay of each captured batch size."""
        self.logits: torch.Tensor | None = None
        """[largest batch, vocab]: every graph writes its logits here (one buffer, not one per graph)."""
        self.enabled = False

    def metadata(self, batch: int) -> AttentionMetadata:
        """The decode step of ``batch`` rows over the static buffers (the captured graphs read these)."""
        tiles = PagedTiles(
            q_row=self.rows[:batch],
            q_len=self.ones[:batch],
            context_len=self.context_lens[:batch],
            block_table=self.block_tables[:batch],
            tile_seq=self.rows[:batch],
            tile_q0=self.zeros[:batch],
            block_q=1,
        )
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            positions=self.positions[:batch],
            logits_index=self.rows64[:batch],
            paged=[tiles],
            page_size=self.page_size,
        )

    def _lora(self, batch: int) -> LoRABatch | None:
        if self.lora_tiles is not None:
            return self.lora_tiles.batch
        return GraphLoRA(self.lora, self.lora_slots[:batch]) if self.lora is not None else None

    def capture(self, forward: Forward) -> bool:
        """Capture every size of the ladder, largest first (the others reuse its memory pool). False
        (logged, graphs off) on any error, or when the smallest graph's logits differ from eager's."""
        try:
            self._reset_padding(self.ladder[-1])
            pool = None
            for batch in reversed(self.ladder):
                meta = self.metadata(batch)
                warm = forward(self.tokens[:batch], meta, self._lora(batch))  # Triton compiles here
                if self.logits is None:
                    self.logits = torch.empty_like(warm)
                del warm
                self._synchronize()

                def step(batch: int = batch, meta: AttentionMetadata = meta) -> None:
                    # The LoRA column mask is built inside the capture: recomputed at every replay.
                    assert self.logits is not None
                    self.logits[:batch].copy_(forward(self.tokens[:batch], meta, self._lora(batch)))

                self.graphs[batch], pool = self._record(step, pool)
            self._synchronize()
            self.enabled = self._replay_equals_eager(forward)
            if not self.enabled:
                log.warning("CUDA graphs off: a replayed decode differs from the eager one")
        except Exception as exc:  # any capture failure: keep serving eagerly
            log.warning("CUDA graphs off: capturing the decode step failed (%s: %s)", type(exc).__name__, exc)
            self.enabled = False
        if not self.enabled:
            self.graphs.clear()
            self.logits = None
        return self.enabled

    def _record(self, step: Callable[[], None], pool: Any) -> tuple[Callable[[], None], Any]:
        """Capture ``step`` into a CUDA graph sharing ``pool``: (its replay, the pool)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        return graph.replay, graph.pool()

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _reset_padding(self, batch: int) -> None:
        """Every row a padding row: context 0, K/V written to the scratch slot."""
        self.context_lens[:batch].zero_()
        self.slot_mapping[:batch].fill_(self.scratch_slot)
        self.lora_slots[:batch].fill_(-1)
        if self.lora_tiles is not None:
            self.lora_tiles.table.zero_()  # padding tiles only

    def _replay_equals_eager(self, forward: Forward) -> bool:
        """One decode over the scratch block, replayed and eager: the start-up check that a graph
        computes what the eager step does."""
        scratch_block = self.scratch_slot // self.page_size
        step = DecodeInputs([1], [0], [self.scratch_slot], [1], [[scratch_block]], [-1])
        replayed = self.replay(step, 1, check=False).clone()
        meta = self.metadata(1)
        eager = forward(self.tokens[:1], meta, self._lora(1))
        tol = 1e-4 if eager.dtype == torch.float32 else 3e-2
        return bool(torch.allclose(replayed.float(), eager.float(), rtol=tol, atol=tol))

    def fill(self, step: DecodeInputs) -> int:
        """Copy a step (padded to a captured size) into the static buffers; returns that size."""
        batch = len(step.tokens)
        width = max(len(t) for t in step.block_tables)
        tables = [t + [0] * (width - len(t)) for t in step.block_tables]

        def put(dst: torch.Tensor, values: list[int]) -> None:
            dst.copy_(torch.tensor(values, dtype=dst.dtype), non_blocking=True)

        put(self.tokens[:batch], step.tokens)
        put(self.positions[:batch], step.positions)
        put(self.slot_mapping[:batch], step.slots)
        put(self.context_lens[:batch], step.context_lens)
        # numpy builds a 256 x 33 table ~3x faster than torch.tensor of nested lists (host time the GPU
        # waits for at every decode step)
        table = torch.from_numpy(np.array(tables, dtype=np.int32))
        self.block_tables[:batch, :width].copy_(table, non_blocking=True)
        put(self.lora_slots[:batch], step.lora_slots)
        if self.lora_tiles is not None:
            self.lora_tiles.fill(step.lora_slots)
        return batch

    def replay(self, step: DecodeInputs, n: int, check: bool = True) -> torch.Tensor:
        """Logits of the step's first ``n`` rows (a copy: the next replay overwrites the graph's)."""
        if check and not self.enabled:
            raise RuntimeError("no captured CUDA graphs")
        batch = self.fill(step)
        self.graphs[batch]()
        assert self.logits is not None
        return self.logits[:n].clone()

    def pad(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        lora_slots: list[int],
    ) -> DecodeInputs | None:
        """The step padded to its captured size (None: no graph is that large)."""
        batch = padded_batch(self.ladder, len(tokens))
        if batch is None:
            return None
        extra = batch - len(tokens)
        return DecodeInputs(
            tokens + [0] * extra,
            positions + [0] * extra,
            slots + [self.scratch_slot] * extra,
            context_lens + [0] * extra,
            block_tables + [[0]] * extra,
            lora_slots + [-1] * extra,
        )
