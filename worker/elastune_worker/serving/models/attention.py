"""Paged attention over a flat batch of mixed prefill chunks and decodes, in plain torch.

The step's tokens are flattened ([T, heads, head_dim]). Their K/V are written into the cache at their
slots first; then each prefill chunk attends causally to its whole cached prefix, and all decodes
attend together, each to its own context, through gathered K/V and a length mask. The same code runs
on CPU and CUDA (``scaled_dot_product_attention`` picks the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    index: torch.Tensor
    """[B] rows of these decodes (one token each)."""
    slots: torch.Tensor
    """[B, L] cache slots of each decode's context, padded to the group's longest."""
    mask: torch.Tensor
    """[B, 1, 1, L] True where a decode's key is real."""


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


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D]; caches [slots, KV, D]. Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    n_heads, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
    gqa = n_heads != n_kv
    out = torch.empty_like(q)
    for g in meta.decodes:
        b = g.index.shape[0]
        # Grouped-query attention without copying K/V per query head: the query heads that share a
        # K/V head stand in the query-length position of one attention ([B, KV, rep, D]); a decode's
        # single query attends to its whole context, so no causal mask is needed among them.
        qd = q[g.index].view(b, n_kv, n_heads // n_kv, d)
        kd = _gather(k_cache, g.slots).transpose(1, 2)  # [B, KV, L, D]
        vd = _gather(v_cache, g.slots).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        out[g.index] = o.reshape(b, n_heads, d)
    for start, end, slots, mask in meta.prefills:
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if slots is None:  # the chunk is the whole context so far: plain causal attention
            kp = k[start:end].transpose(0, 1).unsqueeze(0)
            vp = v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kp = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            vp = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a [B, L] index; index_select is several times faster than advanced indexing."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
