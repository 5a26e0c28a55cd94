"""Models of a real size without a download: a config.json alone, random weights made on the device.

For throughput measurement (issue 26): an 8B-parameter Llama is 16 GB of bf16 that nobody can fetch
here. A directory whose config.json carries ``"elastune_random_weights": true`` is built from that
config with every weight drawn on the target device in the target dtype (the module is made on the
meta device, so nothing is materialised on the CPU; one ``normal_`` per tensor). Its outputs are
meaningless: benchmarks force lengths with ``ignore_eos``. ``write_random_model`` writes such a
directory for a named shape or a config, with a tokenizer copied from another model if asked (a
random-weight directory without one serves token ids only: pass ``NoTokenizer()`` to the engine).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

RANDOM_WEIGHTS_KEY = "elastune_random_weights"
"""config.json key that asks for random weights (no *.safetensors is read)."""
RANDOM_SEED_KEY = "elastune_random_seed"

SHAPES: dict[str, dict[str, Any]] = {
    # Meta-Llama-3-8B's published config.json (architecture fields only).
    "llama-3-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    # The same family at a size a CPU runs in milliseconds (smoke runs and tests).
    "llama-micro": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 160, "vocab_size": 512, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    },
}  # fmt: skip

M = TypeVar("M", bound=nn.Module)

_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model",
)  # fmt: skip


def is_random(cfg: dict[str, Any]) -> bool:
    return bool(cfg.get(RANDOM_WEIGHTS_KEY))


def shape_config(shape: str | dict[str, Any]) -> dict[str, Any]:
    """A named shape's config (a copy), or the given config; ValueError naming the known shapes."""
    if isinstance(shape, dict):
        return dict(shape)
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r} (known: {', '.join(SHAPES)})")
    return dict(SHAPES[shape])


def write_random_model(
    dest: Path, shape: str | dict[str, Any], *, seed: int = 0, tokenizer_from: Path | None = None
) -> Path:
    """Write ``dest/config.json`` asking for random weights of ``shape`` (a name in SHAPES or a config),
    and the tokenizer files of ``tokenizer_from`` if given (its ids must fit the shape's vocabulary)."""
    cfg = shape_config(shape)
    cfg[RANDOM_WEIGHTS_KEY] = True
    cfg[RANDOM_SEED_KEY] = seed
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.safetensors"):  # the weights are random: none may be read
        stale.unlink()
    if tokenizer_from is not None:
        for name in _TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).exists():
                shutil.copyfile(Path(tokenizer_from) / name, dest / name)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dest


def init_random(model: M, cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> M:
    """``model`` built on the meta device -> the same module with storage on ``device`` in ``dtype``:
    matrices ~ N(0, initializer_range), norm scales 1, biases 0 (as transformers initialises)."""
    if any(True for _ in model.buffers()):
        raise ValueError("random weights: the module has buffers, which random init would leave unset")
    model = model.to(dtype=dtype).to_empty(device=device)  # meta -> uninitialised device storage
    std = float(cfg.get("initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(int(cfg.get(RANDOM_SEED_KEY, 0)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:  # RMSNorm / LayerNorm scales
                p.fill_(1.0)
    return model


class NoTokenizer:
    """The engine's tokenizer for a model served by token ids only (a random-weight model without
    tokenizer files): text prompts are refused; outputs carry token ids and no text."""

    eos_token_id = None

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        raise ValueError("this model has no tokenizer: send the prompt as token ids")

    def decode(self, ids: list[int], **_: Any) -> str:
        return ""
