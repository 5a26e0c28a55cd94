"""Paged attention over a flat batch of mixed prefill chunks and decodes, in plain torch.

The step's tokens are flattened ([T, heads, head_dim]). Their K/V are written into the cache at their
slots first (here, or by the caller: a Llama layer's RoPE writes them); then each prefill chunk attends
causally to its whole cached prefix, and all decodes attend together, each to its own context, through
gathered K/V and a length mask. The same code runs on CPU and CUDA (``scaled_dot_product_attention``
picks the kernel).

The cache is head-major ([KV heads, slots, head_dim]): one head's block is one contiguous run, so a
gathered context is a contiguous [length, head_dim] matrix per (decode, head). On the CPU the decodes
gather and attend one KV head at a time (index_select along the first dimension is the fast copy, and
SDPA reads a contiguous context much faster than a strided one: 1.6-1.9x faster decode attention for
64 decodes in a micro-benchmark, SDPA's time in an engine step down by a third); on CUDA all heads go
in one call (fewer kernel launches).

The ``paged`` tiles of the metadata go instead to the Triton kernel that reads the cache in place
(triton_attention.py, the ``triton`` attention backend): decodes and prefill chunks over a cached
prefix then need no gather; a chunk that starts its sequence still attends through SDPA over its own K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from elastune_worker.engine.model_runner.triton_attention import PagedTiles, paged_attention_in_place


@dataclass
class DecodeGroup:
    index: torch.Tensor
    """[B] rows of these decodes (one token each)."""
    blocks: torch.Tensor
    """[B, N] each decode's block table, padded to the group's longest (with block 0)."""
    mask: torch.Tensor
    """[B, 1, 1, N x block_size] True where a decode's key is real."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] cache slot of every token of the step."""
    positions: torch.Tensor
    """[T] position of every token in its sequence."""
    logits_index: torch.Tensor
    """Rows of the flat batch whose logits are sampled (each sequence's last scheduled token)."""
    decodes: list[DecodeGroup] = field(default_factory=list)
    """Decodes grouped by context length, so that padding to a group's longest context stays small."""
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    """(first row, end row, context slots or None when the chunk starts at 0, causal mask or None)."""
    paged: list[PagedTiles] = field(default_factory=list)
    """Rows attended in place by the Triton kernel (instead of ``decodes`` and cached-prefix prefills)."""
    page_size: int = 0
    """Tokens per KV block (``paged`` reads the block tables with it)."""


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    per_head: bool | None = None,
    kv_written: bool = False,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D]; caches [KV, slots, D]. Returns [T, H, D]. ``per_head``: decodes
    one KV head at a time (default: on the CPU). ``kv_written``: the caller already wrote k/v into the
    caches at ``meta.slot_mapping`` (a Llama layer's RoPE does, fused_ops.py)."""
    if not kv_written:
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    n_heads, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
    gqa = n_heads != n_kv
    if per_head is None:
        per_head = q.device.type == "cpu"
    out = torch.empty_like(q)
    for g in meta.decodes:
        b, width = g.index.shape[0], g.mask.shape[-1]
        # Grouped-query attention without copying K/V per query head: the query heads that share a
        # K/V head stand in the query-length position of one attention ([B, KV, rep, D]); a decode's
        # single query attends to its whole context, so no causal mask is needed among them.
        qd = q[g.index].view(b, n_kv, n_heads // n_kv, d)
        if per_head:
            heads = [
                F.scaled_dot_product_attention(
                    qd[:, h : h + 1],
                    _gather_head(k_cache[h], g.blocks, width),
                    _gather_head(v_cache[h], g.blocks, width),
                    attn_mask=g.mask,
                    scale=scale,
                )
                for h in range(n_kv)
            ]
            o = torch.cat(heads, dim=1) if n_kv > 1 else heads[0]
        else:
            kd = _gather_blocks(k_cache, g.blocks, width)  # [B, KV, L, D]
            vd = _gather_blocks(v_cache, g.blocks, width)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        out[g.index] = o.reshape(b, n_heads, d)
    for tiles in meta.paged:
        paged_attention_in_place(q, k_cache, v_cache, out, tiles, scale, meta.page_size)
    for start, end, slots, mask in meta.prefills:
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if slots is None:  # the chunk is the whole context so far: plain causal attention
            kp = k[start:end].transpose(0, 1).unsqueeze(0)
            vp = v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kp = k_cache.index_select(1, slots).unsqueeze(0)  # [1, KV, context, D]
            vp = v_cache.index_select(1, slots).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _gather_head(cache: torch.Tensor, blocks: torch.Tensor, width: int) -> torch.Tensor:
    """One KV head's contexts of a [B, N] block table as [B, 1, width, D] (width = N x block size),
    from that head's [slots, D] cache: whole blocks are copied (one index per block, not per slot:
    several times fewer, larger copies), and index_select is several times faster than advanced
    indexing."""
    b, n = blocks.shape
    d = cache.shape[-1]
    paged = cache.view(-1, (width // n) * d)  # [num_blocks, block_size x D]
    return paged.index_select(0, blocks.reshape(-1)).view(b, 1, width, d)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, width: int) -> torch.Tensor:
    """All KV heads' contexts at once, as [B, KV, width, D] (from the [KV, slots, D] cache)."""
    b, n = blocks.shape
    kv, d = cache.shape[0], cache.shape[2]
    paged = cache.view(kv, -1, (width // n) * d)  # [KV, num_blocks, block_size x D]
    return paged.index_select(1, blocks.reshape(-1)).view(kv, b, width, d).transpose(0, 1)
