"""Paged attention that reads the KV cache in place (Triton), for decodes and prefill chunks over a
cached prefix: no gathered copy of any context, no padding to the longest context of a batch.

One program attends one *tile* — up to ``block_q`` consecutive query tokens of one sequence — for one
KV head: its rows are (token, query head of that KV head's group), so the K/V of a block are read once
for all query heads that share them (grouped-query attention). It walks the sequence's block table up
to the tile's last query position, with an online softmax in float32 (as FlashAttention does), and
writes each row's output in place. A small decode batch also splits each context across programs
(flash-decoding, ``decode_splits``) and merges their partials in a second kernel. The same kernels
run on CUDA (compiled) and on CPU tensors through Triton's interpreter (tests only: orders of
magnitude slower than gather + SDPA there).

Shapes are static per (tiles, KV heads), and nothing here reads a device value on the host, so a
decode step that uses it can be captured in a CUDA graph (cuda_graphs.py).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def available() -> bool:
    """Triton is installed (the worker image may lack it on CPU: the gather backend serves then). Not
    imported here: its interpreter (TRITON_INTERPRET=1, for CPU tensors) is chosen at its import."""
    return importlib.util.find_spec("triton") is not None


@dataclass
class PagedTiles:
    """The query tiles of one kernel launch, and the sequences they belong to."""

    q_row: torch.Tensor
    """[S] int32: each sequence's first row in the step's flat batch (its rows are consecutive)."""
    q_len: torch.Tensor
    """[S] int32: its query tokens in this step."""
    context_len: torch.Tensor
    """[S] int32: its context after this step (cached prefix + these tokens); 0 marks padding."""
    block_table: torch.Tensor
    """[S, N] int32: its KV blocks, padded with any valid block id."""
    tile_seq: torch.Tensor
    """[tiles] int32: the sequence of each tile."""
    tile_q0: torch.Tensor
    """[tiles] int32: the tile's first query token within its sequence."""
    block_q: int
    """Query tokens per tile (1 for decodes)."""
    splits: int | None = None
    """Decode tiles: programs per (sequence, KV head) over shares of its context; None: decode_splits."""


