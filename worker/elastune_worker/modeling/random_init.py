"""Models of a real size without a download: a config.json alone, random weights made on the device.

For throughput measurement (issue 26): an 8B-parameter Llama is 16 GB of bf16 that nobody can fetch
here. A directory whose config.json carries ``"elastune_random_weights": true`` is built from that
config with every weight drawn on the target device in the target dtype (the module is made on the
meta device, so nothing is materialised on the CPU; one ``normal_`` per tensor). Its outputs are
meaningless: benchmarks force lengths with ``ignore_eos``. ``write_random_model`` writes such a
directory for a named shape or a config, with a tokenizer copied from another model if asked (a
random-weight directory without one serves token ids only: pass ``NoTokenizer()`` to the engine).

The same directory also gives transformers' model of that config with random weights
(``hf_random_model``: the trainer's base for benchmarks of tuning and co-serving at a real size) and
LoRA adapters of the shape with random weights in PEFT's format (``write_random_lora``: the multi-LoRA
benchmark's host-to-device copies at their real size).
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
    dest: Path,
    shape: str | dict[str, Any],
    *,
    seed: int = 0,
    tokenizer_from: Path | None = None,
    grow_vocab: bool = False,
) -> Path:
    """Write ``dest/config.json`` asking for random weights of ``shape`` (a name in SHAPES or a config),
    and the tokenizer files of ``tokenizer_from`` if given. Its ids must fit the shape's vocabulary:
    ValueError if they do not, unless ``grow_vocab`` raises the vocabulary to the tokenizer's (a micro
    shape with the tiny models' 2,048-token tokenizer)."""
    cfg = shape_config(shape)
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(str(tokenizer_from), local_files_only=True))
        if size > int(cfg["vocab_size"]):
            if not grow_vocab:
                raise ValueError(
                    f"the tokenizer of {tokenizer_from} has {size} tokens, the shape's vocabulary "
                    f"{cfg['vocab_size']} (grow_vocab=True raises it)"
                )
            cfg["vocab_size"] = size
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
    _draw(model, cfg, device)
    return model


def _draw(model: nn.Module, cfg: dict[str, Any], device: torch.device) -> None:
    """Every parameter drawn from the config's seed, one ``normal_`` per matrix on ``device``."""
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


def read_random_config(model_dir: Path) -> dict[str, Any] | None:
    """``model_dir``'s config.json if it asks for random weights, else None (a model with weights)."""
    try:
        cfg: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if is_random(cfg) else None


def hf_random_model(cfg: dict[str, Any], device: torch.device | str, dtype: torch.dtype) -> Any:
    """transformers' model of the random-weight config ``cfg`` (AutoModelForCausalLM), made on
    ``device`` in ``dtype`` (no copy in another dtype or on the CPU first: an 8B model is 15 GiB of
    bf16 on the GPU), its weights drawn from the config's seed as ``init_random`` draws ours (the
    distribution, not the same numbers: the modules differ); in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    ours = {RANDOM_WEIGHTS_KEY, RANDOM_SEED_KEY, "torch_dtype", "dtype", "model_type"}
    config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k not in ours})
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the target dtype on the device (transformers' own init)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(before)
    _draw(model, cfg, device)  # (buffers made in float32 on purpose, RoPE's inv_freq, stay float32)
    return model.eval()


LORA_QKV = ("q_proj", "k_proj", "v_proj")


def lora_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of a Llama-family config an adapter may target."""
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or h // heads)
    q, kv = heads * head_dim, int(cfg.get("num_key_value_heads") or heads) * head_dim
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip


def write_random_lora(
    dest: Path,
    shape: str | dict[str, Any],
    rank: int,
    *,
    targets: tuple[str, ...] = LORA_QKV,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """A LoRA adapter of ``shape`` (a name in SHAPES or a config) with random weights, as PEFT's
    ``save_pretrained`` writes one (adapter_config.json + adapter_model.safetensors, in ``dtype``):
    rank ``rank`` on ``targets`` of every decoder layer, lora_alpha = 2 x rank. A ~ N(0, 1/in), B ~
    N(0, 0.01²) (PEFT starts B at zero, which would make the adapter a no-op). Rank 64 on q, k, v of
    Llama-3-8B is 75 MiB of fp16."""
    from safetensors.torch import save_file

    cfg = shape_config(shape)
    shapes = lora_shapes(cfg)
    unknown = set(targets) - set(shapes)
    if unknown:
        raise ValueError(f"LoRA targets {sorted(unknown)} are not linear layers of a Llama (known: {shapes})")
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for t in targets:
            fan_in, fan_out = shapes[t]
            block = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{t}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(dtype)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets), "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": None,
    }  # fmt: skip
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


class NoTokenizer:
    """The engine's tokenizer for a model served by token ids only (a random-weight model without
    tokenizer files): text prompts are refused; outputs carry token ids and no text."""

    eos_token_id = None

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        raise ValueError("this model has no tokenizer: send the prompt as token ids")

    def decode(self, ids: list[int], **_: Any) -> str:
        return ""
