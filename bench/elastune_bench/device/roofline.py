"""The physical bounds the engine is judged against, from a Llama-family config alone.

A decode step reads every weight once (the input embedding only for its B rows: left out) and the K/V
of every context token of the batch; it cannot take less than those bytes over the copy bandwidth. A
prefill cannot take less than its FLOPs (2 per weight per token in the matrix products, the causal
attention's QK^T and PV, and the output head for the one sampled row) over the bf16 matrix rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> Shape:
        h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return cls(
            hidden=h, layers=int(cfg["num_hidden_layers"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or h // heads), intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
        )  # fmt: skip

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embeddings + self.hidden

    def weight_bytes_per_step(self, dtype_bytes: int) -> int:
        """Weights a decode step reads: all but the input embedding table (unless tied to the head)."""
        unread = 0 if self.tied else self.vocab * self.hidden
        return (self.params - unread) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def decode_step_bound_s(
        self, batch: int, mean_context: float, dtype_bytes: int, bytes_per_s: float
    ) -> float:
        kv = batch * mean_context * self.kv_bytes_per_token(dtype_bytes)
        return (self.weight_bytes_per_step(dtype_bytes) + kv) / bytes_per_s

    def prefill_flops(self, prompt_len: int) -> float:
        """One prompt's FLOPs: layer matrix products, causal attention, the head for its last row."""
        n = prompt_len
        matmul = 2 * self.layers * (self.layer_params - 2 * self.hidden) * n
        attention = 2 * 2 * self.layers * self.heads * self.head_dim * n * (n + 1) / 2
        return matmul + attention + 2 * self.vocab * self.hidden
