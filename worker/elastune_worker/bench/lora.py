"""``elastune bench lora [--quick] [--json PATH]``: multi-LoRA serving on the real engine (tiny Llama).

1. Cold start, CaraServe §7.2's comparison: the same Poisson trace of requests for 512 adapters (the
   project's rank 8/16/32/64 adapters under 128 names each, Zipf popularity) on an engine with 8 device
   slots, under each load mode — cached (every adapter on the device: the oracle, 512 slots),
   cpu_assisted (CaraServe), async (S-LoRA-like) and ondmd. On a CPU-only machine there is no
   host→device copy: its time is EMULATED (``--gbps``, default 4 GB/s: pageable host memory over PCIe 3.0
   ×16) for an adapter of a Llama-2-7B of the same rank (q, k, v, fp16: rank 64 ≈ 100 MiB ≈ 25 ms);
   the figures say so. On CUDA (``--device cuda``, or auto with a GPU) the copies are real and nothing
   is emulated. Time to first token, time per output token and request latency, mean and p99,
   each mode's overhead over cached.
2. Kernels: the same decode-heavy batch of mixed ranks (8 and 64) with the padded and the unpadded
   kernel: output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from elastune_worker.bench.stats import percentile

RESULTS = Path("benchmarks/results/lora.json")
MODES = ("cached", "cpu_assisted", "cpu_assisted_procs", "async", "ondmd")
"""cpu_assisted_procs: CaraServe's CPU path in 2 CPU LoRA worker processes (shared memory)."""


def _engine(
    mode: str, gbps: float, max_loras: int, kernel: str = "padded", adapters: int = 16, device: str = "cpu"
) -> Any:
    workers = 2 if mode == "cpu_assisted_procs" else 0
    mode = "cpu_assisted" if mode == "cpu_assisted_procs" else mode
    from elastune_worker.serving.config import EngineConfig
    from elastune_worker.serving.core.engine import LLMEngine
    from elastune_worker.serving.runner.lora.copies import EmulatedCopies
    from elastune_worker.tiny import adapters as A
    from elastune_worker.tiny import build as B

    cfg = EngineConfig(
        kv_cache_tokens=16384, enable_lora=True, max_loras=max_loras, max_cpu_loras=max(adapters, max_loras),
        lora_load_mode=mode, lora_kernel=kernel,  # type: ignore[arg-type]
        lora_cpu_workers=workers, device=device,  # type: ignore[arg-type]
    )  # fmt: skip
    eng = LLMEngine(B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), cfg)
    if gbps > 0 and eng.loras is not None:  # a CPU has no host->device copy: EMULATE a GPU's
        eng.loras.time_copies(EmulatedCopies(gbps))
    paths = {rank: str(A.ensure_tiny_adapter(rank)) for rank in (8, 16, 32, 64)}
    for name in adapter_names(adapters):
        eng.load_lora(name, paths[int(name.split("-")[0][1:])])
    return eng


def adapter_names(n: int) -> list[str]:
    """``n`` adapters, ranks 8/16/32/64 in turn (the project's four, each under n/4 names)."""
    return [f"r{(8, 16, 32, 64)[i % 4]}-{i}" for i in range(n)]


def trace(n: int, rate: float, seed: int, adapters: int) -> list[tuple[float, str, str]]:
    """(arrival, adapter, prompt): Poisson arrivals, Zipf(1.0) adapter popularity, family prompts."""
    from elastune_worker.tiny import tasks as T

    rng = random.Random(seed)
    names = adapter_names(adapters)
    weights = [1.0 / (i + 1) for i in range(len(names))]
    examples = T.make_task(T.TaskSpec("units", 0), n_train=0, n_eval=64, seed=seed).eval
    out, t = [], 0.0
    for i in range(n):
        out.append(
            (t, rng.choices(names, weights)[0], T.format_example(examples[i % len(examples)]["input"]))
        )
        t += rng.expovariate(rate)
    return out


def replay(eng: Any, requests: list[tuple[float, str, str]], max_tokens: int) -> dict[str, float]:
    """Open-loop replay in real time: each request is added when its arrival time comes."""
    from elastune_batching.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    arrive: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    i = 0
    while len(done) < len(requests):
        now = time.perf_counter() - start
        while i < len(requests) and requests[i][0] <= now:
            rid = f"q{i}"
            eng.add_request(rid, requests[i][2], params, adapter=eng.adapter_ref(requests[i][1]))
            arrive[rid] = requests[i][0]
            i += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, requests[i][0] - now))
            continue
        for o in eng.step():
            t = time.perf_counter() - start
            first.setdefault(o.request_id, t)
            if o.finished:
                done[o.request_id] = t
    ttft = [first[r] - arrive[r] for r in arrive]
    e2e = [done[r] - arrive[r] for r in arrive]
    tpot = [(done[r] - first[r]) / max(1, max_tokens - 1) for r in arrive]
    out: dict[str, float] = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("latency", e2e)):
        out[f"{name}_ms_mean"] = round(1000 * statistics.fmean(values), 2)
        out[f"{name}_ms_p99"] = round(1000 * percentile(values, 99), 2)
    out["device_loads"] = eng.loras.device.loads
    out["cold_start_wait_s"] = round(eng.loras.device.wait_seconds, 3)
    out["cold_start_share_pct"] = round(
        100 * eng.loras.device.wait_seconds / (time.perf_counter() - start), 1
    )
    out["wall_s"] = round(time.perf_counter() - start, 2)
    return out


