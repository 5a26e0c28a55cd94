"""One LoRA adapter read from a PEFT ``save_pretrained`` directory into host memory, checked against
the base model: LoRA only (no DoRA, no bias, no modules_to_save), targets among the decoder's linear
layers, shapes that fit the base model's, rank within the engine's maximum."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: The decoder's linear layers an adapter may target, by PEFT's (transformers') module name.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """The adapter cannot serve on this base model (the message says why): the client's 400."""


@dataclass
class LoRAWeights:
    name: str
    path: str
    rank: int
    scaling: float
    """lora_alpha / r (PEFT's default scaling; rsLoRA's alpha / sqrt(r) when use_rslora)."""
    a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    """(layer, target) → A, shape (rank, in_features), float32 on the host."""
    b_t: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    """(layer, target) → (B × scaling)ᵀ, shape (rank, out_features): peft's lora_B transposed once at
    load, the layout of the device slots (slots.py), so that a load to the device is a plain copy."""
    load_seconds: float = 0.0
    staged: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """CUDA: (A, (B × scaling)ᵀ) in the device's dtype in pinned (page-locked) host memory, made at the
    first copy to the device and kept while the host tier keeps the adapter. A copy from pageable memory
    goes through a driver bounce buffer and returns only when the data is staged, so the engine thread
    would wait for every adapter load; from pinned memory it is queued on the copy stream and the step
    goes on (CaraServe's load overlapped with the CPU path)."""

    def staging(self, dtype: torch.dtype) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The pinned copies in ``dtype`` (made now if missing; one conversion per adapter, not per load)."""
        if not self.staged or next(iter(self.staged.values()))[0].dtype != dtype:
            self.staged = {
                k: (self.a[k].to(dtype).pin_memory(), self.b_t[k].to(dtype).pin_memory()) for k in self.a
            }
        return self.staged

    @property
    def targets(self) -> set[str]:
        return {t for _, t in self.a}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b_t.values()))


def read_adapter_config(path: Path) -> dict[str, object]:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise AdapterError(f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file} is not a JSON object")
    return cfg


def load_lora(
    name: str, path: str | Path, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int
) -> LoRAWeights:
    """``shapes``: target → (in_features, out_features) of the base model's layer."""
    from safetensors.torch import load_file

    started = time.perf_counter()
    root = Path(path)
    cfg = read_adapter_config(root)
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(
            f"{name}: peft_type {cfg.get('peft_type')!r} is not LORA (a soft prompt is served as one)"
        )
    for key, bad in (("use_dora", True), ("bias", "all"), ("bias", "lora_only"), ("lora_bias", True)):
        if cfg.get(key) == bad:
            raise AdapterError(f"{name}: {key}={bad!r} is not supported (plain LoRA only)")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{name}: modules_to_save is not supported")
    rank = int(cfg.get("r", 0))  # type: ignore[call-overload]
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"{name}: rank {rank} is outside 1..{max_rank} (the engine's max LoRA rank)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"{name}: per-module ranks (rank_pattern/alpha_pattern) are not supported")
    alpha = float(cfg.get("lora_alpha", rank))  # type: ignore[arg-type]
    if not math.isfinite(alpha):
        raise AdapterError(f"{name}: lora_alpha {alpha} is not a finite number")
    scaling = alpha / (rank**0.5) if cfg.get("use_rslora") else alpha / rank
    files = [root / "adapter_model.safetensors"]
    if not files[0].is_file():
        raise AdapterError(f"{name}: {root} has no adapter_model.safetensors")
    tensors = read_safetensors(name, files[0], load_file)
    w = LoRAWeights(name=name, path=str(root), rank=rank, scaling=scaling)
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(
                f"{name}: tensor {key} is not a Llama-family decoder's linear layer: an adapter of another "
                "base model?"
            )
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS or target not in shapes:
            raise AdapterError(
                f"{name}: target {target} is not supported on this model ({', '.join(shapes)})"
            )
        if layer >= num_layers:
            raise AdapterError(f"{name}: layer {layer} does not exist (the base model has {num_layers})")
        fan_in, fan_out = shapes[target]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(
                f"{name}: {key} has shape {tuple(tensor.shape)}, this base model needs {want}: "
                "an adapter of another base model?"
            )
        if not tensor.is_floating_point() or not bool(tensor.float().isfinite().all()):
            raise AdapterError(
                f"{name}: {key} has values that are not finite (NaN or Inf)"
                if tensor.is_floating_point()
                else f"{name}: {key} is not a floating-point tensor ({tensor.dtype})"
            )
        if which == "A":
            w.a[(layer, target)] = tensor.float().contiguous()
        else:
            w.b_t[(layer, target)] = (tensor.float() * scaling).T.contiguous()
    if set(w.a) != set(w.b_t) or not w.a:
        raise AdapterError(f"{name}: lora_A and lora_B tensors do not pair up")
    _probe(w)
    w.load_seconds = time.perf_counter() - started
    return w


def read_safetensors(name: str, path: Path, load_file: Callable[[str], dict[str, torch.Tensor]]) -> dict:
    """The tensors of an adapter file; a file safetensors cannot read (truncated, not safetensors at all)
    is the adapter's fault, named as such (it reached clients as a 500 SafetensorError)."""
    try:
        return load_file(str(path))
    except Exception as exc:  # SafetensorError, OSError, a header that is not JSON, ...
        raise AdapterError(f"{name}: {path.name} is not a readable safetensors file ({exc})") from exc


def _probe(w: LoRAWeights) -> None:
    """Refuse an adapter whose delta overflows: finite weights whose product is not (A·B of 1e20s). Its
    requests would decode from NaN/inf logits. The probe is a unit input per element, the scale of a
    normalized hidden state, through every (layer, target) pair, in float32."""
    for key, a in w.a.items():
        delta = torch.ones(1, a.shape[1]) @ a.T @ w.b_t[key]
        if not bool(delta.isfinite().all()):
            layer, target = key
            raise AdapterError(
                f"{w.name}: its output is not finite on a probe input (layer {layer}, {target}): the "
                "weights are finite but their product overflows"
            )
