"""The Triton kernel of triton_attention.py (this module imports Triton; that one does not, so that
nothing imports Triton before a launch: Triton's interpreter must be chosen before its import)."""

# ruff: noqa: ANN001, ANN201 - a kernel's arguments are typed by Triton at launch (pointers, scalars).
# No ``from __future__ import annotations``: Triton reads the tl.constexpr annotations as objects.

import triton
import triton.language as tl


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


# Reductions through these (not tl.max / tl.sum, which Triton defines as jit functions): the kernel then
# runs in the interpreter even when Triton was imported before TRITON_INTERPRET was set (peft imports it).
# Triton compiles a kernel per class of each integer argument (== 1, a multiple of 16, other) at its first
# launch. stride_table is the block tables' width, which varies step by step in eager steps: without this,
# serving would compile the kernel again the first time a batch's widest context crosses into another
# class (a second or more on a cold GPU, every running request stalled). The other integers are fixed per
# model, and compiled at start-up (model_runner.py: ModelRunner.compile_kernels).
UNSPECIALIZED = ["stride_table"]


@triton.jit(do_not_specialize=UNSPECIALIZED)
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    q_row_ptr,
    q_len_ptr,
    context_len_ptr,
    block_table_ptr,
    tile_seq_ptr,
    tile_q0_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_table,
    REP: tl.constexpr,
    REP_P2: tl.constexpr,
    TILE_Q: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_row = tl.load(q_row_ptr + seq)
    q_len = tl.load(q_len_ptr + seq)
    context = tl.load(context_len_ptr + seq)
    first_pos = context - q_len  # position of the sequence's first query token

    m = tl.arange(0, BLOCK_Q * REP_P2)
    tok = q0 + m // REP_P2
    rep = m % REP_P2
    row_ok = (tok < q_len) & (tok < q0 + TILE_Q) & (rep < REP)
    q_pos = first_pos + tok
    d = tl.arange(0, D_P2)
    d_ok = d < HEAD_DIM
    head = kv_head * REP + rep
    rows = (q_row + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    # A finite floor instead of -inf: a padding row (all keys masked) stays finite and is never stored.
    m_i = tl.full([BLOCK_Q * REP_P2], -1.0e30, tl.float32)
    l_i = tl.full([BLOCK_Q * REP_P2], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * REP_P2, D_P2], 0.0, tl.float32)
    kv_end = first_pos + tl.minimum(q0 + TILE_Q, q_len)  # keys up to the tile's last query position
    kv_end = tl.maximum(kv_end, 0)  # padding (context 0): no keys, its rows are written as zeros
    n = tl.arange(0, BLOCK_N)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for start in range(0, kv_end, BLOCK_N):
        pos = start + n
        key_ok = pos < kv_end
        block = tl.load(block_table_ptr + seq * stride_table + pos // PAGE, mask=key_ok, other=0)
        slot = (block * PAGE + pos % PAGE).to(tl.int64)
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(row_ok[:, None] & (pos[None, :] <= q_pos[:, None]), s, -1.0e30)
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _maximum))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _add)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
