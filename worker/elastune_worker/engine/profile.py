"""Profiled cost functions of this engine on its device, for routing (Preble's and CaraServe's
performance models): prefill seconds per token, decode step seconds = base + per_seq x batch.

Measured once at start-up with synthetic requests through the engine's own ``add_request`` / ``step``
(a few dozen milliseconds on the tiny models), so the figures include everything a real step pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastune_contract.protocol import ServingCost
from elastune_worker.engine.core.adapter_ref import AdapterRef
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.llm_engine import LLMEngine


def _timed_step(engine: LLMEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def profile_costs(engine: LLMEngine, *, repeats: int = 3) -> ServingCost:
    budget = engine.config.max_num_batched_tokens
    short, long = 16, max(32, min(256, budget, engine.max_model_len // 2))
    token = min(100, engine.vocab_size - 1)

    def prefill(n: int) -> float:
        times = []
        for i in range(repeats):
            rid = f"__profile-prefill-{n}-{i}"
            # distinct tokens per run: no prefix-cache hit may shorten the prefill
            engine.add_request(
                rid, [(token + i + j) % engine.vocab_size for j in range(n)], SamplingParams(max_tokens=1)
            )
            times.append(_timed_step(engine))
            engine.abort(rid)
        return min(times)

    def decode(batch: int, adapter: AdapterRef | None = None) -> float:
        tag = adapter.key if adapter is not None else None
        ids = [f"__profile-decode-{batch}-{tag}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            prompt = [(token + 7 * i + j) % engine.vocab_size for j in range(8)]
            params = SamplingParams(max_tokens=repeats + 2, ignore_eos=True)
            engine.add_request(rid, prompt, params, adapter=adapter)
        engine.step()  # the prefills
        t = min(_timed_step(engine) for _ in range(repeats))
        for rid in ids:
            engine.abort(rid)
        return t

    p_short, p_long = prefill(short), prefill(long)
    d1, d8 = decode(1), decode(8)
    lora = _profile_lora(engine, decode, d8) if engine.loras is not None else None
    engine.reset_counters()
    per_seq = max(0.0, (d8 - d1) / 7)
    cost = ServingCost(
        prefill_s_per_token=max(0.0, (p_long - p_short) / (long - short)),
        decode_step_base_s=max(0.0, d1 - per_seq),
        decode_step_per_seq_s=per_seq,
        device=engine.runner.device.type,
    )
    if lora is not None:
        cost.lora_kernel, cost.lora_a_s, cost.lora_b_s = engine.config.lora_kernel, lora[0], lora[1]
    return cost


def _profile_lora(engine: LLMEngine, decode: Callable[..., float], base8: float) -> tuple[float, float]:
    """CaraServe's LoRA term (§5) of this engine's kernel: decode steps of 8 requests with a synthetic
    adapter at a low and at the maximum rank, less the base step; a line through the two points in
    batch × rank (padded; with one adapter, Σ ranks is the same number for unpadded)."""
    import torch

    from elastune_worker.engine.model_runner.lora.weights import LoRAWeights

    assert engine.loras is not None
    points = []
    for rank in sorted({min(8, engine.config.max_lora_rank), engine.config.max_lora_rank}):
        name = f"__profile-r{rank}"
        gen = torch.Generator().manual_seed(rank)
        w = LoRAWeights(name=name, path="(synthetic)", rank=rank, scaling=1.0)
        for layer in range(engine.loras.num_layers):
            for target, (fan_in, fan_out) in engine.loras.shapes.items():
                w.a[(layer, target)] = torch.randn(rank, fan_in, generator=gen) * 0.01
                w.b_t[(layer, target)] = torch.randn(rank, fan_out, generator=gen) * 0.01
        ref = engine.add_lora_weights(w)
        try:
            points.append((8 * rank, max(0.0, decode(8, ref) - base8)))
        finally:
            engine.unload_lora(name)
    if len(points) == 1:
        return 0.0, points[0][1]
    (x0, y0), (x1, y1) = points
    a = max(0.0, (y1 - y0) / (x1 - x0))
    return a, max(0.0, y0 - a * x0)
