"""Load an HF-format model directory (config.json + *.safetensors) into Elastune's own modules; a
config.json that asks for random weights (random_init.py) is built from the config alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from elastune_worker.engine.model_runner.models.gpt2 import GPT2Model
from elastune_worker.engine.model_runner.models.llama import LlamaModel
from elastune_worker.modeling.random_init import init_random, is_random

#: model_type of config.json -> implementation. Llama-family models share the architecture.
PagedModel = LlamaModel | GPT2Model
ARCHITECTURES: dict[str, type[PagedModel]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "gpt2": GPT2Model,
}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
log = logging.getLogger(__name__)


class UnsupportedModel(ValueError):
    pass


def read_config(path: Path) -> dict[str, Any]:
    try:
        cfg: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"{path}: no readable config.json ({exc})") from exc
    return cfg


def eos_token_ids(path: Path, cfg: dict[str, Any], tokenizer_eos: int | None) -> set[int]:
    """Every id that ends a sequence: config.json's, generation_config.json's and the tokenizer's. A chat
    model may name its end-of-turn token in only one of them (Llama-3-8B-Instruct as released: config.json
    <|end_of_text|>, generation_config.json also <|eot_id|>): reading one source runs past the turn."""
    ids: set[int] = set()
    gen_path = Path(path) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    for eos in (cfg.get("eos_token_id"), gen.get("eos_token_id"), tokenizer_eos):
        ids |= set(eos) if isinstance(eos, list) else {eos} if isinstance(eos, int) else set()
    return ids


def context_length(cfg: dict[str, Any]) -> int:
    """The longest context served. A sliding attention window (Mistral 7B v0.1: 4,096 tokens; Qwen2 with
    use_sliding_window) caps it: within the window sliding and full attention are the same, and the
    engine's attention is full (vLLM capped such models likewise before it had window kernels)."""
    native = int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window and int(window) < native:
        log.info("context capped at the model's %d-token sliding window (of %d positions)", window, native)
        return int(window)
    return native


def load_model(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[PagedModel, dict[str, Any]]:
    cfg = read_config(path)
    kind = cfg.get("model_type", "")
    impl = ARCHITECTURES.get(kind)
    if impl is None:
        raise UnsupportedModel(
            f"{path}: model_type {kind!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    try:
        with torch.device("meta"):
            model = impl(cfg)
    except ValueError as exc:  # what the config asks and the engine does not compute (rope.py)
        raise UnsupportedModel(f"{path}: {exc}") from exc
    except KeyError as exc:
        raise UnsupportedModel(f"{path}: config.json has no {exc} ({kind} needs it)") from exc
    if is_random(cfg):
        model = init_random(model, cfg, device, dtype)
        if isinstance(model, LlamaModel) and cfg.get("tie_word_embeddings", True):
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval(), cfg
    params = dict(model.named_parameters())
    stacked: dict[str, tuple[str, ...]] = getattr(impl, "STACKED", {})
    part_of = {part: (whole, i) for whole, parts in stacked.items() for i, part in enumerate(parts)}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    loaded: dict[str, torch.Tensor] = {}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path}: no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                ours = impl.remap(name)
                t = st.get_tensor(name)
                if getattr(impl, "transposed", lambda _n: False)(ours):
                    t = t.t()
                prefix, _, leaf = ours.rpartition(".")
                module, _, part = prefix.rpartition(".")
                if part in part_of:
                    whole, index = part_of[part]
                    pieces.setdefault(f"{module}.{whole}.{leaf}", {})[index] = t
                    continue
                if ours not in params:
                    raise UnsupportedModel(f"{path}: unexpected weight {name!r}")
                loaded[ours] = t.to(dtype).contiguous()
    for ours, parts in pieces.items():
        if ours not in params or len(parts) != len(stacked[ours.rsplit(".", 2)[-2]]):
            raise UnsupportedModel(f"{path}: incomplete weights for {ours}")
        loaded[ours] = torch.cat([parts[i] for i in sorted(parts)], dim=0).to(dtype).contiguous()
    tied = (
        "lm_head.weight" in params and "lm_head.weight" not in loaded and cfg.get("tie_word_embeddings", True)
    )
    if tied:
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"]
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise UnsupportedModel(f"{path}: weights missing for {', '.join(missing[:5])}")
    model.load_state_dict({k: v.to(device) for k, v in loaded.items()}, assign=True, strict=True)
    if tied:  # one tensor for both, as the checkpoint means
        model.lm_head.weight = model.embed_tokens.weight  # type: ignore[union-attr]
    return model.eval(), cfg
