"""Llama-family decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) over the paged KV cache."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from elastune_worker.engine.model_runner.attention import AttentionMetadata, paged_attention
from elastune_worker.engine.model_runner.fused_ops import TORCH_OPS, ElementwiseOps, LayerShape
from elastune_worker.engine.model_runner.lora.kernels import LoRABatch
from elastune_worker.engine.model_runner.models.rope import Rope


class RMSNorm(nn.Module):
    """The norm's weight and epsilon; the layers apply it with the residual add (fused_ops.py)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


def kv_heads(cfg: dict[str, Any]) -> int:
    """Key/value heads: configs from before grouped-query attention (Llama 1) have no such key."""
    return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])


class LlamaLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int = 0) -> None:
        super().__init__()
        self.index = index
        h, self.n_heads, self.n_kv = cfg["hidden_size"], cfg["num_attention_heads"], kv_heads(cfg)
        self.head_dim = cfg.get("head_dim") or h // self.n_heads
        # Qwen2 has biases on q, k and v but not o, without a config key saying so.
        o_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))
        # q, k and v projections as one matmul (the loader stacks their weights), likewise gate and up:
        # fewer, larger kernels per layer; LoRA deltas are added per slice (q, k, v; gate, up).
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=o_bias)
        inter, mlp_bias = cfg["intermediate_size"], bool(cfg.get("mlp_bias", False))
        self.intermediate = inter
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=mlp_bias)
        self.down_proj = nn.Linear(inter, h, bias=mlp_bias)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.scale = self.head_dim**-0.5
        self.ops: ElementwiseOps = TORCH_OPS

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer (or the final norm)
        adds them, in the kernel of its norm. ``residual`` None: x is the embeddings (the first layer)."""
        t, i, ops = x.shape[0], self.index, self.ops
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        qkv = self.qkv_proj(h)
        if lora is not None:
            qs, ks = self.q_size, self.q_size + self.kv_size
            lora.add(qkv[:, :qs], h, i, "q_proj")
            lora.add(qkv[:, qs:ks], h, i, "k_proj")
            lora.add(qkv[:, ks:], h, i, "v_proj")
        # RoPE also writes the step's K/V into the cache (TritonOps: in the same kernel)
        q, k, v = ops.rope(qkv, self.n_heads, self.n_kv, self.head_dim, cos, sin, (*kv, meta.slot_mapping))
        a = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, kv_written=True).reshape(t, -1)
        o = self.o_proj(a)
        if lora is not None:
            lora.add(o, a, i, "o_proj")
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(o, residual, norm.weight, norm.eps)
        gate_up = self.gate_up_proj(h)
        if lora is not None:
            lora.add(gate_up[:, : self.intermediate], h, i, "gate_proj")
            lora.add(gate_up[:, self.intermediate :], h, i, "up_proj")
        m = ops.silu_mul(gate_up, self.intermediate)
        d = self.down_proj(m)
        if lora is not None:
            lora.add(d, m, i, "down_proj")
        return d, residual

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear layer an adapter may target, by its transformers name."""
        h = self.input_layernorm.weight.shape[0]
        return {
            "q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h), "gate_proj": (h, self.intermediate),
            "up_proj": (h, self.intermediate), "down_proj": (self.intermediate, h),
        }  # fmt: skip


class LlamaModel(nn.Module):
    """Weight names follow transformers' LlamaForCausalLM (``model.layers.N.self_attn.q_proj`` ...),
    remapped by the loader."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        if cfg.get("hidden_act", "silu") != "silu":  # the MLP is SwiGLU (and the fused kernel is SiLU's)
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu)")
        self.cfg = cfg
        h = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.layers = nn.ModuleList(LlamaLayer(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, cfg.get("rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(h, cfg["vocab_size"], bias=False)
        self.n_kv_heads: int = kv_heads(cfg)
        self.head_dim: int = cfg.get("head_dim") or h // cfg["num_attention_heads"]
        self.rope = Rope.from_config(cfg)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.ops: ElementwiseOps = TORCH_OPS

    def elementwise_shape(self) -> LayerShape:
        """The widths its element-wise kernels run at (fused_ops.py compiles and checks them there)."""
        first: LlamaLayer = self.layers[0]  # type: ignore[assignment]
        h = self.cfg["hidden_size"]
        return LayerShape(h, first.n_heads, first.n_kv, first.head_dim, first.intermediate)

    def use_elementwise(self, ops: ElementwiseOps) -> None:
        """The norms, RoPE and SiLU-and-mul of every layer from ``ops`` (fused_ops.py)."""
        self.ops = ops
        for layer in self.layers:
            assert isinstance(layer, LlamaLayer)
            layer.ops = ops

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        first: LlamaLayer = self.layers[0]  # type: ignore[assignment]
        return first.lora_shapes()

    def forward(
        self,
        tokens: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoRABatch | None = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``embeds``: (rows, vectors) replacing those rows' input embeddings (soft prompts)."""
        if self._rope is None or self._rope[0].device != tokens.device:
            cos, sin = self.rope.table(self.head_dim, self.cfg["max_position_embeddings"], tokens.device)
            self._rope = (cos.to(self.embed_tokens.weight.dtype), sin.to(self.embed_tokens.weight.dtype))
        cos = self._rope[0][meta.positions]
        sin = self._rope[1][meta.positions]
        x = self.embed_tokens(tokens)
        if embeds is not None:
            x[embeds[0]] = embeds[1]
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv, meta, lora)
        rows = meta.logits_index
        x, _ = self.ops.add_rms_norm(
            x[rows], None if residual is None else residual[rows], self.norm.weight, self.norm.eps
        )
        return self.lm_head(x)

    #: Checkpoint weights stacked into one of this module's parameters: (its name, slice order).
    STACKED: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    @staticmethod
    def remap(name: str) -> str:
        """transformers' parameter name -> this module's (a stacked slice keeps its own name here)."""
        name = name.removeprefix("model.")
        for old, new in (("self_attn.", ""), ("mlp.", "")):
            name = name.replace(old, new)
        return name
