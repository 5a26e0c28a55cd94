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
# launch. n_tiles follows the batch, so it is not specialized; the others are fixed per model and target
# (widths, strides), so a (target, dtype) compiles once, at start-up (ModelRunner.compile_lora_or_fall_back).
UNSPECIALIZED = ["n_tiles"]
# UPCAST multiplies in float32: Triton's interpreter multiplies bfloat16 blocks as their raw bits (numpy
# has no bfloat16); a float32 product of bfloat16 values is exact, so only the speed differs. Inline, not
# a jit helper: a jit function decorated before TRITON_INTERPRET was set (tl.zeros and tl.sum are, at
# Triton's import) cannot be called from an interpreted kernel, and tests import peft, which imports
# Triton, first.


@triton.jit(do_not_specialize=UNSPECIALIZED)
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    xa_ptr,
    rows_ptr,
    tiles_ptr,
    n_tiles,
    stride_x,
    stride_a_slot,
    stride_a_rank,
    stride_xa,
    d_in,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``xa[start + i, :rank] = x[rows[start + i]] @ A[slot, :rank]ᵀ`` for the tile's rows (rounded to
    xa's dtype, as the torch path rounds its first product); ranks past ``rank`` are written as zeros."""
    tile = tl.program_id(0)
    start = tl.load(tiles_ptr + tile)
    n = tl.load(tiles_ptr + n_tiles + tile)
    slot = tl.load(tiles_ptr + 2 * n_tiles + tile).to(tl.int64)
    rank = tl.load(tiles_ptr + 3 * n_tiles + tile)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < n
    rows = tl.load(rows_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    k = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)  # not tl.zeros: a jit function (see above)
    for k0 in range(0, d_in, BLOCK_K):
        kk = k0 + k
        k_ok = kk < d_in
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
    out = xa_ptr + (start + m)[:, None].to(tl.int64) * stride_xa + r[None, :]
    tl.store(out, acc.to(xa_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit(do_not_specialize=UNSPECIALIZED)
def lora_expand_kernel(
    xa_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    tiles_ptr,
    n_tiles,
    stride_xa,
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
    BLOCK_N run of output columns: the product rounded to out's dtype, then added (the torch path's
    ``index_add_`` of a delta in that dtype). Each row is in one tile: no two programs write one
    element."""
    tile = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(tiles_ptr + tile)
    n = tl.load(tiles_ptr + n_tiles + tile)
    slot = tl.load(tiles_ptr + 2 * n_tiles + tile).to(tl.int64)
    rank = tl.load(tiles_ptr + 3 * n_tiles + tile)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < n
    rows = tl.load(rows_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    c_ok = cols < d_out
    xa = tl.load(
        xa_ptr + (start + m)[:, None].to(tl.int64) * stride_xa + r[None, :],
        mask=m_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
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
    dtype = out_ptr.dtype.element_ty
    tl.store(ptrs, (old.to(tl.float32) + delta.to(dtype).to(tl.float32)).to(dtype), mask=ok)
