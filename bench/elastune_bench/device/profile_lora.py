"""Part c3: where a multi-LoRA decode step's time goes, under torch.profiler. The first H200 run left
two LoRA figures unexplained (issue 26): ~96 ms per step of ``bench lora`` on the random-weight
Llama-3-8B, and cached mode's TPOT 7.3 ms against 1.1-1.3 ms for the other modes on the tiny Llama.
This part answers them in one run instead of guessing: the same decode batch on one engine without
adapters, with adapters on the padded kernel (Punica's BGMV: each decode row gathers its slot's A and
B at the batch's max rank) and on the unpadded one (S-LoRA's per-adapter segments; eager steps, through
the Triton LoRA kernels and through the torch path's per-adapter loops), each as its mean
step time, how many steps replayed a CUDA graph, and the operators that took the most device time
(CPU time on the CPU smoke run) in a few profiled steps. Its JSON as profile_lora.json.

Sized for ~100 s on an H100/H200 (four engines; the first H200 run's three took ~60 s): 8B shape in
bf16, every adapter on the device (8 slots, ranks 8/16/32/64 twice), a decode batch of 64 requests of
512-token prompts, 16 timed and 4 profiled steps per configuration; ``llama-micro`` with a batch of 4
in the CPU smoke run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from elastune_bench.device.common import device_info, part_args, sync, write_part
from elastune_bench.serving.lora import adapter_names, free_device_memory


@dataclass(frozen=True)
class Plan:
    shape: str
    device: str
    batch: int
    prompt_len: int
    adapters: int
    warm_steps: int
    timed_steps: int
    profiled_steps: int
    top_ops: int = 20


FULL = Plan("llama-3-8b", "cuda", batch=64, prompt_len=512, adapters=8, warm_steps=4, timed_steps=16,
            profiled_steps=4)  # fmt: skip
"""Batch 64 at 512-token contexts: the engine part's batch-64 point, so the ``base`` run also says where
that step's time goes (43 % of its bandwidth roofline on the H200 against the issue's 70 %)."""
SMOKE = Plan("llama-micro", "cpu", batch=4, prompt_len=32, adapters=4, warm_steps=1, timed_steps=3,
             profiled_steps=1)  # fmt: skip
SLACK = 64
"""Output tokens each request may make (it is aborted after): more than its steps here."""
RUNS = {
    ("padded", "auto"): (("base", False), ("lora_padded", True)),
    ("padded", "torch"): (("base_graphlora", False), ("lora_padded_graphlora", True)),
    ("unpadded", "auto"): (("lora_unpadded", True),),
    (None, None): (("no_lora", False),),
}
"""Per (kernel, lora_backend), one engine and its runs: (name, whether every request has an adapter).
On CUDA ``auto`` is the Triton LoRA kernels (lora/sgmv.py), in the decode graphs too (either kernel);
``torch`` replays GraphLoRA (every slot over every row, masked), the graphs' LoRA before that. The
last engine has LoRA off: the plain decode step at batch 64 (the engine part's batch-64 point)."""


def _engine(plan: Plan, model: Any, kernel: str | None, backend: str | None, paths: dict[int, Any]) -> Any:
    """kernel None: an engine without LoRA."""
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        device=plan.device,  # type: ignore[arg-type]
        kv_cache_tokens=(plan.batch + 1) * (plan.prompt_len + SLACK), max_model_len=plan.prompt_len + SLACK,
        max_num_seqs=plan.batch,
        enable_prefix_caching=False, enable_lora=kernel is not None, max_loras=plan.adapters,
        max_cpu_loras=plan.adapters, lora_load_mode="cached",
        lora_kernel=kernel or "padded", lora_backend=backend or "auto",  # type: ignore[arg-type]
    )  # fmt: skip
    eng = LLMEngine(model.path, cfg, tokenizer=model.engine_tokenizer())
    # r8-0, r16-1, ...: the rank leads the name
    for name in adapter_names(plan.adapters) if kernel is not None else ():
        eng.load_lora(name, str(paths[int(name.split("-")[0][1:])]))
    return eng