def kernels(batch: int, max_tokens: int, device: str = "cpu") -> dict[str, Any]:
    from elastune_batching.sampling import SamplingParams

    out: dict[str, Any] = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for kernel in ("padded", "unpadded"):
        eng = _engine("cached", 0.0, 16, kernel, adapters=16, device=device)
        loras = [("r8-0" if i % 4 else "r64-3") for i in range(batch)]  # 3 of 4 at rank 8, 1 at rank 64
        prompts = [f"{i} km →" for i in range(batch)]
        # The same mixed batch once untimed (every adapter is on the device: cached): a GPU's first
        # call of each kernel and shape pays its one-off set-up, which is not the kernel's speed.
        eng.generate(prompts, params, loras)
        t0 = time.perf_counter()
        eng.generate(prompts, params, loras)
        seconds = time.perf_counter() - t0
        out[kernel] = {"tokens_per_s": round(batch * max_tokens / seconds, 1), "seconds": round(seconds, 3)}
    out["unpadded_vs_padded"] = round(out["unpadded"]["tokens_per_s"] / out["padded"]["tokens_per_s"], 3)
    out["batch"] = {"requests": batch, "ranks": "3/4 rank 8, 1/4 rank 64", "max_tokens": max_tokens}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune bench lora", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (< 1 min)")
    p.add_argument("--json", metavar="PATH", help=f"results file (default {RESULTS} for a full run)")
    p.add_argument("--gbps", type=float, default=4.0, help="EMULATED host->device bandwidth (GB/s; CPU only)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if present")
    p.add_argument("--requests", type=int, help="requests of the trace (default 240; --quick 60)")
    p.add_argument(
        "--modes", default=",".join(MODES), help=f"load modes, comma-separated ({','.join(MODES)})"
    )
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--adapters", type=int, default=512, help="adapters (Zipf popularity)")
    p.add_argument("--slots", type=int, default=8, help="device adapter slots")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    modes = [m for m in args.modes.split(",") if m]
    if "cached" not in modes or set(modes) - set(MODES):
        p.error(f"--modes: names from {', '.join(MODES)}, cached among them (the baseline)")
    # A CUDA engine copies adapters to the device for real: emulating a copy there would count it twice.
    gbps = args.gbps if device == "cpu" else 0.0
    n = args.requests or (60 if args.quick else 240)
    requests = trace(n, args.rate, seed=0, adapters=args.adapters)
    load = os.getloadavg()[0]
    emulation = (
        f"host->device copies EMULATED at {gbps:g} GB/s for a Llama-2-7B adapter of the same rank "
        "(q, k, v, fp16): no device on this machine"
        if device == "cpu"
        else f"real host->device copies on {torch.cuda.get_device_name()} (tiny Llama's adapters)"
    )
    result: dict[str, Any] = {
        "emulation": emulation, "device": device,
        "setup": {"requests": n, "rate_per_s": args.rate, "adapters": args.adapters,
                  "device_slots": args.slots, "max_tokens": 16},
        "cold_start": {},
    }  # fmt: skip
    print(result["emulation"])
    for mode in modes:
        eng = _engine(
            mode,
            gbps,
            args.adapters if mode == "cached" else args.slots,
            adapters=args.adapters,
            device=device,
        )
        # One request per rank first, untimed: a GPU's first LoRA step of each rank pays one-off
        # kernel set-up (seen on an H200: the first mode's TTFT p99 was 358 ms, the others' 20-40 ms).
        warm = adapter_names(min(4, args.adapters))
        eng.generate(["warm up →"] * (len(warm) + 1), None, [None, *warm])
        res = replay(eng, requests, 16)
        if eng.runner.lora_cpu_pool is not None:
            res["cpu_worker_calls"] = eng.runner.lora_cpu_pool.calls
            eng.runner.lora_cpu_pool.close()
        result["cold_start"][mode] = res
        print(
            f"  {mode:13s} TTFT {res['ttft_ms_mean']:7.1f} / p99 {res['ttft_ms_p99']:7.1f} ms   "
            f"TPOT {res['tpot_ms_mean']:6.2f} ms   latency {res['latency_ms_mean']:7.1f} / p99 "
            f"{res['latency_ms_p99']:7.1f} ms   device loads {res['device_loads']}  "
            f"cold-start waits {res['cold_start_share_pct']} % of the run",
            flush=True,
        )
    base = result["cold_start"]["cached"]
    for mode in modes:
        if mode == "cached":
            continue
        r = result["cold_start"][mode]
        r["overhead_vs_cached_pct"] = {
            k: round(100 * (r[k] / base[k] - 1), 1)
            for k in ("ttft_ms_mean", "tpot_ms_mean", "latency_ms_mean")
        }
    result["kernels"] = kernels(16 if args.quick else 32, 16 if args.quick else 32, device)
    print(f"kernels: {json.dumps(result['kernels'])}")
    result["machine"] = {
        "cpus": os.cpu_count(),
        "loadavg_1m_before": round(load, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    target = Path(args.json) if args.json else (None if args.quick else RESULTS)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
