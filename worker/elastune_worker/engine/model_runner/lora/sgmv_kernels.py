"""The Triton kernels of sgmv.py (this module imports Triton; that one does not, so that nothing imports
Triton before a launch: Triton's interpreter must be chosen before its import).

Both kernels walk *tiles*: up to BLOCK_M rows of one adapter (their indices into the step's flat batch
in ``rows``), the adapter's device slot and the rank the tile reads. Ranks past it are masked loads (no
memory read), so a tile's bytes scale with its rank; the block shape stays the slots' full rank."""

# ruff: noqa: ANN001, ANN201 - a kernel's arguments are typed by Triton at launch (pointers, scalars).
# No ``from __future__ import annotations``: Triton reads the tl.constexpr annotations as objects.

import triton
import triton.language as tl

# Triton compiles a kernel per class of each integer argument (== 1, a multiple of 16, other) at its first
# launch. n_tiles and n_splits follow the batch, so they are not specialized; the others are fixed per
# model and target (widths, strides; k_chunk is a multiple of BLOCK_K), so a (target, dtype) compiles
# once, at start-up (ModelRunner.compile_lora_or_fall_back).
SHRINK_UNSPECIALIZED = ["n_tiles"]
EXPAND_UNSPECIALIZED = ["n_tiles", "n_splits"]
# UPCAST multiplies in float32: Triton's interpreter multiplies bfloat16 blocks as their raw bits (numpy
# has no bfloat16); a float32 product of bfloat16 values is exact, so only the speed differs. Inline, not
# a jit helper: a jit function decorated before TRITON_INTERPRET was set (tl.zeros and tl.sum are, at
# Triton's import) cannot be called from an interpreted kernel, and tests import peft, which imports
# Triton, first.
#
# A tile of count 0 (rank 0) is padding: a CUDA graph's tile table has a fixed length (sgmv.py). Its
# programs skip their whole body: with masked loads alone, the padding of a batch-64 graph (24 tiles at
# 8 slots) cost ~1.7 ms of an 8.8 ms step on an H200 with no adapter row at all (the step without LoRA:
# 7.2 ms); measured before this skip, which has not run on a GPU yet.


@triton.jit(do_not_specialize=SHRINK_UNSPECIALIZED)
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    part_ptr,
    rows_ptr,
    tiles_ptr,
    n_tiles,
    stride_x,
    stride_a_slot,
    stride_a_rank,
    stride_part_split,
    stride_part,
    d_in,
    k_chunk,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``part[split, start + i, :rank] = x[rows[start + i], K] @ A[slot, :rank, K]ᵀ`` in float32 for the
    tile's rows over the split's ``k_chunk`` input features K (split-K: a decode step has a few tiles,
    and one program walking all of d_in serially left the GPU idle: ~36 us a launch at 8B widths on an
    H200, where the bytes take ~1 us at its copy rate, by arithmetic). Ranks past ``rank`` are written
    as zeros."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    start = tl.load(tiles_ptr + tile)
    n = tl.load(tiles_ptr + n_tiles + tile)
    if n > 0:  # else a padding tile (a graph's table): its programs do nothing
        slot = tl.load(tiles_ptr + 2 * n_tiles + tile).to(tl.int64)
        rank = tl.load(tiles_ptr + 3 * n_tiles + tile)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < n
        rows = tl.load(rows_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < rank
        k = tl.arange(0, BLOCK_K)
        k_start = split * k_chunk
        k_stop = tl.minimum(k_start + k_chunk, d_in)
        acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)  # not tl.zeros: a jit function (see above)
        for k0 in range(k_start, k_stop, BLOCK_K):
            kk = k0 + k
            k_ok = kk < k_stop
            x_ok = m_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=x_ok, other=0.0)
            a = tl.load(
                a_ptr + slot * stride_a_slot + r[None, :] * stride_a_rank + kk[:, None],
                mask=r_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if UPCAST:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, a, input_precision=DOT_PRECISION)
        out = part_ptr + split.to(tl.int64) * stride_part_split
        out += (start + m)[:, None].to(tl.int64) * stride_part + r[None, :]
        tl.store(out, acc, mask=m_ok[:, None])


@triton.jit(do_not_specialize=EXPAND_UNSPECIALIZED)
def lora_expand_kernel(
    part_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    tiles_ptr,
    n_tiles,
    n_splits,
    stride_part_split,
    stride_part,
    stride_b_slot,
    stride_b_rank,
    stride_out,
    d_out,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``out[rows[start + i], cols] += xa[start + i, :rank] @ Bᵀ[slot, :rank, cols]`` for one tile and one
    BLOCK_N run of output columns, where ``xa`` is the sum of the shrink's ``n_splits`` partial products
    rounded to out's dtype (the torch path rounds its first product so); the product rounded to out's
    dtype, then added (the torch path's ``index_add_`` of a delta in that dtype). Each row is in one
    tile: no two programs write one element."""
    tile = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(tiles_ptr + tile)
    n = tl.load(tiles_ptr + n_tiles + tile)
    if n > 0:  # else a padding tile (a graph's table): its programs do nothing
        slot = tl.load(tiles_ptr + 2 * n_tiles + tile).to(tl.int64)
        rank = tl.load(tiles_ptr + 3 * n_tiles + tile)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < n
        rows = tl.load(rows_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < rank
        c_ok = cols < d_out
        dtype = out_ptr.dtype.element_ty
        part = part_ptr + (start + m)[:, None].to(tl.int64) * stride_part + r[None, :]
        part_ok = m_ok[:, None] & r_ok[None, :]
        xa = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
        for split in range(0, n_splits):
            xa += tl.load(part + split * stride_part_split, mask=part_ok, other=0.0)
        xa = xa.to(dtype)
        b = tl.load(
            b_ptr + slot * stride_b_slot + r[:, None] * stride_b_rank + cols[None, :],
            mask=r_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            delta = tl.dot(xa.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            delta = tl.dot(xa, b, input_precision=DOT_PRECISION)
        ok = m_ok[:, None] & c_ok[None, :]
        ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
        old = tl.load(ptrs, mask=ok, other=0.0)
        tl.store(ptrs, (old.to(tl.float32) + delta.to(dtype).to(tl.float32)).to(dtype), mask=ok)
