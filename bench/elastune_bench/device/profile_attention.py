"""Part c4: the decode attention kernel alone (triton_attention.py), over the launch settings it could
take, against the bytes it must read. A model of the first H200 run's steps (issue 26) puts the Triton
decode kernel at roughly a third of the bandwidth it could use at batch 64 (the rest of the step: the
weights at ~80 %, ~1,200 small element-wise kernels, the host): this part measures it instead of
guessing, and says which (keys per loop step, warps, pipeline stages) reads the cache fastest, and
what splitting small batches' contexts across programs (flash-decoding, the default there) gains over
one pass.

Per shape (batch x context, Llama-3-8B's heads: 32 query over 8 KV heads of 128, bfloat16, pages of
16 tokens scattered over the cache): the kernel's time with its default settings and with each setting
of the sweep, as microseconds per call (one layer) and GB/s of K and V read, with the share of the copy
bandwidth the ceilings part measured; and the gather + SDPA path on the same inputs. Its JSON as
profile_attention.json, written after every shape. ~60 s expected on an H100/H200 (Triton compiles each
setting once); the CPU smoke run takes Triton's interpreter over a tiny shape and two settings."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from elastune_bench.device.common import device_info, figures, part_args, read_part, sync, write_part


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: torch.dtype
    heads: tuple[int, int, int]
    """Query heads, KV heads, head size."""
    shapes: tuple[tuple[int, int], ...]
    """(batch, context) pairs."""
    block_n: tuple[int, ...]
    num_warps: tuple[int, ...]
    num_stages: tuple[int, ...]
    iterations: int


FULL = Plan("cuda", torch.bfloat16, (32, 8, 128),
            shapes=((1, 512), (16, 512), (64, 512), (256, 512), (1, 4096), (64, 2048)),
            block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3), iterations=50)  # fmt: skip
SMOKE = Plan("cpu", torch.float32, (4, 2, 16), shapes=((2, 40),), block_n=(16, 32), num_warps=(4,),
             num_stages=(1,), iterations=1)  # fmt: skip
PAGE = 16


def inputs(plan: Plan, batch: int, context: int) -> dict[str, Any]:
    """One decode per sequence, its context in pages scattered over a cache with room for all of them;
    the Triton tiles and the gather path's metadata of that step."""
    from elastune_worker.engine.model_runner.attention import AttentionMetadata, DecodeGroup
    from elastune_worker.engine.model_runner.triton_attention import build_tiles

    n_heads, n_kv, d = plan.heads
    dev = torch.device(plan.device)
    pages = -(-context // PAGE)
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    order = torch.randperm(batch * pages, generator=gen).tolist()
    tables = [order[i * pages : (i + 1) * pages] for i in range(batch)]
    cache = [torch.randn(n_kv, batch * pages * PAGE, d, generator=gen).to(dev, plan.dtype) for _ in range(2)]
    q = torch.randn(batch, n_heads, d, generator=gen).to(dev, plan.dtype)
    tiles = build_tiles([(i, 1, context, t) for i, t in enumerate(tables)], pages, 1, dev)
    last = [t[(context - 1) // PAGE] * PAGE + (context - 1) % PAGE for t in tables]
    mask = (torch.arange(pages * PAGE) < context).view(1, 1, 1, -1).expand(batch, 1, 1, -1)
    rows = torch.arange(batch, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(last, device=dev), positions=torch.full((batch,), context - 1, device=dev),
        logits_index=rows, decodes=[DecodeGroup(rows, torch.tensor(tables, device=dev), mask.to(dev))],
    )  # fmt: skip
    # The step's own K/V are the cache's values at its slot: gather then writes what is already there.
    k_new = cache[0][:, last].transpose(0, 1).contiguous()
    v_new = cache[1][:, last].transpose(0, 1).contiguous()
    kv_bytes = 2 * batch * context * n_kv * d * cache[0].element_size()
    return {"q": q, "cache": cache, "tiles": tiles, "meta": meta, "k": k_new, "v": v_new, "bytes": kv_bytes}


def timed_us(plan: Plan, fn: Any, graph: bool = True) -> tuple[float, str]:
    """(mean microseconds per call over ``plan.iterations`` calls after one warm call (compiles), how it
    was timed). On CUDA the calls are captured in one CUDA graph and replayed: timed eagerly, back to
    back, the first H200 run measured Triton's launch overhead instead (60-180 us for 2 MiB of K/V at
    1 x 512 in every setting, where the kernel takes 39.8 us a layer at 64 x 512 inside the engine's
    graph). "eager" where ``graph`` is off (gather + SDPA, which the engine never captures), on the CPU,
    and where the capture fails (the result says which)."""
    fn()
    sync(plan.device)
    if graph and plan.device == "cuda":
        try:
            return _graph_us(plan, fn), "graph"
        except Exception:  # a path that cannot be captured: timed eagerly, and the result says so
            torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(plan.iterations):
        fn()
    sync(plan.device)
    return (time.perf_counter() - t0) / plan.iterations * 1e6, "eager"


def _graph_us(plan: Plan, fn: Any) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch's docs ask
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(plan.iterations):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / plan.iterations * 1e6


def sweep_shape(plan: Plan, batch: int, context: int, gbps: float | None) -> dict[str, Any]:
    from elastune_worker.engine.model_runner.attention import paged_attention
    from elastune_worker.engine.model_runner.triton_attention import (
        LaunchTuning,
        decode_splits,
        paged_attention_in_place,
    )

    x = inputs(plan, batch, context)
    q, (kc, vc), tiles = x["q"], x["cache"], x["tiles"]
    scale = plan.heads[2] ** -0.5
    out = torch.empty_like(q)

    def triton(tuning: LaunchTuning | None) -> Any:
        return lambda: paged_attention_in_place(q, kc, vc, out, tiles, scale, PAGE, tuning)

    def rate(fn: Any, graph: bool = True) -> dict[str, Any]:
        us, how = timed_us(plan, fn, graph)
        r: dict[str, Any] = {"us": round(us, 2), "gb_per_s": figures(x["bytes"] / us / 1e3), "timing": how}
        if gbps:
            r["share_of_copy"] = figures(x["bytes"] / us / 1e3 / gbps)
        return r

    res: dict[str, Any] = {"batch": batch, "context": context, "kv_mib": round(x["bytes"] / 2**20, 2)}
    res["default"] = rate(triton(None))
    res["default"]["splits"] = decode_splits(batch * plan.heads[1], torch.device(plan.device))
    # Flash-decoding's gain where the default splits the contexts: the same launch in one pass.
    if res["default"]["splits"] > 1:
        res["one_pass"] = rate(triton(LaunchTuning(splits=1)))
        res["split_vs_one_pass"] = round(res["one_pass"]["us"] / res["default"]["us"], 3)
    reference = paged_attention(q, x["k"], x["v"], kc, vc, x["meta"], scale)
    triton(None)()
    res["max_diff_vs_gather"] = float((out.float() - reference.float()).abs().max())
    res["gather_sdpa"] = rate(
        lambda: paged_attention(q, x["k"], x["v"], kc, vc, x["meta"], scale), graph=False
    )
    settings: list[dict[str, Any]] = []
    for bn in plan.block_n:
        for warps in plan.num_warps:
            for stages in plan.num_stages:
                tuning = LaunchTuning(bn, warps, stages)
                try:
                    settings.append(asdict(tuning) | rate(triton(tuning)))
                except Exception as exc:  # a setting this Triton or GPU cannot compile (shared memory)
                    settings.append(asdict(tuning) | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    res["settings"] = settings
    timed = [s for s in settings if "us" in s]
    if timed:
        best = min(timed, key=lambda s: s["us"])
        res["best"] = best
        res["best_vs_default"] = round(res["default"]["us"] / best["us"], 3)
    return res


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    plan = SMOKE if args.smoke else FULL
    if plan.device == "cpu":  # Triton runs CPU tensors only in its interpreter (before the kernel's import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    gbps = (read_part(args.out, "ceilings") or {}).get("copy_gbps")
    result: dict[str, Any] = {
        "device": device_info(plan.device), "dtype": str(plan.dtype), "heads": plan.heads, "page": PAGE,
        "copy_gbps": gbps, "iterations": plan.iterations, "shapes": {},
    }  # fmt: skip
    for batch, context in plan.shapes:
        r = result["shapes"][f"{batch}x{context}"] = sweep_shape(plan, batch, context, gbps)
        best = r.get("best", {})
        print(f"attention b={batch} ctx={context}: default {r['default']['us']} us "
              f"({r['default']['gb_per_s']} GB/s), best {best.get('us')} us with block_n "
              f"{best.get('block_n')} warps {best.get('num_warps')} stages {best.get('num_stages')}, "
              f"gather+SDPA {r['gather_sdpa']['us']} us", flush=True)  # fmt: skip
        write_part(args.out, "profile_attention", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
