"""The Triton kernels of fused_ops.py (this module imports Triton; that one does not, so that nothing
imports Triton before a launch: Triton's interpreter must be chosen before its import).

Each kernel rounds where the torch ops it replaces round (to the activations' dtype after each op), so
that in bfloat16 both paths give the same values up to the order of a reduction, and in float32 the
same up to the last bit of ``exp``/``rsqrt``."""

# ruff: noqa: ANN001, ANN201 - a kernel's arguments are typed by Triton at launch (pointers, scalars).
# No ``from __future__ import annotations``: Triton reads the tl.constexpr annotations as objects.

import triton
import triton.language as tl


# A reduction through this (not tl.sum, which Triton defines as a jit function): the kernel then runs in
# the interpreter even when Triton was imported before TRITON_INTERPRET was set (peft imports it).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    res_out_ptr,
    w_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: ``res_out = x + res`` (rounded to the row's dtype, as the torch add stores it), then
    ``out = w * rmsnorm(res_out)``; without a residual, ``out = w * rmsnorm(x)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    mean_square = tl.reduce(x32 * x32, 0, _add) / n_cols
    y = (x32 * (1.0 / tl.sqrt(mean_square + eps))).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=ok)


@triton.jit
def rope_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_row,
    stride_cos,
    stride_sin,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    N_HEADS: tl.constexpr,
    N_KV: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    WRITE_KV: tl.constexpr,
):
    """Program (token, head) over the heads of the fused qkv row (query heads, key heads, value heads):
    rotates a query or key head in place (rotate-half RoPE); WRITE_KV also stores each rotated key head
    and each value head into the token's slot of the head-major KV cache (the cache write that would
    otherwise be two more kernels a layer). Without WRITE_KV the grid covers query and key heads only."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, HALF_P2)
    ok = j < HALF
    base = qkv_ptr + token * stride_row + head * 2 * HALF
    x1 = tl.load(base + j, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + j, mask=ok, other=0.0)
    if head < N_HEADS + N_KV:
        dtype = x1.dtype
        c1 = tl.load(cos_ptr + token * stride_cos + j, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + token * stride_cos + HALF + j, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + token * stride_sin + j, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + token * stride_sin + HALF + j, mask=ok, other=0.0).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as the torch ops round it
        o1 = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
        tl.store(base + j, o1, mask=ok)
        tl.store(base + HALF + j, o2, mask=ok)
        if WRITE_KV:  # noqa: SIM102 - a constexpr test, resolved at compile time: kept apart
            if head >= N_HEADS:  # a key head: into the K cache, rotated
                slot = tl.load(slot_ptr + token).to(tl.int64)
                dst = k_cache_ptr + (head - N_HEADS) * stride_kh + slot * stride_ks
                tl.store(dst + j, o1, mask=ok)
                tl.store(dst + HALF + j, o2, mask=ok)
    else:  # a value head (WRITE_KV only): into the V cache as it is
        slot = tl.load(slot_ptr + token).to(tl.int64)
        dst = v_cache_ptr + (head - N_HEADS - N_KV) * stride_vh + slot * stride_vs
        tl.store(dst + j, x1, mask=ok)
        tl.store(dst + HALF + j, x2, mask=ok)


@triton.jit
def silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
):
    """``out = silu(gate) * up`` for one block of one row of ``[gate | up]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0)
    u = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=ok, other=0.0)
    g32 = g.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)
