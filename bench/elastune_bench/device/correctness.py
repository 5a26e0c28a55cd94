"""Part a: correctness on the device. Greedy tokens of the engine equal transformers' for the tiny
Llama and GPT-2 (fp32); LoRA with both kernels equals peft's merged models on a mixed batch of ranks
and the base; a soft prompt equals peft's PeftModel; each attention backend equals the gather
reference (tokens, and logits within fp32 tolerance) on a mixed batch (decodes of different lengths,
prefill chunks over a cached prefix, GQA); the fused element-wise kernels equal the torch ops (each
op, and the engine's tokens and logits); CUDA graphs on and off give the same tokens, with and
without LoRA. A check the build lacks is recorded as not available; a failing check records its error
and the others still run."""

from __future__ import annotations

import dataclasses
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elastune_bench.device.common import (
    NOT_AVAILABLE,
    device_info,
    engine_features,
    part_args,
    sizes,
    write_part,
)

PROMPTS = ["198 km →", "window window harbor →", "1907-02-28 →", "age: 64; city: rome; name: dara →"]
NEW_TOKENS = 12


def engine(model: Path, device: str, **options: Any) -> Any:
    """A float32 engine with an explicit KV cache; options this build lacks are dropped by the caller."""
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.llm_engine import LLMEngine

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    base: dict[str, Any] = {"device": device, "dtype": "float32", "num_kv_blocks": 1024, "max_num_seqs": 32}
    if "cuda_graph_max_batch" in fields:
        base["cuda_graph_max_batch"] = 16  # a short capture ladder: these engines are many and small
    return LLMEngine(model, EngineConfig(**(base | options)))


def greedy(n: int = NEW_TOKENS) -> Any:
    from elastune_worker.engine.core.sampling import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def hf_greedy(model: Any, tok: Any, prompt: str, device: str, n: int = NEW_TOKENS, **kw: Any) -> list[int]:
    ids = tok(prompt, return_tensors="pt").to(device)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id, **kw)  # fmt: skip
    return list(out[0, ids["input_ids"].shape[1] :].tolist())


