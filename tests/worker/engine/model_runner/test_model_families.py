"""The Llama-family checkpoints the loader accepts (models/loader.py ARCHITECTURES) compute what
transformers computes from the same directory: tiny random models built here by transformers itself
(config + safetensors, nothing downloaded), greedy tokens compared. Covers what a real checkpoint's
config.json asks beyond plain Llama: RoPE scaling (Llama 3.1/3.2's ``llama3``, ``linear``), Qwen2's
q/k/v biases, Mistral's sliding window, Llama 1's missing key/value head count; what the engine cannot
serve is refused by name (at load, and in one line from the worker server); end-of-sequence ids from
every file that names them; a native context longer than the KV cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from elastune_worker.engine.core.config import EngineConfig
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.llm_engine import LLMEngine
from elastune_worker.engine.model_runner.models.loader import UnsupportedModel, load_model
from elastune_worker.modeling.random_init import NoTokenizer

transformers = pytest.importorskip("transformers")

STEPS = 8
BASE = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "initializer_range": 0.3,  # peaked logits: a wrong rotation changes the greedy tokens
}  # fmt: skip
# As real checkpoints' config.json spell them (transformers 4.x keys: rope_scaling beside rope_theta).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
FAMILIES: dict[str, dict[str, Any]] = {
    "llama-3.1 rope": {"model_type": "llama", "rope_scaling": LLAMA3_ROPE},
    "linear rope": {"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "linear rope, old key": {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 4.0}},
    "qwen2": {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": None},
    "mistral": {"model_type": "mistral", "sliding_window": None, "head_dim": 16},
    "llama-1, no num_key_value_heads": {"model_type": "llama", "num_key_value_heads": None},
}


def hf_model_dir(
    path: Path, config: dict[str, Any], seed: int = 0, as_written: bool = False
) -> tuple[Path, Any]:
    """A checkpoint directory transformers writes for ``config`` with random weights; its config.json
    then replaced by ``config`` as given (hub checkpoints carry the keys of the version that wrote them),
    unless ``as_written``. Also returns transformers' model, for the reference tokens."""
    cfg = {k: v for k, v in {**BASE, **config}.items() if v is not None or k != "num_key_value_heads"}
    src = path / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(cfg))
    hf_config = transformers.AutoConfig.from_pretrained(src)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # transformers starts biases at zero: make Qwen2's matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path / "m", safe_serialization=True)
    if not as_written:
        (path / "m" / "config.json").write_text(json.dumps(cfg))
    return path / "m", model


def reference_tokens(model: Any, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", [*FAMILIES, "llama-3.1 rope, as this transformers writes it"])
def test_greedy_tokens_equal_transformers(tmp_path: Path, family: str) -> None:
    written = family.endswith("as this transformers writes it")  # 5.x: rope_parameters, theta inside
    d, hf = hf_model_dir(tmp_path, FAMILIES[family.split(",")[0] if written else family], as_written=written)
    eng = LLMEngine(d, EngineConfig(kv_cache_tokens=2048, device="cpu"), tokenizer=NoTokenizer())
    gen = torch.Generator().manual_seed(1)
    # One prompt longer than the llama3 case's original context (64), one shorter.
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (90, 7)]
    got = eng.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    assert got == [reference_tokens(hf, p) for p in prompts]


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "llama", "intermediate_size": None}, "config.json has no 'intermediate_size'"),
        (
            {
                "model_type": "gpt2",
                "n_embd": 64,
                "n_head": 4,
                "n_layer": 1,
                "n_positions": 128,
                "scale_attn_by_inverse_layer_idx": True,
            },
            "scale_attn_by_inverse_layer_idx",
        ),
    ],
)
def test_what_the_engine_cannot_compute_is_refused_by_name(tmp_path: Path, config: dict, named: str) -> None:
    d = tmp_path / "m"
    d.mkdir()
    cfg = {k: v for k, v in {**BASE, **config}.items() if v is not None}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=named):
        load_model(d, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "mistral", "sliding_window": 128, "head_dim": 16},
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1},
    ],
)
def test_a_sliding_window_caps_the_context_where_it_equals_full_attention(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    """Mistral 7B v0.1's 4,096-token window: contexts within it attend to everything, so the engine
    serves such a model with its context capped at the window instead of refusing it."""
    cfg = {**BASE, **config}
    d, hf = hf_model_dir(tmp_path, cfg)
    eng = LLMEngine(d, EngineConfig(kv_cache_tokens=2048, device="cpu"), tokenizer=NoTokenizer())
    assert eng.runner.max_model_len == 128
    prompt = torch.randint(1, 96, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    got = eng.generate([prompt], SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    assert got == [reference_tokens(hf, prompt)]


def test_every_end_of_sequence_id_the_checkpoint_names_ends_a_request(tmp_path: Path) -> None:
    """config.json, generation_config.json and the tokenizer can each name end tokens (a chat model's
    end-of-turn token is often only in the last two): any of them finishes the request."""
    d, _ = hf_model_dir(tmp_path, {"model_type": "llama", "eos_token_id": 95})
    prompt = [5, 17, 50, 3, 9]
    free = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    tokens = LLMEngine(d, EngineConfig(kv_cache_tokens=2048), tokenizer=NoTokenizer()).generate(
        [prompt], free
    )[0]
    assert 95 not in tokens[:3]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [95, tokens[2]]}))
    eng = LLMEngine(d, EngineConfig(kv_cache_tokens=2048), tokenizer=NoTokenizer())
    eng.add_request("r", prompt, SamplingParams(max_tokens=STEPS, temperature=0.0))
    outs = [o for _ in range(STEPS) for o in eng.step()]
    assert [t for o in outs for t in o.new_token_ids] == tokens[: tokens.index(tokens[2]) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"


def test_a_context_longer_than_the_kv_cache_is_capped_or_refused_at_start_up(tmp_path: Path) -> None:
    """A model whose native context (256 here; Llama 3.1's 131,072) exceeds the KV cache: capped at the
    cache, so requests are served; a max_model_len asked for that does not fit fails at start-up (the
    scheduler used to refuse every request of a ready engine)."""
    d, _ = hf_model_dir(tmp_path, {"model_type": "llama"})
    eng = LLMEngine(d, EngineConfig(kv_cache_tokens=128), tokenizer=NoTokenizer())
    assert eng.max_model_len == 128
    assert len(eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))[0]) == 4
    with pytest.raises(ValueError, match="max_model_len 200 does not fit the KV cache of 128 tokens"):
        LLMEngine(d, EngineConfig(kv_cache_tokens=128, max_model_len=200), tokenizer=NoTokenizer())


@pytest.mark.parametrize("in_thread", [True, False])
def test_the_server_says_in_one_line_why_a_model_cannot_be_served(tmp_path: Path, in_thread: bool) -> None:
    """A pod's log shows the reason, not a traceback, and the process exits 1 (engine in its own
    process: the reason crosses from it)."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "gemma"}))
    cmd = [sys.executable, "-m", "elastune_worker.engine", "--model", str(tmp_path), "--port", "0"]
    proc = subprocess.run(
        cmd + ["--engine-in-thread"] * in_thread, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the engine cannot start" in proc.stderr and "model_type 'gemma' is not supported" in proc.stderr
    assert "Traceback" not in proc.stderr
