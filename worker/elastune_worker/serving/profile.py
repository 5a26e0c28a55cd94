"""Profiled cost functions of this engine on its device, for routing (Preble's and CaraServe's
performance models): prefill seconds per token, decode step seconds = base + per_seq x batch.

Measured once at start-up with synthetic requests through the engine's own ``add_request`` / ``step``
(a few dozen milliseconds on the tiny models), so the figures include everything a real step pays.
"""

from __future__ import annotations

import time

from elastune_contract.protocol import ServingCost
from elastune_worker.serving.engine import LLMEngine
from elastune_worker.serving.sampling import SamplingParams


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

    def decode(batch: int) -> float:
        ids = [f"__profile-decode-{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [(token + 7 * i + j) % engine.vocab_size for j in range(8)],
                               SamplingParams(max_tokens=repeats + 2, ignore_eos=True))  # fmt: skip
        engine.step()  # the prefills
        t = min(_timed_step(engine) for _ in range(repeats))
        for rid in ids:
            engine.abort(rid)
        return t

    p_short, p_long = prefill(short), prefill(long)
    d1, d8 = decode(1), decode(8)
    engine.reset_counters()
    per_seq = max(0.0, (d8 - d1) / 7)
    return ServingCost(
        prefill_s_per_token=max(0.0, (p_long - p_short) / (long - short)),
        decode_step_base_s=max(0.0, d1 - per_seq),
        decode_step_per_seq_s=per_seq,
    )