@dataclass(frozen=True)
class LaunchTuning:
    """Launch settings of the kernel (None: its default): keys per loop step, warps, pipeline stages."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    splits: int | None = None
    """Decode tiles: programs per (sequence, KV head), each over a share of the context (a power of 2)."""


MAX_SPLITS = 16
CPU_PROGRAM_SLOTS = 4
"""Stands in for a GPU's multiprocessors on the CPU (Triton's interpreter: tests), so that small decode
batches take the split path there too."""


def decode_splits(programs: int, device: torch.device) -> int:
    """Flash-decoding: a decode batch of few (sequence, KV head) programs leaves most of a GPU idle while
    each walks its whole context, so its contexts are split until there are two programs per
    multiprocessor (a power of 2, at most MAX_SPLITS; 1 once the batch alone fills the device). The
    split count depends on the batch only, so a CUDA graph captured for a batch size keeps it."""
    slots = _multiprocessors(device) if device.type == "cuda" else CPU_PROGRAM_SLOTS
    splits = 1
    while splits < MAX_SPLITS and programs * splits < 2 * slots:
        splits *= 2
    return splits


_SM_COUNT: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def build_tiles(
    seqs: list[tuple[int, int, int, list[int]]], width: int, block_q: int, device: torch.device
) -> PagedTiles:
    """``seqs``: (first row, query tokens, context length, block table) per sequence; ``width``: block
    table columns (at least each sequence's blocks in use)."""
    tile_seq: list[int] = []
    tile_q0: list[int] = []
    for i, (_, n, _, _) in enumerate(seqs):
        for q0 in range(0, n, block_q):
            tile_seq.append(i)
            tile_q0.append(q0)
    tables = [t[:width] + [0] * (width - len(t[:width])) for _, _, _, t in seqs]

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return PagedTiles(
        q_row=i32([r for r, _, _, _ in seqs]),
        q_len=i32([n for _, n, _, _ in seqs]),
        context_len=i32([c for _, _, c, _ in seqs]),
        # numpy: ~3x faster than torch.tensor of nested lists for a batch's table
        block_table=torch.from_numpy(np.array(tables, dtype=np.int32).reshape(len(seqs), width)).to(
            device, non_blocking=True
        ),
        tile_seq=i32(tile_seq),
        tile_q0=i32(tile_q0),
        block_q=block_q,
    )


def _kernel(device_type: str) -> Any:
    """Compiled for CUDA; on CPU tensors only through Triton's interpreter."""
    from elastune_worker.engine.model_runner.triton_paged_kernel import paged_attention_kernel

    if device_type != "cuda" and not interpreted():
        raise RuntimeError(
            "Triton attention on the CPU runs only in Triton's interpreter (TRITON_INTERPRET=1)"
        )
    return paged_attention_kernel


def _merge_kernel(device_type: str) -> Any:
    from elastune_worker.engine.model_runner.triton_paged_kernel import merge_splits_kernel

    _kernel(device_type)  # the same interpreter check
    return merge_splits_kernel


def next_pow2(x: int) -> int:
    """The smallest power of 2 >= x (Triton's block shapes; fused_ops.py sizes its kernels with it)."""
    return 1 << max(0, x - 1).bit_length()


def paged_attention_in_place(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    tiles: PagedTiles,
    scale: float,
    page_size: int,
    tuning: LaunchTuning | None = None,
) -> None:
    """q and out [T, H, D]; caches [KV, slots, D] (head-major) already holding the step's K/V. Writes the
    rows of ``tiles``' sequences into ``out``. ``tuning``: launch settings other than the defaults (the
    device check's attention sweep measures them)."""
    n_tiles = tiles.tile_seq.shape[0]
    if n_tiles == 0:
        return
    n_heads, n_kv, d = q.shape[1], k_cache.shape[0], q.shape[2]
    for t in (q, k_cache, v_cache, out):
        if t.stride(-1) != 1:
            raise ValueError("paged attention needs a unit stride along the head dimension")
    rep = n_heads // n_kv
    rep_p2 = next_pow2(rep)
    # tl.dot needs every dimension >= 16: pad the query rows (BLOCK_Q tokens cover a TILE_Q-token tile),
    # the head dimension and the key tile.
    block_q = max(next_pow2(tiles.block_q), -(-16 // rep_p2))
    d_p2 = max(16, next_pow2(d))
    block_n = 64 if d_p2 <= 128 else 32
    launch: dict[str, int] = {}
    splits = tiles.splits or (decode_splits(n_tiles * n_kv, q.device) if tiles.block_q == 1 else 1)
    if tuning is not None:
        block_n = tuning.block_n or block_n
        splits = tuning.splits or splits
        launch = {k: v for k, v in (("num_warps", tuning.num_warps), ("num_stages", tuning.num_stages)) if v}
    if splits > 1 and (tiles.block_q != 1 or splits & (splits - 1)):
        raise ValueError(f"context splits are for decode tiles, a power of 2: not {splits}")
    # Partials of the split path, [rows, heads, splits] (max, sum) and [rows, heads, splits, head_dim].
    rows = q.shape[0] if splits > 1 else 0
    part_ml = torch.empty(rows, n_heads, splits, 2, dtype=torch.float32, device=q.device)
    part_acc = torch.empty(rows, n_heads, splits, d, dtype=torch.float32, device=q.device)
    kernels = _kernel(q.device.type)
    kernels[(n_tiles, n_kv, splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_ml,
        tiles.q_row,
        tiles.q_len,
        tiles.context_len,
        tiles.block_table,
        tiles.tile_seq,
        tiles.tile_q0,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        tiles.block_table.stride(0),
        REP=rep,
        REP_P2=rep_p2,
        TILE_Q=tiles.block_q,
        BLOCK_Q=block_q,
        HEAD_DIM=d,
        D_P2=d_p2,
        PAGE=page_size,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLITS=splits,
        **launch,
    )
    if splits > 1:
        _merge_kernel(q.device.type)[(n_tiles, n_heads)](
            part_acc, part_ml, out, tiles.q_row, tiles.tile_seq, out.stride(0), out.stride(1),
            HEAD_DIM=d, D_P2=d_p2, SPLITS=splits,
        )  # fmt: skip


def interpreted() -> bool:
    """Triton's interpreter is on (CPU tensors can run the kernel)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
