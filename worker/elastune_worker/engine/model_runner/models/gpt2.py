"""GPT-2 (learned positions, LayerNorm, GELU MLP, fused QKV) over the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastune_worker.engine.model_runner.attention import AttentionMetadata, paged_attention


class GPT2Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        e, self.n_heads = cfg["n_embd"], cfg["n_head"]
        self.head_dim = e // self.n_heads
        eps = cfg.get("layer_norm_epsilon", 1e-5)
        inner = cfg.get("n_inner") or 4 * e
        self.ln_1 = nn.LayerNorm(e, eps=eps)
        self.c_attn = nn.Linear(e, 3 * e)
        self.attn_proj = nn.Linear(e, e)
        self.ln_2 = nn.LayerNorm(e, eps=eps)
        self.c_fc = nn.Linear(e, inner)
        self.mlp_proj = nn.Linear(inner, e)
        if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported GPT-2 activation {cfg.get('activation_function')!r}")
        self.approximate = "none" if cfg.get("activation_function") == "gelu" else "tanh"
        self.scale = self.head_dim**-0.5 if cfg.get("scale_attn_weights", True) else 1.0
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError("scale_attn_by_inverse_layer_idx is not supported")

    def forward(
        self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.c_attn(self.ln_1(x)).view(t, 3, self.n_heads, self.head_dim).unbind(1)
        a = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        x = x + self.attn_proj(a.reshape(t, -1))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate=self.approximate))


class GPT2Model(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        e = cfg["n_embd"]
        self.wte = nn.Embedding(cfg["vocab_size"], e)
        self.wpe = nn.Embedding(cfg["n_positions"], e)
        self.h = nn.ModuleList(GPT2Layer(cfg) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(e, eps=cfg.get("layer_norm_epsilon", 1e-5))
        self.n_kv_heads: int = cfg["n_head"]
        self.head_dim: int = e // cfg["n_head"]

    @property
    def num_layers(self) -> int:
        return len(self.h)

    def forward(
        self,
        tokens: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: object = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``lora`` must be None: adapters need a Llama-family model (so does vLLM's LoRA). ``embeds``:
        (rows, vectors) replacing those rows' token embeddings (soft prompts), before positions."""
        x = self.wte(tokens)
        if embeds is not None:
            x[embeds[0]] = embeds[1]
        x = x + self.wpe(meta.positions)
        for layer, kv in zip(self.h, kv_caches, strict=True):
            x = layer(x, kv, meta)
        return F.linear(self.ln_f(x[meta.logits_index]), self.wte.weight)  # tied output embedding

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        return {}  # no LoRA on GPT-2 (vLLM's GPT-2 has none either)

    @staticmethod
    def remap(name: str) -> str:
        name = name.removeprefix("transformer.")
        return (
            name.replace("attn.c_attn", "c_attn")
            .replace("attn.c_proj", "attn_proj")
            .replace("mlp.c_fc", "c_fc")
            .replace("mlp.c_proj", "mlp_proj")
        )

    @staticmethod
    def transposed(name: str) -> bool:
        """GPT-2's Conv1D stores [in, out]; nn.Linear wants [out, in]."""
        return name.endswith(".weight") and any(
            k in name for k in ("c_attn", "attn_proj", "c_fc", "mlp_proj")
        )
