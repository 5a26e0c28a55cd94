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
    part_acc_ptr,
    part_ml_ptr,
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
    SPLITS: tl.constexpr,
):
    """SPLITS > 1 (decode tiles only: flash-decoding): program (tile, KV head, split) attends to the
    split-th of the context's keys and writes its unnormalized partial (max, sum, accumulator) to
    ``part_*`` for merge_splits_kernel; SPLITS 1 attends to all of them and writes the output."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
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
    # This split's keys: whole BLOCK_N runs, so that every split but the last is full.
    # (no tl.cdiv: a jit function of Triton's library, which the interpreter cannot call when Triton
    # was imported before TRITON_INTERPRET was set, as in a whole test session)
    per_split = ((kv_end + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(kv_end, lo + per_split)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        key_ok = pos < hi
        block = tl.load(block_table_ptr + seq * stride_table + pos // PAGE, mask=key_ok, other=0)
        slot = (block * PAGE + pos % PAGE).to(tl.int64)
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(row_ok[:, None] & key_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, -1.0e30)
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _maximum))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _add)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:  # partials [row, head, split]: (max, sum) pairs and accumulators, float32
        n_heads = tl.num_programs(1) * REP
        part = (rows * n_heads + head) * SPLITS + split
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        part_mask = row_ok[:, None] & d_ok[None, :]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=part_mask)


@triton.jit
def merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    q_row_ptr,
    tile_seq_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One decode row and query head: its splits' partials rescaled to their common max and summed
    (an empty split has sum 0 and adds nothing; a row with no keys, padding, is written as zeros)."""
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    row = tl.load(q_row_ptr + tl.load(tile_seq_ptr + tile)).to(tl.int64)
    part = (row * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(part_ml_ptr + part * 2)
    l_s = tl.load(part_ml_ptr + part * 2 + 1)
    d = tl.arange(0, D_P2)
    d_ok = d < HEAD_DIM
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=d_ok[None, :], other=0.0)
    m_max = tl.reduce(m, 0, _maximum)
    w = tl.exp(m - m_max)
    total = tl.reduce(l_s * w, 0, _add)
    out = tl.reduce(acc * w[:, None], 0, _add) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
