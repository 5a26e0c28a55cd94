"""Random-weight models from a config alone (issue 26 item 3): built on the target device and dtype,
served by token ids, and the same network transformers builds from that config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastune_batching.sampling import SamplingParams
from elastune_worker.serving.config import EngineConfig
from elastune_worker.serving.core.engine import LLMEngine
from elastune_worker.serving.runner.models.loader import load_model
from elastune_worker.serving.runner.models.random_init import (
    SHAPES,
    NoTokenizer,
    shape_config,
    write_random_model,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_random_model_serves_token_ids_at_fixed_lengths(tmp_path: Path) -> None:
    d = write_random_model(tmp_path / "m", "llama-micro")
    assert not list(d.glob("*.safetensors"))
    eng = LLMEngine(d, EngineConfig(kv_cache_tokens=2048), tokenizer=NoTokenizer())
    out = eng.generate([[3] * 40, [7, 8, 9]], GREEDY)
    assert [len(o) for o in out] == [6, 6]
    assert all(0 <= t < SHAPES["llama-micro"]["vocab_size"] for o in out for t in o)
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.add_request("text", "a text prompt", GREEDY)


def test_weights_are_made_in_the_target_dtype_from_the_seed(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    a, _ = load_model(write_random_model(tmp_path / "a", "llama-micro", seed=1), cpu, torch.bfloat16)
    b, _ = load_model(write_random_model(tmp_path / "b", "llama-micro", seed=1), cpu, torch.bfloat16)
    c, _ = load_model(write_random_model(tmp_path / "c", "llama-micro", seed=2), cpu, torch.bfloat16)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert {p.dtype for p in pa.values()} == {torch.bfloat16}
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    w = pa["layers.0.qkv_proj.weight"].float()
    assert not torch.equal(w, pc["layers.0.qkv_proj.weight"].float())
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(pa["norm.weight"].float(), torch.ones(64))
    assert pa["lm_head.weight"].data_ptr() != pa["embed_tokens.weight"].data_ptr()  # not tied in this shape


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    cfg = shape_config("llama-micro") | {"tie_word_embeddings": True}
    m, _ = load_model(write_random_model(tmp_path / "t", cfg), torch.device("cpu"), torch.float32)
    assert m.lm_head.weight is m.embed_tokens.weight  # type: ignore[union-attr]


def test_the_same_network_transformers_builds_from_the_config(tmp_path: Path) -> None:
    """Our weights copied into transformers' LlamaForCausalLM of the same config.json: greedy tokens
    equal (the shape's RoPE, GQA and norm settings are read the same way)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = write_random_model(tmp_path / "m", "llama-micro", seed=3)
    eng = LLMEngine(d, EngineConfig(kv_cache_tokens=2048), tokenizer=NoTokenizer())
    ours = dict(eng.runner.model.named_parameters())
    cfg = json.loads((d / "config.json").read_text())
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    q, kv, inter = 64, 2 * 16, cfg["intermediate_size"]
    state = {"lm_head.weight": ours["lm_head.weight"]}
    state |= {f"model.{n}": ours[n] for n in ("embed_tokens.weight", "norm.weight")}
    for i in range(cfg["num_hidden_layers"]):
        theirs, mine = f"model.layers.{i}.", f"layers.{i}."
        wq, wk, wv = ours[mine + "qkv_proj.weight"].split((q, kv, kv))
        gate, up = ours[mine + "gate_up_proj.weight"].split((inter, inter))
        parts = {"self_attn.q_proj": wq, "self_attn.k_proj": wk, "self_attn.v_proj": wv,
                 "self_attn.o_proj": ours[mine + "o_proj.weight"], "mlp.gate_proj": gate, "mlp.up_proj": up,
                 "mlp.down_proj": ours[mine + "down_proj.weight"]}  # fmt: skip
        for norm in ("input_layernorm", "post_attention_layernorm"):
            parts[norm] = ours[f"{mine}{norm}.weight"]
        state |= {f"{theirs}{name}.weight": w for name, w in parts.items()}
    hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    prompt = [5, 17, 250, 3, 99, 42, 7, 300]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert eng.generate([prompt], GREEDY)[0] == expected[0, len(prompt) :].tolist()


def test_a_tokenizer_copied_from_another_model_serves_text(tmp_path: Path) -> None:
    from elastune_worker.tiny.build import TINY_LLAMA_SPEC, ensure_tiny_model

    tiny = ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    cfg = shape_config("llama-micro") | {"vocab_size": 2048}  # the tiny tokenizer's ids
    d = write_random_model(tmp_path / "m", cfg, tokenizer_from=tiny)
    eng = LLMEngine(d, EngineConfig(kv_cache_tokens=2048))
    assert len(eng.generate(["12 km →"], GREEDY)[0]) == 6


def test_unknown_shape_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama-3-8b"):
        shape_config("llama-70b")
