"""Random-weight models from a config alone (issue 26 item 3): built on the target device and dtype,
served by token ids, and the same network transformers builds from that config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from elastune_worker.engine.core.config import EngineConfig
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.llm_engine import LLMEngine
from elastune_worker.engine.model_runner.models.loader import load_model
from elastune_worker.modeling.random_init import (
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
    from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model

    tiny = ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    cfg = shape_config("llama-micro") | {"vocab_size": 2048}  # the tiny tokenizer's ids
    d = write_random_model(tmp_path / "m", cfg, tokenizer_from=tiny)
    eng = LLMEngine(d, EngineConfig(kv_cache_tokens=2048))
    assert len(eng.generate(["12 km →"], GREEDY)[0]) == 6


def test_unknown_shape_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama-3-8b"):
        shape_config("llama-70b")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_or_grows_it(tmp_path: Path) -> None:
    from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model

    tiny = ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    with pytest.raises(ValueError, match="2048 tokens"):
        write_random_model(tmp_path / "a", "llama-micro", tokenizer_from=tiny)
    d = write_random_model(tmp_path / "b", "llama-micro", tokenizer_from=tiny, grow_vocab=True)
    assert json.loads((d / "config.json").read_text())["vocab_size"] == 2048
    big = write_random_model(tmp_path / "c", "llama-3-8b", tokenizer_from=tiny, grow_vocab=True)
    assert json.loads((big / "config.json").read_text())["vocab_size"] == 128256  # never shrunk


def test_transformers_model_of_a_random_config_in_its_dtype_from_the_seed(tmp_path: Path) -> None:
    """The trainer's base of a random-weight directory (issue 26 item 4c): transformers' model, made in
    the target dtype, the same numbers for the same seed, no file read."""
    from elastune_worker.modeling.random_init import hf_random_model, read_random_config

    cfg = read_random_config(write_random_model(tmp_path / "m", "llama-micro", seed=4))
    assert cfg is not None and read_random_config(tmp_path) is None
    a = hf_random_model(cfg, "cpu", torch.bfloat16)
    b = hf_random_model(cfg, "cpu", torch.bfloat16)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert {p.dtype for p in pa.values()} == {torch.bfloat16} and not a.training
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    w = pa["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(pa["model.norm.weight"].float(), torch.ones(64))
    assert a.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE's table stays exact
    assert a(input_ids=torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, 512)


def test_random_lora_adapters_of_a_shape_load_in_the_engine(tmp_path: Path) -> None:
    from elastune_worker.modeling.random_init import lora_shapes, write_random_lora

    d = write_random_model(tmp_path / "m", "llama-micro")
    eng = LLMEngine(
        d, EngineConfig(kv_cache_tokens=2048, enable_lora=True, max_loras=2), tokenizer=NoTokenizer()
    )
    assert lora_shapes(SHAPES["llama-micro"]) == eng.runner.model.lora_shapes()
    plain = eng.generate([[5, 6, 7, 8]], GREEDY)[0]
    for rank in (8, 64):
        path = write_random_lora(tmp_path / f"r{rank}", "llama-micro", rank)
        cfg = json.loads((path / "adapter_config.json").read_text())
        assert cfg["r"] == rank and cfg["target_modules"] == ["q_proj", "k_proj", "v_proj"]
        eng.load_lora(f"r{rank}", str(path))
    assert eng.loras is not None and eng.loras.host.registered["r64"].rank == 64
    tuned = eng.generate([[5, 6, 7, 8]] * 2, GREEDY, ["r8", "r64"])
    assert [len(t) for t in tuned] == [6, 6] and plain  # served (random outputs: no equality to check)
    # Llama-3-8B at rank 64 on q, k, v: 32 layers x 64 x (4096 + 4096 + 2 x (4096 + 1024)) fp16.
    assert 32 * 64 * (8192 + 2 * 5120) * 2 / 2**20 == 72.0


def test_the_trainer_tunes_on_a_random_weight_directory_without_weights(tmp_path: Path) -> None:
    """Trainer(model_dir) of a random-weight directory (with the tiny tokenizer copied in): its base is
    made from the config (no *.safetensors exists to read), float32 on the CPU, and a step trains;
    ``load_base_model`` once serves several trainers (one copy of the weights)."""
    from elastune_demo import tasks as T
    from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model
    from elastune_worker.tuning.trainer import Trainer, TuningConfig, load_base_model

    tiny = ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    d = write_random_model(tmp_path / "m", "llama-micro", tokenizer_from=tiny, grow_vocab=True)
    records: list[Any] = list(T.make_task(T.TaskSpec("classify", 0), n_train=8, n_eval=0, seed=3).train)
    cfg = TuningConfig(virtual_tokens=4, batch_size=4, max_length=32, seed=0)
    base = load_base_model(d, "cpu")
    assert {p.dtype for p in base.parameters()} == {torch.float32}
    first = Trainer(d, cfg, records, [], device="cpu", base_model=base)
    second = Trainer(d, cfg, records, [], device="cpu", base_model=base)
    assert first.model.get_base_model() is second.model.get_base_model()
    assert torch.isfinite(torch.tensor(first.step(0)["loss"]))
    alone = Trainer(d, cfg, records, [], device="cpu")  # loads its own base from the config
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(
        dict(alone.model.get_base_model().named_parameters())[w], dict(base.named_parameters())[w]
    )
