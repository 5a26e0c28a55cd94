"""``elastune bench lora [--quick] [--json PATH] [--shape NAME]``: multi-LoRA serving on the real engine.

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

``--shape`` picks the model (serving/shapes.py): the tiny Llama and its trained adapters (default), or a
random-weight model of a real shape (``llama-3-8b`` on a GPU) with random adapters of that shape, ranks
8/16/32/64 on q, k, v in fp16 (rank 64: 75 MiB), so a real copy moves a real adapter's bytes. Prompts
are token ids of the tiny tokenizer either way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from elastune_bench.serving.shapes import TINY, BenchModel, bench_model, shape_names
from elastune_bench.stats import percentile

RESULTS = Path("benchmarks/results/lora.json")
MODES = ("cached", "cpu_assisted", "cpu_assisted_procs", "async", "ondmd")
"""cpu_assisted_procs: CaraServe's CPU path in 2 CPU LoRA worker processes (shared memory)."""


def _engine(
    mode: str,
    gbps: float,
    max_loras: int,
    kernel: str = "padded",
    adapters: int = 16,
    device: str = "cpu",
    model: BenchModel | None = None,
    paths: dict[int, Path] | None = None,
) -> Any:
    """An engine of ``model`` (default: the tiny Llama) with ``adapters`` names registered from the
    rank's adapter in ``paths``. 16,384 KV tokens: 2 GiB on Llama-3-8B; a random shape's running batch
    is capped at 64 (the CUDA graphs captured per engine: 11 sizes, not 19)."""
    workers = 2 if mode == "cpu_assisted_procs" else 0
    mode = "cpu_assisted" if mode == "cpu_assisted_procs" else mode
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.llm_engine import LLMEngine
    from elastune_worker.engine.model_runner.lora.copies import EmulatedCopies

    model = model or bench_model(TINY)
    paths = paths or model.lora_adapters()
    cfg = EngineConfig(
        kv_cache_tokens=16384, enable_lora=True, max_loras=max_loras, max_cpu_loras=max(adapters, max_loras),
        lora_load_mode=mode, lora_kernel=kernel,  # type: ignore[arg-type]
        lora_cpu_workers=workers, device=device,  # type: ignore[arg-type]
        max_num_seqs=64 if model.random else 128,
    )  # fmt: skip
    eng = LLMEngine(model.path, cfg, tokenizer=model.engine_tokenizer())
    if gbps > 0 and eng.loras is not None:  # a CPU has no host->device copy: EMULATE a GPU's
        eng.loras.time_copies(EmulatedCopies(gbps))
    for name in adapter_names(adapters):
        eng.load_lora(name, str(paths[int(name.split("-")[0][1:])]))
    return eng


