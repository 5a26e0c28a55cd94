"""The sampler alone at batch 64 (issue 42 item 3): a greedy step, a temperature + top-p step, and the
same top-p step with the whole vocabulary sorted (the sampler before issue 42: ``CANDIDATES`` raised past
the vocabulary), on the tiny models' vocabulary and on Llama-3's (128,256), each the median of timed
repetitions. Two logit shapes: "peaked", probabilities falling as rank^-2 (a nucleus of a few tokens, as
a trained model's usually is), and "flat", Gaussian logits of std 1.28 (what the random-weight Llama-3-8B
of the engine part gives: initializer_range 0.02 x sqrt(4096)), whose nucleus spans half the vocabulary
and so takes the full-sort fallback. ``python -m elastune_bench.device.sampler_bench [--device cpu]``."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.model_runner import sampler as sampler_module
from elastune_worker.engine.model_runner.sampler import Sampler

BATCH = 64
VOCABS = {"tiny": 2048, "llama-3": 128256}
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)
FIGURES = ("greedy_ms", "top_p_ms", "top_p_full_sort_ms")


def logits_of(shape: str, vocab: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if shape == "flat":
        x = torch.randn(BATCH, vocab, generator=gen) * 1.28
    else:  # logit of rank r: -2 ln r, the ranks shuffled per row
        ranks = torch.argsort(torch.rand(BATCH, vocab, generator=gen), dim=-1).float() + 1
        x = -2.0 * ranks.log()
    return x.to(device)


def step(s: Sampler, logits: torch.Tensor, requests: list[tuple[str, SamplingParams]]) -> Any:
    return lambda: s.sample(logits, requests)


def medians_ms(fns: list[Any], device: str, reps: int) -> list[float]:
    """Each function's median time; the functions take turns within every repetition, so that a
    machine whose load changes (a shared CPU) slows them alike."""

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for fn in fns * 3:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, seen in zip(fns, times, strict=True):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            seen.append(time.perf_counter() - t0)
    return [round(statistics.median(t) * 1e3, 3) for t in times]


def with_full_sort(fn: Any, vocab: int) -> Any:
    """``fn`` with every top-p row sorted whole: the sampler before issue 42."""

    def run() -> None:
        saved = sampler_module.CANDIDATES
        sampler_module.CANDIDATES = vocab
        try:
            fn()
        finally:
            sampler_module.CANDIDATES = saved

    return run


def measure(device: str, reps: int = 20, vocabs: tuple[str, ...] = tuple(VOCABS)) -> dict[str, Any]:
    greedy = [(f"r{i}", SamplingParams(temperature=0.0)) for i in range(BATCH)]
    sampled = [(f"r{i}", SAMPLED) for i in range(BATCH)]
    out: dict[str, Any] = {"batch": BATCH, "sampling": {"temperature": 0.8, "top_p": 0.9}}
    for name, vocab in ((n, VOCABS[n]) for n in vocabs):
        for shape in ("peaked", "flat"):
            logits = logits_of(shape, vocab, device)
            s, old = Sampler(torch.device(device)), Sampler(torch.device(device))
            fns = [
                step(s, logits, greedy),
                step(s, logits, sampled),
                with_full_sort(step(old, logits, sampled), vocab),
            ]
            r = dict(zip(FIGURES, medians_ms(fns, device, reps), strict=True))
            r["rows_sorted_whole"] = round(s.full_sorts / (reps + 3) / BATCH, 3)
            r["speedup"] = round(r["top_p_full_sort_ms"] / r["top_p_ms"], 2)
            out[f"{name}/{shape}"] = r
            print(f"sampler b={BATCH} vocab={vocab} {shape}: {r}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    print(json.dumps(measure(args.device, args.reps), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