def hf_model(path: Path, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model.to(device).eval()


def check_hf(arch: str, device: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from elastune_demo import build as B

    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC if arch == "llama" else B.DEFAULT_SPEC)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    got = engine(path, device).generate(PROMPTS, greedy())
    want = [hf_greedy(hf_model(path, device), tok, p, device) for p in PROMPTS]
    return {
        "ok": got == want,
        "requests": len(PROMPTS),
        "tokens": NEW_TOKENS,
        "engine": got,
        "transformers": want,
    }


def check_lora(kernel: str, device: str, **options: Any) -> dict[str, Any]:
    from peft import PeftModel
    from transformers import AutoTokenizer

    from elastune_demo import adapters as A
    from elastune_demo import build as B

    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ranks = (8, 64)
    eng = engine(path, device, enable_lora=True, max_loras=4, lora_kernel=kernel, **options)
    for r in ranks:
        eng.load_lora(f"r{r}", str(A.ensure_tiny_adapter(r)))
    names: list[str | None] = [None, "r8", "r64"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    got = eng.generate(prompts, greedy(), loras)
    refs: dict[str | None, Any] = {None: hf_model(path, device)}
    for r in ranks:
        refs[f"r{r}"] = PeftModel.from_pretrained(
            hf_model(path, device), A.ensure_tiny_adapter(r)
        ).merge_and_unload()
    want = [hf_greedy(refs[n], tok, p, device) for p, n in zip(prompts, loras, strict=True)]
    return {
        "ok": got == want,
        "kernel": kernel,
        "lora_backend": getattr(eng.runner, "lora_backend", "torch"),
        "requests": len(prompts),
        "mismatched": sum(a != b for a, b in zip(got, want, strict=True)),
    }


def check_soft_prompt(device: str) -> dict[str, Any]:
    from peft import PeftModel, PromptTuningConfig, get_peft_model
    from transformers import AutoTokenizer

    from elastune_demo import build as B

    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(1)
        pm: Any = get_peft_model(
            hf_model(path, "cpu"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6)
        )
        with torch.no_grad():
            emb = pm.prompt_encoder["default"].embedding.weight
            emb.copy_(torch.randn_like(emb) * 0.5)
        pm.save_pretrained(tmp)
        eng = engine(path, device)
        eng.load_lora("soft", tmp)
        got = eng.generate(PROMPTS, greedy(8), ["soft"] * len(PROMPTS))
        ref = PeftModel.from_pretrained(hf_model(path, device), tmp).eval()
        # without peft's KV cache: with it, peft drifts from its own forward (tests/.../test_soft_prompts)
        want = [hf_greedy(ref, tok, p, device, 8, use_cache=False) for p in PROMPTS]
    return {"ok": got == want, "requests": len(PROMPTS), "engine": got, "peft": want}


def mixed_batch(eng: Any) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Tokens of a mixed batch — decodes of different lengths beside prefill chunks (a 64-token budget
    splits prompts), a second round that prefills over the first round's cached prefixes — and the
    logits of every step of a third round. (Every step here has a decode or a prompt's last chunk:
    a step of only mid-prompt chunks fails in the engine today, see the report of issue 26.)"""
    gen = torch.Generator().manual_seed(0)
    vocab = eng.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 40, 17, 90, 33)]
    first = eng.generate(prompts, greedy(10))
    again = eng.generate([p + [7, 8, 9] * 7 for p in prompts], greedy(10))  # cached prefix + new chunk
    logits: list[torch.Tensor] = []
    forward = eng.runner.forward

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        logits.append(out[0].float().cpu())
        return out

    eng.runner.forward = recorded  # every step of the third round (eager: no graphs in these engines)
    third = eng.generate([p[::-1] + p for p in prompts], greedy(6))
    return first + again + third, logits


def check_attention(backend: str, device: str) -> dict[str, Any]:
    return same_mixed_batch(device, "attention_backend", backend, "gather")


def same_mixed_batch(device: str, option: str, value: str, reference: str) -> dict[str, Any]:
    """The mixed batch's tokens and every step's logits with ``option`` = ``value`` against
    ``reference`` (eager steps: the option alone, in every step)."""
    from elastune_demo import build as B

    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)  # 4 query heads over 2 KV heads (GQA)
    opts: dict[str, Any] = {"max_num_batched_tokens": 64, "enable_prefix_caching": True}
    if engine_features()["cuda_graphs"]:
        opts["cuda_graphs"] = False
    ref_tokens, ref_logits = mixed_batch(engine(path, device, **{option: reference}, **opts))
    tokens, logits = mixed_batch(engine(path, device, **{option: value}, **opts))
    diff = max((float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True)), default=0.0)
    same_steps = len(logits) == len(ref_logits)
    return {"ok": tokens == ref_tokens and same_steps and diff < 1e-3, option: value,
            "tokens_equal": tokens == ref_tokens, "max_logit_diff": diff, "steps": len(logits)}  # fmt: skip


def check_elementwise(device: str) -> dict[str, Any]:
    """The fused norm, RoPE and SiLU-and-mul kernels against the torch ops: each op on a random input in
    float32 and bfloat16 (the largest difference, and the share of elements that differ: compiled,
    bfloat16 rounds to nearest as torch does, so few should), then the engine's mixed batch in float32."""
    from elastune_worker.engine.model_runner import fused_ops

    LLAMA_3_8B = fused_ops.LayerShape(hidden=4096, n_heads=32, n_kv=8, head_dim=128, intermediate=14_336)
    ops: dict[str, Any] = {}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for name, (got, want) in fused_ops.check_outputs(torch.device(device), dtype, 64, LLAMA_3_8B).items():
            diff = float((got.float() - want.float()).abs().max())
            share = float((got != want).float().mean())
            ok &= torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
            ops[f"{name}_{str(dtype).removeprefix('torch.')}"] = {"max_diff": diff, "share_differing": share}
    engine_check = same_mixed_batch(device, "elementwise_backend", "triton", "torch")
    return {"ok": ok and engine_check["ok"], "ops": ops, "engine": engine_check}


def check_graphs(device: str, lora: bool) -> dict[str, Any]:
    from elastune_demo import adapters as A
    from elastune_demo import build as B

    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    results = {}
    batches = (1, 3, 9)  # 3 and 9 replay graphs captured for larger sizes (padded)
    for graphs in (True, False):
        opts: dict[str, Any] = {"cuda_graphs": graphs}
        if lora:
            opts |= {"enable_lora": True, "max_loras": 4}
        eng = engine(path, device, **opts)
        if lora:
            for r in (8, 64):
                eng.load_lora(f"r{r}", str(A.ensure_tiny_adapter(r)))
        gen = torch.Generator().manual_seed(1)
        out = []
        for b in batches:
            prompts = [
                torch.randint(0, eng.vocab_size, (8 + 5 * i,), generator=gen).tolist() for i in range(b)
            ]
            names = [(None, "r8", "r64")[i % 3] for i in range(b)] if lora else None
            out.append(eng.generate(prompts, greedy(24), names))
        results[graphs] = out
    return {"ok": results[True] == results[False], "batches": list(batches), "lora": lora}


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    z = sizes(args.smoke)
    feats = engine_features()
    result: dict[str, Any] = {"device": device_info(z.device), "features": feats, "checks": {}}

    def run(name: str, fn: Callable[[], dict[str, Any] | str]) -> None:
        try:
            result["checks"][name] = fn()
        except Exception as exc:
            result["checks"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
        c = result["checks"][name]
        verdict = c if isinstance(c, str) else ("ok" if c["ok"] else "FAILED " + c.get("error", ""))
        print(f"correctness {name}: {verdict}",
              flush=True)  # fmt: skip
        write_part(args.out, "correctness", result)

    dev = z.device
    run("greedy_llama_vs_transformers", lambda: check_hf("llama", dev))
    run("greedy_gpt2_vs_transformers", lambda: check_hf("gpt2", dev))
    run("lora_padded_vs_peft", lambda: check_lora("padded", dev))
    run("lora_unpadded_vs_peft", lambda: check_lora("unpadded", dev))
    if "lora_backend" in feats["options"] and dev != "cpu":  # the two above took auto: Triton on CUDA
        run("lora_torch_path_vs_peft", lambda: check_lora("padded", dev, lora_backend="torch"))
    run("soft_prompt_vs_peft", lambda: check_soft_prompt(dev))
    for backend in ("triton", "auto"):
        name = f"attention_{backend}_vs_gather"
        if backend not in feats["attention_backends"]:
            run(name, lambda: NOT_AVAILABLE)
        elif backend == "triton" and dev == "cpu":
            run(name, lambda: "skipped on the CPU (Triton's interpreter: the unit tests cover it)")
        else:
            run(name, lambda b=backend: check_attention(b, dev))  # type: ignore[misc]
    if "elementwise_backend" not in feats["options"]:
        run("elementwise_triton_vs_torch", lambda: NOT_AVAILABLE)
    elif dev == "cpu":
        run("elementwise_triton_vs_torch", lambda: "skipped on the CPU (Triton's interpreter: unit tests)")
    else:
        run("elementwise_triton_vs_torch", lambda: check_elementwise(dev))
    for lora in (False, True):
        name = "cuda_graphs_on_vs_off" + ("_lora" if lora else "")
        if feats["cuda_graphs"]:
            run(name, lambda lo=lora: check_graphs(dev, lo))  # type: ignore[misc]
        else:
            run(name, lambda: NOT_AVAILABLE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
