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
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] cache slot of every token of the step."""
    positions: torch.Tensor
    """[T] position of every token in its sequence."""
    logits_index: torch.Tensor
    """Rows of the flat batch whose logits are sampled (each sequence's last scheduled token)."""
    decode_index: torch.Tensor | None = None
    """[B] rows of the decodes (one token each)."""
    decode_slots: torch.Tensor | None = None
    """[B, L] cache slots of each decode's context, padded."""
    decode_mask: torch.Tensor | None = None
    """[B, 1, 1, L] True where a decode's key is real."""
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
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    if meta.decode_index is not None:
        assert meta.decode_slots is not None
        qd = q[meta.decode_index].unsqueeze(2)  # [B, H, 1, D]
        kd = _heads(k_cache[meta.decode_slots], rep)  # [B, H, L, D]
        vd = _heads(v_cache[meta.decode_slots], rep)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[meta.decode_index] = o.squeeze(2)
    for start, end, slots, mask in meta.prefills:
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if slots is None:  # the chunk is the whole context so far: plain causal attention
            kp = _heads(k[start:end].unsqueeze(0), rep)
            vp = _heads(v[start:end].unsqueeze(0), rep)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
        else:
            kp = _heads(k_cache[slots].unsqueeze(0), rep)
            vp = _heads(v_cache[slots].unsqueeze(0), rep)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, L, KV, D] -> [B, KV*rep, L, D] (grouped-query attention shares each K/V head)."""
    x = x.transpose(1, 2)
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x