def free_device_memory(device: str) -> None:
    """After the last reference to an engine is gone: its device memory back before the next engine is
    built (two Llama-3-8B engines would hold 2 x 15 GiB)."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def adapter_names(n: int) -> list[str]:
    """``n`` adapters, ranks 8/16/32/64 in turn (the project's four, each under n/4 names)."""
    return [f"r{(8, 16, 32, 64)[i % 4]}-{i}" for i in range(n)]


def trace(
    n: int, rate: float, seed: int, adapters: int, model: BenchModel | None = None
) -> list[tuple[float, str, str | list[int]]]:
    """(arrival, adapter, prompt): Poisson arrivals, Zipf(1.0) adapter popularity, family prompts (their
    token ids when ``model`` is given: a random-weight model's engine takes ids only)."""
    from elastune_demo import tasks as T

    rng = random.Random(seed)
    names = adapter_names(adapters)
    weights = [1.0 / (i + 1) for i in range(len(names))]
    examples = T.make_task(T.TaskSpec("units", 0), n_train=0, n_eval=64, seed=seed).eval
    out: list[tuple[float, str, str | list[int]]] = []
    t = 0.0
    for i in range(n):
        text = T.format_example(examples[i % len(examples)]["input"])
        out.append((t, rng.choices(names, weights)[0], model.encode(text) if model else text))
        t += rng.expovariate(rate)
    return out


def replay(eng: Any, requests: list[tuple[float, str, str | list[int]]], max_tokens: int) -> dict[str, float]:
    """Open-loop replay in real time: each request is added when its arrival time comes."""
    from elastune_worker.engine.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    dev = eng.loras.device
    # The trace's own loads and waits: not the registrations' (cached puts every adapter on the device
    # when it is registered, and on a CPU that copy's emulated time was counted as a cold start).
    loads0, wait0 = dev.loads, dev.wait_seconds
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
    out["device_loads"] = dev.loads - loads0
    out["cold_start_wait_s"] = round(dev.wait_seconds - wait0, 3)
    out["cold_start_share_pct"] = round(100 * (dev.wait_seconds - wait0) / (time.perf_counter() - start), 1)
    out["wall_s"] = round(time.perf_counter() - start, 2)
    return out


def kernels(
    batch: int,
    max_tokens: int,
    device: str = "cpu",
    model: BenchModel | None = None,
    paths: dict[int, Path] | None = None,
) -> dict[str, Any]:
    from elastune_worker.engine.core.sampling import SamplingParams

    model = model or bench_model(TINY)
    out: dict[str, Any] = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # The batch uses r8-0 and r64-3 only; a random shape registers just those four names (a slot of
    # Llama-3-8B holds rank 64 on all seven targets: 320 MiB), the tiny Llama its 16 as before.
    n = 4 if model.random else 16
    for kernel in ("padded", "unpadded"):
        eng = _engine("cached", 0.0, n, kernel, adapters=n, device=device, model=model, paths=paths)
        loras = [("r8-0" if i % 4 else "r64-3") for i in range(batch)]  # 3 of 4 at rank 8, 1 at rank 64
        prompts = [model.encode(f"{i} km →") for i in range(batch)]
        # The same mixed batch once untimed (every adapter is on the device: cached): a GPU's first
        # call of each kernel and shape pays its one-off set-up, which is not the kernel's speed.
        eng.generate(prompts, params, loras)
        t0 = time.perf_counter()
        eng.generate(prompts, params, loras)
        seconds = time.perf_counter() - t0
        del eng
        free_device_memory(device)
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
    p.add_argument(
        "--shape", choices=shape_names(), default=TINY,
        help="the model: the tiny Llama, or a random-weight shape with random adapters (llama-3-8b on a GPU)",
    )  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    modes = [m for m in args.modes.split(",") if m]
    if "cached" not in modes or set(modes) - set(MODES):
        p.error(f"--modes: names from {', '.join(MODES)}, cached among them (the baseline)")
    model = bench_model(args.shape)
    try:
        return _run(args, model, device, modes)
    finally:
        model.close()


def _run(args: argparse.Namespace, model: BenchModel, device: str, modes: list[str]) -> int:
    import torch

    # A CUDA engine copies adapters to the device for real: emulating a copy there would count it twice.
    gbps = args.gbps if device == "cpu" else 0.0
    n = args.requests or (60 if args.quick else 240)
    requests = trace(n, args.rate, seed=0, adapters=args.adapters, model=model)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    paths = model.lora_adapters()
    sizes = {f"r{r}": round(sum(f.stat().st_size for f in p.glob("*.safetensors")) / 2**20, 2)
             for r, p in paths.items()}  # fmt: skip
    what = f"{model.label()}'s adapters" + ("" if not model.random else ", rank 8-64 on q, k, v, fp16")
    emulation = (
        f"host->device copies EMULATED at {gbps:g} GB/s for a Llama-2-7B adapter of the same rank "
        "(q, k, v, fp16): no device on this machine"
        if device == "cpu"
        else f"real host->device copies on {torch.cuda.get_device_name()} ({what})"
    )
    result: dict[str, Any] = {
        "emulation": emulation, "device": device,
        "model": {"shape": model.shape, "random_weights": model.random, "adapter_file_mib": sizes,
                  "adapters_written_s": round(time.perf_counter() - t0, 2)},
        "setup": {"requests": n, "rate_per_s": args.rate, "adapters": args.adapters,
                  "device_slots": args.slots, "max_tokens": 16},
        "cold_start": {},
    }  # fmt: skip
    target = Path(args.json) if args.json else (None if args.quick else RESULTS)
    print(result["emulation"], f"on {model.label()}; adapter files (MiB): {sizes}", flush=True)
    for mode in modes:
        t0 = time.perf_counter()
        eng = _engine(
            mode,
            gbps,
            args.adapters if mode == "cached" else args.slots,
            adapters=args.adapters,
            device=device,
            model=model,
            paths=paths,
        )
        # One request per rank first, untimed: a GPU's first LoRA step of each rank pays one-off
        # kernel set-up (seen on an H200: the first mode's TTFT p99 was 358 ms, the others' 20-40 ms).
        warm = adapter_names(min(4, args.adapters))
        eng.generate([model.encode("warm up →")] * (len(warm) + 1), None, [None, *warm])
        built = time.perf_counter() - t0
        replayed, eager = eng.runner.steps_replayed, eng.runner.steps_eager
        res = replay(eng, requests, 16)
        res["engine_set_up_s"] = round(built, 2)
        # Which path the trace's steps took (on the first H200 run cached's TPOT was 6x the others').
        res["steps_graph"] = eng.runner.steps_replayed - replayed
        res["steps_eager"] = eng.runner.steps_eager - eager
        if eng.runner.lora_cpu_pool is not None:
            res["cpu_worker_calls"] = eng.runner.lora_cpu_pool.calls
            eng.runner.lora_cpu_pool.close()
        del eng
        free_device_memory(device)
        result["cold_start"][mode] = res
        _write(result, target)  # each mode's figures as soon as they exist (a time box may end the run)
        print(
            f"  {mode:13s} TTFT {res['ttft_ms_mean']:7.1f} / p99 {res['ttft_ms_p99']:7.1f} ms   "
            f"TPOT {res['tpot_ms_mean']:6.2f} ms   latency {res['latency_ms_mean']:7.1f} / p99 "
            f"{res['latency_ms_p99']:7.1f} ms   device loads {res['device_loads']}  "
            f"cold-start waits {res['cold_start_share_pct']} % of the run  (set-up {built:.1f} s)",
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
    result["kernels"] = kernels(16 if args.quick else 32, 16 if args.quick else 32, device, model, paths)
    print(f"kernels: {json.dumps(result['kernels'])}")
    result["machine"] = {
        "cpus": os.cpu_count(),
        "loadavg_1m_before": round(load, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    if target is not None:
        _write(result, target)
        print(f"wrote {target}")
    return 0


def _write(result: dict[str, Any], target: Path | None) -> None:
    if target is None:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(target)


if __name__ == "__main__":
    raise SystemExit(main())
