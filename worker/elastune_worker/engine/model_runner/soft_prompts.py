"""Soft prompts served by name: a TuningJob's promptTuning (or pTuning) artifact — a PEFT
``save_pretrained`` directory whose ``prompt_embeddings`` are its virtual tokens' input embeddings —
prepended to each request that names it, as PEFT's ``PeftModel`` does at generation.

A request with soft prompt S of n virtual tokens runs as n placeholder tokens followed by its prompt;
the model runner replaces the placeholders' input embeddings with S's rows (positions 0..n-1, like
PEFT). Its prefix-cache blocks are keyed by the soft prompt's name, so placeholders never match
another request's tokens. Prefix tuning keeps its virtual tokens in key/value space, not in the input
embeddings: it is refused with that reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from elastune_worker.engine.model_runner.lora.weights import (
    AdapterError,
    read_adapter_config,
    read_safetensors,
)

SOFT_PROMPT_TYPES = ("PROMPT_TUNING", "P_TUNING")
PLACEHOLDER_TOKEN = 0
"""The token id standing for a virtual token in a sequence (its embedding is replaced)."""


@dataclass
class SoftPrompt:
    name: str
    path: str
    embeddings: torch.Tensor
    """(virtual tokens, hidden size), on the model's device and dtype."""
    load_seconds: float = 0.0

    @property
    def num_virtual_tokens(self) -> int:
        return int(self.embeddings.shape[0])


def is_prompt_learning(path: str | Path) -> bool:
    """A prompt-learning artifact (the three TuningJob methods), not a LoRA adapter."""
    return read_adapter_config(Path(path)).get("peft_type") in (*SOFT_PROMPT_TYPES, "PREFIX_TUNING")


def load_soft_prompt(
    name: str, path: str | Path, hidden_size: int, device: torch.device, dtype: torch.dtype
) -> SoftPrompt:
    from safetensors.torch import load_file

    started = time.perf_counter()
    root = Path(path)
    cfg = read_adapter_config(root)
    kind = cfg.get("peft_type")
    if kind == "PREFIX_TUNING":
        raise AdapterError(
            f"{name}: prefix tuning lives in key/value space and cannot be served as a soft prompt"
        )
    if kind not in SOFT_PROMPT_TYPES:
        raise AdapterError(
            f"{name}: peft_type {kind!r} is not a soft prompt ({', '.join(SOFT_PROMPT_TYPES)})"
        )
    weights = root / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterError(f"{name}: {root} has no adapter_model.safetensors")
    emb = read_safetensors(name, weights, load_file).get("prompt_embeddings")
    if emb is None or emb.ndim != 2:
        raise AdapterError(f"{name}: no 2-D prompt_embeddings tensor in {weights}")
    if int(cfg.get("num_transformer_submodules") or 1) != 1:  # type: ignore[call-overload]
        raise AdapterError(f"{name}: encoder-decoder soft prompts are not supported")
    if not emb.is_floating_point() or not bool(emb.float().isfinite().all()):
        raise AdapterError(f"{name}: prompt_embeddings has values that are not finite (NaN or Inf)")
    if emb.shape[1] != hidden_size:
        raise AdapterError(
            f"{name}: prompt embeddings of width {emb.shape[1]}, this base model's is {hidden_size}: "
            "a soft prompt of another base model?"
        )
    return SoftPrompt(name, str(root), emb.to(device, dtype), time.perf_counter() - started)
