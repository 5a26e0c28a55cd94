"""Segmented LoRA in two Triton launches per target and layer, whatever the number of adapters (CUDA).

The torch path (kernels.py) loops over a batch's adapters: an index_select, two matmuls and an
index_add_ per adapter, target and layer, each a kernel launched from Python. At a 32-layer model with
three targets and eight adapters in a prefill step that is ~3,000 launches, at 32 adapters ~12,000:
more host time than the base model's step on a GPU. Here the rows of each adapter are cut into tiles of
BLOCK_M rows, and one *shrink* launch computes every tile's ``x·Aᵀ`` (Punica's SGMV, S-LoRA's MBGMV
when each tile reads its own rank) and one *expand* launch adds ``(x·Aᵀ)·(B·s)ᵀ`` into the output, in
place, column slices of fused projections included. A decode's one-token rows of one adapter share a
tile, so its A is read once for all of them (BGMV reads it once per row).

The two kernels of kernels.py map onto the rank each tile reads: ``padded`` reads every adapter at the
batch's max rank, ``unpadded`` at its own. Block shapes stay the slots' full rank; ranks past a tile's
are masked loads, so what differs is the bytes of A and B read, which is what bounds these launches.
On the CPU the torch path serves (Triton runs there only in its interpreter: the tests). No module here
imports Triton (see triton_attention.py for why)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch

from elastune_worker.engine.model_runner import triton_attention
from elastune_worker.engine.model_runner.triton_attention import next_pow2
from elastune_worker.engine.model_runner.triton_choice import choose_triton, triton_unusable

LoraBackend = Literal["torch", "triton"]

BLOCK_M = 16
"""Rows per tile (tl.dot's smallest block). A long prefill's tiles each read their adapter's A again
(from L2 at these sizes); larger tiles for prefill groups are a setting for a GPU run to tune."""
BLOCK_K = 64
"""Input features per step of the shrink's loop."""
BLOCK_N = 64
"""Output columns per expand program."""
SHRINK_PROGRAMS = 256
"""Shrink programs a launch aims at (about two per multiprocessor of an H100/H200): a step with fewer
tiles splits the input features (split-K) until it has about this many."""


@dataclass
class SegmentTiles:
    """The adapter rows of one step, in tiles (built once a step, read by every target and layer)."""

    rows: torch.Tensor
    """[rows] int32: the batch rows of every adapter, grouped by adapter (a tile's rows are a run)."""
    tiles: torch.Tensor
    """[4 x n_tiles] int32: each tile's first index into ``rows``, its row count, slot and rank read."""
    n_tiles: int
    block_r: int
    """The rank dimension of every tile's blocks: the slots' max rank as a power of 2, at least 16."""


def tile_table(groups: list[tuple[int, list[int], int]], rows_cap: int, tiles_cap: int | None) -> np.ndarray:
    """The flat int32 table of ``groups`` ((device slot, batch rows, rank to read) of each adapter):
    ``rows_cap`` row entries, then the four tile columns of ``tiles_cap`` tiles each (None: as many as
    the groups make; past them, padding tiles of count and rank 0, which the kernels skip). ValueError
    when the groups do not fit."""
    rows: list[int] = []
    starts: list[int] = []
    counts: list[int] = []
    slots: list[int] = []
    ranks: list[int] = []
    for slot, group_rows, rank in groups:
        for i in range(0, len(group_rows), BLOCK_M):
            starts.append(len(rows) + i)
            counts.append(min(BLOCK_M, len(group_rows) - i))
            slots.append(slot)
            ranks.append(rank)
        rows.extend(group_rows)
    cap = len(starts) if tiles_cap is None else tiles_cap
    if len(rows) > rows_cap or len(starts) > cap:
        raise ValueError(f"{len(rows)} rows in {len(starts)} tiles do not fit {rows_cap} rows, {cap} tiles")
    flat = np.zeros(rows_cap + 4 * cap, dtype=np.int32)
    flat[: len(rows)] = rows
    for column, values in enumerate((starts, counts, slots, ranks)):
        flat[rows_cap + column * cap : rows_cap + column * cap + len(values)] = values
    return flat


def aligned_rows(n: int) -> int:
    """Row entries of a table for ``n`` rows: a multiple of 4, so that the tiles start 16 bytes in, as
    Triton's pointer specialization expects of every launch (an unaligned start would compile another
    variant while serving)."""
    return -(-n // 4) * 4


def block_rank(slot_rank: int) -> int:
    return max(16, next_pow2(slot_rank))


def build_tiles(
    groups: list[tuple[int, list[int], int]], slot_rank: int, device: torch.device
) -> SegmentTiles:
    """``groups``: (device slot, batch rows, rank to read) of each adapter in the step; ``slot_rank``: the
    device slots' max rank. One host-to-device copy."""
    n_rows = sum(len(rows) for _, rows, _ in groups)
    padded = aligned_rows(n_rows)
    flat = tile_table(groups, padded, None)
    data = torch.from_numpy(flat).to(device, non_blocking=True)
    return SegmentTiles(data[:n_rows], data[padded:], (len(flat) - padded) // 4, block_rank(slot_rank))


def max_tiles(rows: int, slots: int) -> int:
    """Tiles ``rows`` rows of at most ``slots`` adapters can make: each adapter's last tile may be
    partial (the length of a CUDA graph's tile table)."""
    return min(rows, rows // BLOCK_M + slots)


def k_split(n_tiles: int, d_in: int) -> tuple[int, int]:
    """(splits, features per split) of the shrink's input features for a launch of ``n_tiles``."""
    steps = -(-d_in // BLOCK_K)
    splits = max(1, min(steps, SHRINK_PROGRAMS // max(1, n_tiles)))
    chunk = -(-steps // splits) * BLOCK_K
    return -(-d_in // chunk), chunk


def add(
    out: torch.Tensor, x: torch.Tensor, a_all: torch.Tensor, bt_all: torch.Tensor, t: SegmentTiles
) -> None:
    """``out[rows] += x[rows] @ A[slot, :rank]ᵀ @ Bᵀ[slot, :rank]`` for every tile, in place. ``a_all``:
    [slots, rank, in], ``bt_all``: [slots, rank, out] (B·scaling transposed, slots.py); ``out`` may be a
    column slice of a wider tensor (its rows' stride is read)."""
    if t.n_tiles == 0:
        return
    from elastune_worker.engine.model_runner.lora.sgmv_kernels import lora_expand_kernel, lora_shrink_kernel

    if x.device.type != "cuda" and not triton_attention.interpreted():
        raise RuntimeError("Triton LoRA on the CPU runs only in Triton's interpreter (TRITON_INTERPRET=1)")
    if x.stride(-1) != 1 or out.stride(-1) != 1 or a_all.stride(-1) != 1 or bt_all.stride(-1) != 1:
        raise ValueError("the LoRA kernels need each row's features contiguous")
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.device.type != "cuda"  # the interpreter (see sgmv_kernels._dot)
    d_in = x.shape[1]
    splits, chunk = k_split(t.n_tiles, d_in)
    # float32 partial products of each split, summed and rounded by the expand
    part = torch.empty(splits, t.rows.shape[0], t.block_r, dtype=torch.float32, device=x.device)
    lora_shrink_kernel[(t.n_tiles, splits)](
        x, a_all, part, t.rows, t.tiles, t.n_tiles,
        x.stride(0), a_all.stride(0), a_all.stride(1), part.stride(0), part.stride(1), d_in, chunk,
        BLOCK_M=BLOCK_M, BLOCK_R=t.block_r, BLOCK_K=BLOCK_K, DOT_PRECISION=precision, UPCAST=upcast,
    )  # fmt: skip
    d_out = out.shape[1]
    lora_expand_kernel[(t.n_tiles, -(-d_out // BLOCK_N))](
        part, bt_all, out, t.rows, t.tiles, t.n_tiles, splits,
        part.stride(0), part.stride(1), bt_all.stride(0), bt_all.stride(1), out.stride(0), d_out,
        BLOCK_M=BLOCK_M, BLOCK_R=t.block_r, BLOCK_N=BLOCK_N, DOT_PRECISION=precision, UPCAST=upcast,
    )  # fmt: skip


def reference_add(
    out: torch.Tensor, x: torch.Tensor, a_all: torch.Tensor, bt_all: torch.Tensor, groups: list
) -> None:
    """The torch path's arithmetic for the same groups (one adapter at a time): the start-up check."""
    for slot, rows, rank in groups:
        idx = torch.tensor(rows, device=x.device)
        delta = (x.index_select(0, idx) @ a_all[slot, :rank].T) @ bt_all[slot, :rank]
        out.index_add_(0, idx, delta)


def triton_problem(
    device: torch.device, dtype: torch.dtype, shapes: dict[str, tuple[int, int]], max_rank: int
) -> str | None:
    """Why the Triton LoRA kernels cannot serve here (None: they can): checked against the torch path's
    arithmetic at each of the model's (in, out) widths, with adapters of mixed ranks, base rows between
    theirs and a tile's worth of rows, so that a Triton that compiles them differently on an unseen GPU
    falls back instead of serving wrong tokens."""
    if (unusable := triton_unusable(device)) is not None:
        return unusable
    gen = torch.Generator().manual_seed(0)
    ranks = sorted({1, max(1, max_rank // 2), max_rank})
    rows_total = BLOCK_M + 6
    # rows: a full tile and one more of the first adapter, single rows of the others, base rows (none)
    groups_rows = [list(range(0, 2 * rows_total, 2))[: BLOCK_M + 1], [1], [3, 5]][: len(ranks)]
    # float32: the order of the sums; bfloat16: a few roundings of the largest value (products rounded
    # to bfloat16 twice, in each path; Triton's interpreter truncates instead of rounding)
    steps = 1e-5 if dtype == torch.float32 else 4 * 2**-8
    try:
        for d_in, d_out in sorted(set(shapes.values())):
            a = (torch.randn(len(ranks), max_rank, d_in, generator=gen) / d_in**0.5).to(device, dtype)
            bt = (torch.randn(len(ranks), max_rank, d_out, generator=gen) / max_rank**0.5).to(device, dtype)
            x = torch.randn(2 * rows_total, d_in, generator=gen).to(device, dtype)
            # a column slice, as the model's fused outputs are (padding of 16 keeps the row stride's
            # class for Triton's specialization, so the check's compiles are serving's where they match)
            base = torch.randn(2 * rows_total, d_out + 32, generator=gen).to(device, dtype)
            for padded in (True, False):
                groups = [(s, groups_rows[s], max_rank if padded else r) for s, r in enumerate(ranks)]
                got, expected = base.clone(), base.clone()
                add(got[:, 16 : 16 + d_out], x, a, bt, build_tiles(groups, max_rank, device))
                reference_add(expected[:, 16 : 16 + d_out], x, a, bt, groups)
                err = (got.float() - expected.float()).abs().max().item()
                if not err <= steps * expected.float().abs().max().item():
                    return f"at ({d_in}, {d_out}) it differs from the torch path (max abs error {err:.3g})"
    except Exception as exc:  # any failure of an unseen Triton or GPU: the torch path serves
        return f"{type(exc).__name__}: {exc}"
    return None


def pick_lora_backend(
    choice: str, device: torch.device, dtype: torch.dtype, shapes: dict[str, tuple[int, int]], max_rank: int
) -> LoraBackend:
    """torch, or triton: asked for (it must work: else a clear error), or auto (on CUDA when Triton
    imports and its kernels agree with the torch path on a start-up check; torch otherwise)."""
    use_triton = choose_triton(
        "lora_backend", choice, device, partial(triton_problem, device, dtype, shapes, max_rank), "torch"
    )
    return "triton" if use_triton else "torch"
