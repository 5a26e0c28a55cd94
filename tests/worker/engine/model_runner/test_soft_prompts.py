"""Soft prompts served by name: a PEFT prompt-tuning artifact (what a TuningJob saves) loaded like an
adapter, its virtual tokens prepended per request; outputs equal PEFT's ``PeftModel.generate`` with that
artifact, for the tiny GPT-2 and the tiny Llama, mixed in batches with LoRA and base requests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from elastune_demo import adapters as A  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.engine.model_runner.lora.weights import AdapterError  # noqa: E402

PROMPTS = ["12 km →", "window window harbor →", "Read the record and return one value. book: Dune →"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_artifact(base: Path, out: Path, method: str, seed: int) -> Path:
    """A prompt-tuning (or p-tuning) artifact as the tuner saves it, with random virtual tokens."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    if method == "promptTuning":
        cfg: Any = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6)
    else:
        cfg = peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=5, encoder_hidden_size=32)
    pm = peft.get_peft_model(model, cfg)
    if method == "promptTuning":
        with torch.no_grad():
            emb = pm.prompt_encoder["default"].embedding.weight
            emb.copy_(torch.randn_like(emb) * 0.5)
    pm.save_pretrained(out)
    return out


def peft_reference(base: Path, artifact: Path, tok: Any, prompt: str) -> list[int]:
    """PeftModel.generate with the artifact, without the KV cache. With the cache, peft 0.21.2 on
    transformers 5.x drifts from its own forward after a few tokens (its cached steps do not count the
    virtual tokens the way its forward does); without it, generate equals a greedy loop over PeftModel's
    forward — the computation the prompt was tuned under, and what the engine serves."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    pm = peft.PeftModel.from_pretrained(model, artifact).eval()
    ids = tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = pm.generate(
            input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=8,
            do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id or tok.eos_token_id,
            use_cache=False,
        )  # fmt: skip
    return out[0, ids["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_soft_prompt_generates_what_peft_generates(arch: str, tmp_path: Path) -> None:
    base = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC if arch == "llama" else B.DEFAULT_SPEC)
    tok = transformers.AutoTokenizer.from_pretrained(base, local_files_only=True)
    soft = make_artifact(base, tmp_path / "soft", "promptTuning", 1)
    ptune = make_artifact(base, tmp_path / "ptune", "pTuning", 2)
    eng = LLMEngine(base, EngineConfig(kv_cache_tokens=8192, max_num_batched_tokens=16))  # chunked
    info = eng.load_lora("soft", str(soft))
    eng.load_lora("ptune", str(ptune))
    assert info.rank == 0 and {a.name for a in eng.list_loras()} == {"soft", "ptune"}
    prompts = PROMPTS * 3
    names: list[str | None] = [None] * 3 + ["soft"] * 3 + ["ptune"] * 3
    got = eng.generate(prompts, GREEDY, names)
    assert got[3:6] == [peft_reference(base, soft, tok, p) for p in PROMPTS]
    assert got[6:9] == [peft_reference(base, ptune, tok, p) for p in PROMPTS]
    assert got[:3] != got[3:6], "the soft prompt changed nothing"
    again = eng.generate(PROMPTS[:1], GREEDY, ["soft"])  # its virtual tokens' blocks are cached: same answer
    assert again[0] == got[3]


def test_soft_prompts_lora_and_base_requests_in_one_batch(tmp_path: Path) -> None:
    base = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    tok = transformers.AutoTokenizer.from_pretrained(base, local_files_only=True)
    soft = make_artifact(base, tmp_path / "soft", "promptTuning", 3)
    eng = LLMEngine(base, EngineConfig(kv_cache_tokens=8192, enable_lora=True))
    eng.load_lora("soft", str(soft))
    eng.load_lora("units", str(A.ensure_tiny_adapter(8)))
    got = eng.generate(PROMPTS * 3, GREEDY, [None] * 3 + ["soft"] * 3 + ["units"] * 3)
    assert got[3:6] == [peft_reference(base, soft, tok, p) for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    merged = peft.PeftModel.from_pretrained(hf, A.ensure_tiny_adapter(8)).merge_and_unload().eval()
    for p, want_lora in zip(PROMPTS, got[6:9], strict=True):
        ids = tok(p, return_tensors="pt")
        with torch.inference_mode():
            out = merged.generate(
                **ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id
            )
        assert want_lora == out[0, ids["input_ids"].shape[1] :].tolist()
    usage = []
    eng.add_request("u", PROMPTS[0], SamplingParams(max_tokens=1), adapter=eng.adapter_ref("soft"))
    while eng.has_unfinished():
        usage += [o.prompt_tokens for o in eng.step()]
    assert usage == [len(tok(PROMPTS[0])["input_ids"])]  # usage counts the user's tokens, not virtual ones


def test_prefix_tuning_and_foreign_soft_prompts_are_refused(tmp_path: Path) -> None:
    base = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    peft.get_peft_model(
        model, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    ).save_pretrained(tmp_path / "prefix")
    other = make_artifact(B.ensure_tiny_model(spec=B.DEFAULT_SPEC), tmp_path / "gpt2soft", "promptTuning", 4)
    eng = LLMEngine(base, EngineConfig(kv_cache_tokens=8192))
    with pytest.raises(AdapterError, match="key/value space"):
        eng.load_lora("prefix", str(tmp_path / "prefix"))
    gpt2_width = transformers.AutoConfig.from_pretrained(B.ensure_tiny_model(spec=B.DEFAULT_SPEC)).n_embd
    llama_width = transformers.AutoConfig.from_pretrained(base).hidden_size
    if gpt2_width != llama_width:
        with pytest.raises(AdapterError, match="another base model"):
            eng.load_lora("foreign", str(other))
    with pytest.raises(AdapterError, match="LoRA is not enabled"):
        eng.load_lora("units", str(A.ensure_tiny_adapter(8)))
