"""Part b2: the engine on a random-weight model of a real size (Llama-3-8B's shape in bf16) against
its rooflines: decode tokens/s at each batch with fixed-length contexts, and prefill tokens/s of long
prompts, each with the share of its bound (roofline.py) reached, from the ceilings measured just before.
Token ids in, fixed lengths out (``ignore_eos``), no detokenization (NoTokenizer), no prefix caching
(the random prompts share nothing). The KV cache is sized here for the largest batch: set explicitly."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from elastune_bench.device.common import (
    NOT_AVAILABLE,
    Sizes,
    device_info,
    engine_features,
    figures,
    part_args,
    read_part,
    sizes,
    sync,
    write_part,
)
from elastune_bench.device.roofline import Shape

BLOCK = 16
TORCH_ELEMENTWISE_BATCHES = (1, 64)
"""Decode batches measured again with the torch element-wise ops (fused_ops.py), when the engine used
the fused Triton kernels: their gain, in the same run."""
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
"""What most OpenAI clients send (the greedy runs measure the forward alone): the largest decode batch
up to 64 is measured again with these, so the sampler's cost per step is in the same run."""


def prefill_steps(z: Sizes, batch: int) -> int:
    """Steps a decode batch's prompts take to prefill (chunked by the step budget), plus one."""
    return -(-batch * z.context // z.max_batched_tokens) + 1


def output_tokens(z: Sizes, batch: int) -> int:
    """A decode request's max_tokens: the first prompts to prefill decode while later ones still
    prefill, so each gets as many extra tokens as there are prefill steps; none finishes inside the
    timed steps (the first H200 run, without this slack, emitted 6,046 of 256 x 32 tokens: the early
    requests finished up to 16 steps before the end and the batch shrank under the clock)."""
    return z.warm_steps + z.decode_steps + 1 + prefill_steps(z, batch)


def max_len(z: Sizes) -> int:
    """The context the runs need (the scheduler checks one such context fits the cache)."""
    longest = z.context + output_tokens(z, max(z.decode_batches)) + 1
    return max(longest, z.prefill_len + 2)


def kv_blocks(z: Sizes) -> int:
    """Blocks for the largest decode batch at its longest context, or for the prefill run's chunks."""
    per_seq = -(-(z.context + output_tokens(z, max(z.decode_batches)) + 1) // BLOCK)
    prefill = (z.max_batched_tokens // z.prefill_len + 2) * -(-(z.prefill_len + 1) // BLOCK)
    return max(max(z.decode_batches) * per_seq, prefill) + 8


def build(model_dir: Path, z: Sizes, graphs: bool | None, **options: Any) -> Any:
    """The engine for these sizes; ``options``: more EngineConfig fields (a backend to compare)."""
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.llm_engine import LLMEngine
    from elastune_worker.modeling.random_init import NoTokenizer

    extra: dict[str, Any] = ({} if graphs is None else {"cuda_graphs": graphs}) | options
    cfg = EngineConfig(
        device=z.device, dtype=z.dtype, block_size=BLOCK, num_kv_blocks=kv_blocks(z),  # type: ignore[arg-type]
        max_num_seqs=max(z.decode_batches), max_num_batched_tokens=z.max_batched_tokens,
        enable_prefix_caching=False, max_model_len=max_len(z), **extra,
    )  # fmt: skip
    return LLMEngine(model_dir, cfg, tokenizer=NoTokenizer())


def decode(
    eng: Any,
    z: Sizes,
    batch: int,
    shape: Shape,
    dtype_bytes: int,
    gbps: float | None,
    sampling: dict[str, float] | None = None,
) -> dict[str, Any]:
    """``batch`` requests of ``z.context`` random tokens: prefilled, ``warm_steps`` decode steps, then
    ``decode_steps`` timed decode steps of the whole batch; greedy unless ``sampling`` (SamplingParams
    fields) says otherwise."""
    from elastune_worker.engine.core.sampling import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, shape.vocab, (batch, z.context), generator=gen).tolist()
    params = SamplingParams(
        max_tokens=output_tokens(z, batch), ignore_eos=True, **({"temperature": 0.0} | (sampling or {}))
    )
    for i, p in enumerate(prompts):
        eng.add_request(f"d{batch}-{i}", p, params)
    s = eng.scheduler
    t0 = time.perf_counter()
    while s.waiting or any(not q.output_token_ids for q in s.running):
        eng.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(z.warm_steps):
        eng.step()
    running = len(s.running)
    start_ctx = sum(q.num_tokens for q in s.running) / max(1, running)
    preempted = eng.scheduler.stats().preemptions
    sync(eng.runner.device)
    t0 = time.perf_counter()
    per_step = [sum(len(o.new_token_ids) for o in eng.step()) for _ in range(z.decode_steps)]
    sync(eng.runner.device)
    seconds = time.perf_counter() - t0
    tokens = sum(per_step)
    # The first H200 run emitted fewer tokens than batch x steps at batch 64 and 256 (1,891 of 2,048;
    # 6,046 of 8,192) with none of it on the CPU: these say where the tokens went next time.
    trace = {"tokens_per_step": per_step, "running_after": len(s.running), "waiting_after": len(s.waiting),
             "preemptions_timed": eng.scheduler.stats().preemptions - preempted}  # fmt: skip
    for i in range(batch):  # the slack tokens are not measured
        eng.abort(f"d{batch}-{i}")
    step_s = seconds / z.decode_steps
    mean_ctx = start_ctx + (z.decode_steps - 1) / 2
    res: dict[str, Any] = {
        "batch": batch, "batch_running": running, "context": z.context, "steps": z.decode_steps,
        "tokens": tokens, "seconds": round(seconds, 4), "step_ms": round(step_s * 1e3, 3),
        "tokens_per_s": round(tokens / seconds, 1), "prefill_phase_s": round(prefill_s, 3), **trace,
    }  # fmt: skip
    if gbps:
        bound = shape.decode_step_bound_s(batch, mean_ctx, dtype_bytes, gbps * 1e9)
        res |= {"bound_step_ms": round(bound * 1e3, 3), "roofline_share": figures(bound / step_s)}
    return res


def prefill(eng: Any, z: Sizes, shape: Shape, tflops: float | None) -> dict[str, Any]:
    """``prefill_prompts`` random prompts of ``prefill_len`` tokens, one output token each, timed from
    their arrival to their first token (after one untimed prompt warms the kernels)."""
    from elastune_worker.engine.core.sampling import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, shape.vocab, (z.prefill_prompts + 1, z.prefill_len), generator=gen).tolist()
    eng.generate(prompts[:1], one)
    sync(eng.runner.device)
    t0 = time.perf_counter()
    eng.generate(prompts[1:], one)
    sync(eng.runner.device)
    seconds = time.perf_counter() - t0
    tokens = z.prefill_prompts * z.prefill_len
    res: dict[str, Any] = {"prompt_len": z.prefill_len, "prompts": z.prefill_prompts,
                           "seconds": round(seconds, 4),
                           "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip
    if tflops:
        bound = z.prefill_prompts * shape.prefill_flops(z.prefill_len) / (tflops * 1e12)
        res |= {"bound_s": round(bound, 4), "roofline_share": figures(bound / seconds)}
    return res


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    z = sizes(args.smoke)
    from elastune_worker.modeling.random_init import SHAPES, write_random_model

    feats = engine_features()
    ceilings = read_part(args.out, "ceilings") or {}
    gbps, tflops = ceilings.get("copy_gbps"), ceilings.get("matmul_tflops")
    shape = Shape.of(SHAPES[z.shape])
    dtype_bytes = torch.empty((), dtype=getattr(torch, z.dtype)).element_size()
    result: dict[str, Any] = {
        "device": device_info(z.device), "sizes": asdict(z), "features": feats,
        "model": {"shape": z.shape, "dtype": z.dtype, "params": shape.params,
                  "weight_gib": round(shape.params * dtype_bytes / 2**30, 2),
                  "kv_blocks": kv_blocks(z),
                  "kv_gib": round(kv_blocks(z) * BLOCK * shape.kv_bytes_per_token(dtype_bytes) / 2**30, 2)},
        "ceilings": {"copy_gbps": gbps, "matmul_tflops": tflops},
        "decode": {}, "prefill": None, "decode_b1_eager": NOT_AVAILABLE, "decode_torch_elementwise": {},
        "decode_sampled": {},
    }  # fmt: skip
    graphs = True if feats["cuda_graphs"] else None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(Path(tmp) / z.shape, z.shape)
        t0 = time.perf_counter()
        eng = build(model_dir, z, graphs)
        sync(z.device)
        result["model"]["build_s"] = round(time.perf_counter() - t0, 2)
        result["elementwise_backend"] = getattr(getattr(eng.runner, "elementwise", None), "name", "torch")
        write_part(args.out, "engine", result)
        for batch in z.decode_batches:
            r = result["decode"][str(batch)] = decode(eng, z, batch, shape, dtype_bytes, gbps)
            print(f"engine decode b={batch}: {r['tokens_per_s']} tok/s, {r['step_ms']} ms/step, "
                  f"share {r.get('roofline_share')}", flush=True)  # fmt: skip
            write_part(args.out, "engine", result)
        r = result["prefill"] = prefill(eng, z, shape, tflops)
        print(f"engine prefill: {r['tokens_per_s']} tok/s, share {r.get('roofline_share')}", flush=True)
        write_part(args.out, "engine", result)
        batch = max(b for b in z.decode_batches if b <= 64)
        r = result["decode_sampled"][str(batch)] = decode(eng, z, batch, shape, dtype_bytes, gbps, SAMPLED)
        r["sampling"] = SAMPLED
        greedy = result["decode"].get(str(batch), {}).get("tokens_per_s")
        if greedy:
            r["vs_greedy"] = figures(r["tokens_per_s"] / greedy)
        print(f"engine decode b={batch} sampled {SAMPLED}: {r['tokens_per_s']} tok/s", flush=True)
        try:  # the sampler alone, peaked and flat logits, with and without the full sort (issue 42)
            from elastune_bench.device import sampler_bench

            vocabs = ("tiny",) if args.smoke else ("tiny", "llama-3")
            result["sampler"] = sampler_bench.measure(z.device, reps=3 if args.smoke else 20, vocabs=vocabs)
        except Exception as exc:  # a figure missing, not the engine part failed
            result["sampler"] = {"error": f"{type(exc).__name__}: {exc}"}
        if torch.cuda.is_available():
            result["model"]["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        write_part(args.out, "engine", result)
        if feats["cuda_graphs"]:  # the graphs' gain where it is largest: batch 1, eager otherwise equal
            del eng
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            eng = build(model_dir, z, False)
            r = result["decode_b1_eager"] = decode(eng, z, 1, shape, dtype_bytes, gbps)
            graph_b1 = result["decode"].get("1", {}).get("tokens_per_s")
            if graph_b1:
                r["graphs_speedup"] = figures(graph_b1 / r["tokens_per_s"])
            print(f"engine decode b=1 eager: {r['tokens_per_s']} tok/s", flush=True)
            write_part(args.out, "engine", result)
        if result["elementwise_backend"] == "triton":  # the fused kernels' gain: the torch ops, graphs on
            del eng
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            eng = build(model_dir, z, graphs, elementwise_backend="torch")
            for batch in TORCH_ELEMENTWISE_BATCHES:
                r = result["decode_torch_elementwise"][str(batch)] = decode(
                    eng, z, batch, shape, dtype_bytes, gbps
                )
                fused = result["decode"].get(str(batch), {}).get("tokens_per_s")
                if fused:
                    r["fused_speedup"] = figures(fused / r["tokens_per_s"])
                print(f"engine decode b={batch} torch element-wise: {r['tokens_per_s']} tok/s", flush=True)
                write_part(args.out, "engine", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