@contextmanager
def _decoding(eng: Any, plan: Plan, vocab: int, with_adapters: bool) -> Iterator[None]:
    """The batch admitted, prefilled and past its warm-up steps; aborted on exit."""
    from elastune_worker.engine.core.sampling import SamplingParams

    gen = torch.Generator().manual_seed(plan.batch)
    prompts = torch.randint(0, vocab, (plan.batch, plan.prompt_len), generator=gen).tolist()
    steps = SLACK - 1  # more than the prefill, warm, timed and profiled steps: none finishes
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    names = adapter_names(plan.adapters)
    ids = [f"p{i}" for i in range(plan.batch)]
    for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        ref = eng.adapter_ref(names[i % len(names)]) if with_adapters else None
        eng.add_request(rid, prompt, params, adapter=ref)
    s = eng.scheduler
    while s.waiting or any(not q.output_token_ids for q in s.running):
        eng.step()
    for _ in range(plan.warm_steps):
        eng.step()
    try:
        yield
    finally:
        for rid in ids:
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()


def _top_ops(prof: Any, device: str, n: int) -> list[dict[str, Any]]:
    """The ``n`` operators with the most self time on the device (CPU: on the host), per profiled run."""
    on_gpu = device == "cuda"
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0)
        rows.append({"op": e.key, "calls": e.count, "self_device_ms": round(dev_us / 1e3, 3),
                     "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)})  # fmt: skip
    key = "self_device_ms" if on_gpu else "self_cpu_ms"
    return sorted(rows, key=lambda r: r[key], reverse=True)[:n]


def measure(eng: Any, plan: Plan, vocab: int, with_adapters: bool) -> dict[str, Any]:
    """Mean step time over the timed steps, graph replays among them, then a profile of a few steps."""
    from torch.profiler import ProfilerActivity, profile

    runner = eng.runner
    with _decoding(eng, plan, vocab, with_adapters):
        running = len(eng.scheduler.running)
        replayed0, eager0 = runner.steps_replayed, runner.steps_eager
        sync(plan.device)
        t0 = time.perf_counter()
        for _ in range(plan.timed_steps):
            eng.step()
        sync(plan.device)
        step_ms = (time.perf_counter() - t0) * 1e3 / plan.timed_steps
        graphs = runner.steps_replayed - replayed0
        eager = runner.steps_eager - eager0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(plan.profiled_steps):
                eng.step()
            sync(plan.device)
    return {"batch_running": running, "step_ms": round(step_ms, 3), "steps_graph": graphs,
            "steps_eager": eager, "profiled_steps": plan.profiled_steps,
            "top_ops": _top_ops(prof, plan.device, plan.top_ops)}  # fmt: skip


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    plan = SMOKE if args.smoke else FULL
    from elastune_bench.serving.shapes import bench_model
    from elastune_worker.modeling.random_init import SHAPES

    vocab = int(SHAPES[plan.shape]["vocab_size"])
    model = bench_model(plan.shape)
    result: dict[str, Any] = {"device": device_info(plan.device), "plan": plan.__dict__, "configs": {}}
    try:
        paths = model.lora_adapters()
        for (kernel, backend), runs in RUNS.items():
            eng = _engine(plan, model, kernel, backend, paths)
            for name, with_adapters in runs:
                r = result["configs"][name] = measure(eng, plan, vocab, with_adapters)
                r["lora_backend"] = eng.runner.lora_backend
                print(f"profile_lora {name}: {r['step_ms']} ms/step, graphs {r['steps_graph']}, "
                      f"eager {r['steps_eager']}; top: {r['top_ops'][0]['op'] if r['top_ops'] else '-'}",
                      flush=True)  # fmt: skip
                write_part(args.out, "profile_lora", result)
            del eng
            free_device_memory(plan.device)
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
