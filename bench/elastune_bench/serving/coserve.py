"""`elastune bench coserve`: FlexLLM co-serving against temporal sharing and a spatial split, in one run.

The same pod (the engine serving the tiny Llama), the same inference trace and the same tuning job in
every mode. The trace: ShareGPT prompts and response lengths (``data/sharegpt_250.json.gz``,
prompts truncated, outputs capped, greedy with ``ignore_eos``) arriving at the dataset's Poisson
timestamps compressed to a light and a heavy rate, replayed in real time in-process. The job: prompt
tuning of the same model (the trainer's promptTuning, the same seed and data), run for the trace's
duration. Modes:

* ``coserve``: the job attached to the engine as its step hook (``LLMEngine.attach_hook``): every
  iteration carries what the hybrid token scheduler leaves beside the inference tokens under the
  TPOT-derived target;
* ``temporal_<n>``: n inference iterations, then one whole finetuning step (forward, backward,
  optimizer) that blocks the engine; an idle engine runs finetuning steps back to back;
* ``inference_only``: the trace alone, no job: the SLO attainment the pod reaches at this load without
  finetuning, the reference that says whether the comparison is inside the pod's capacity;
* ``spatial``: one worker serves, another tunes. On the 2-core machine this is emulated by two
  processes each pinned to 1 torch thread (serving here, the trainer in a spawned process). The other
  modes run in one process with ``--threads`` torch threads (default 1: on the shared 2-core machine a
  second intra-op thread made the tiny model's iterations slower and noisier, not faster), so spatial
  has twice their cores by default — it stands for a second GPU.

``--device cuda`` (or auto with a GPU) serves and tunes on the GPU; spatial then shares that one GPU
between two processes (it stands for a second GPU only on the CPU). ``--modes`` runs a subset.

``--shape`` picks the model (serving/shapes.py): the tiny Llama (default), or a random-weight model of a
real shape (``llama-3-8b``, bf16 on a GPU: where a GPU's iterations are not launch-bound and FlexLLM's
claim can be tested), written once per run. The engine serves it by token ids (the trace tokenized
with the tiny tokenizer, whose ids fit the shape's vocabulary) and the trainer's base is made from the
same config once and shared by every mode's trainer (the co-served job must tune the engine's model
directory; it runs on the trainer's own copy of the weights, so the GPU holds the weights twice: 2 x 15
GiB at 8B). ``--light-requests`` shortens the light load (the goal compares the heavy one).

Per mode and load: finetuning tokens/s (sample tokens of completed optimizer steps, virtual tokens not
counted, over the trace's wall time), SLO attainment (% of requests whose TPOT is within the TPOT SLO),
TTFT and TPOT p50/p99. The TPOT SLO is ``--slo-factor`` x the engine's profiled decode step of 8
requests on this machine (printed). JSON (``--json``): ``<mode>.<load>`` with ``finetune_tokens_s``,
``slo_attainment_pct``, ``ttft_ms_p50/p99``, ``tpot_ms_p50/p99``, ``requests``, ``wall_s``,
``finetune_steps``; ``goal`` (co-serving / best temporal under heavy load) and ``machine`` (load average
before and after).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastune_bench.serving.shapes import TINY, BenchModel, bench_model, shape_names
from elastune_bench.stats import finish, loadavg, percentile
from elastune_common import datasets

TEMPORAL = (16, 32, 64, 128)
MODES = ("coserve", *(f"temporal_{n}" for n in TEMPORAL), "spatial", "inference_only")
CAPACITY_SLO_PCT = 90.0
"""The inference-only run's SLO attainment below which a load is past what the pod serves alone: a
finetuning comparison at that load measures the overload, not co-serving (FlexLLM sets its SLOs where
inference alone meets them)."""


@dataclass
class Trace:
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]
    """Seconds after the start."""


@dataclass
class Timing:
    arrival: float
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0


@dataclass
class RunResult:
    timings: list[Timing]
    wall_s: float
    finetune_tokens: int
    finetune_steps: int
    extra: dict[str, Any] = field(default_factory=dict)


def load_trace(tok: Any, dataset: Path, n: int, max_prompt: int, max_out: int, rate: float) -> Trace:
    """The first ``n`` usable entries; their arrival timestamps (a 1 req/s Poisson trace) sped up to
    ``rate`` requests per second."""
    data = datasets.read_json(dataset)
    speed = rate / float(data.get("metadata", {}).get("arrival_rate", 1.0))
    prompts, outs, times = [], [], []
    for e in data["entries"]:
        ids = tok(e["prompt"])["input_ids"][:max_prompt]
        if len(ids) < 4:
            continue
        prompts.append(ids)
        outs.append(max(4, min(max_out, int(e["response_length"]))))
        times.append(float(e["arrival_time"]))
        if len(prompts) == n:
            break
    t0 = times[0]
    return Trace(prompts, outs, [(t - t0) / speed for t in times])


def tuning_setup(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    from elastune_demo import tasks as T
    from elastune_worker.tuning.trainer import TuningConfig

    cfg = TuningConfig(
        method="promptTuning", virtual_tokens=8, batch_size=args.batch_size, max_iterations=10**6,
        learning_rate=0.3, max_length=64, seed=0,
    )  # fmt: skip
    return cfg, T.make_task(T.TaskSpec("classify", 0), n_train=64, n_eval=0, seed=3).train


def step_tokens(trainer: Any, step: int) -> int:
    """Sample tokens (input + target) of the global batch of ``step``."""
    from elastune_worker.tuning.trainer import global_batch_indices

    enc = trainer._train_enc
    batch = global_batch_indices(len(enc), trainer.cfg.batch_size, trainer.cfg.seed, step)
    return sum(len(enc[i].source) + len(enc[i].target) for i in batch)


def replay(engine: Any, trace: Trace, between: Any = None, idle: Any = None) -> tuple[list[Timing], float]:
    """Serve ``trace`` in real time. ``between()`` runs after every inference iteration, ``idle()`` when
    the engine has nothing to do (each may block: that is the mode's interference)."""
    from elastune_worker.engine.core.sampling import SamplingParams

    timings = [Timing(a) for a in trace.arrivals]
    start = time.perf_counter()
    i, n = 0, len(trace.prompts)
    while i < n or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < n and trace.arrivals[i] <= now:
            params = SamplingParams(max_tokens=trace.max_tokens[i], temperature=0.0, ignore_eos=True)
            engine.add_request(str(i), trace.prompts[i], params)
            i += 1
        if engine.has_unfinished():
            outputs = engine.step()
            t = time.perf_counter() - start
            for o in outputs:
                tm = timings[int(o.request_id)]
                if tm.tokens == 0:
                    tm.first = t
                tm.tokens += len(o.new_token_ids)
                tm.last = t
            if between is not None:
                between()
        elif idle is not None:
            idle()
        else:
            time.sleep(min(0.001, max(0.0, trace.arrivals[i] - now)) if i < n else 0)
    return timings, time.perf_counter() - start


def run_coserve(
    engine: Any, trainer: Any, trace: Trace, slo_s: float, cost: Any, args: argparse.Namespace
) -> RunResult:
    from elastune_worker.coserve.hook import CoServeHook
    from elastune_worker.coserve.job import CoServedJob
    from elastune_worker.coserve.planner import CoServeConfig, CoServePlanner, LatencyModel

    job = CoServedJob(trainer, served_model_dir=engine.model_path, micro_batch=args.micro_batch)
    per_token = max(cost.prefill_s_per_token, 1e-6)
    base = cost.decode_step_base_s
    planner = CoServePlanner(  # the finetuning lines start from the engine's and are refitted online
        CoServeConfig(tpot_slo_s=slo_s, max_window=args.max_window),
        LatencyModel(base, per_token),
        forward=LatencyModel(base, per_token),
        backward=LatencyModel(base, per_token),
    )
    engine.attach_hook(CoServeHook(job, planner))
    try:
        timings, wall = replay(engine, trace, idle=engine.step)  # an idle iteration is all finetuning
    finally:
        engine.detach_hook()
    steps = trainer.iterations
    fits = {
        "inference": planner.model,
        "finetune_forward": planner.forward,
        "finetune_backward": planner.backward,
    }
    models = {
        name: {"base_ms": round(m.base * 1e3, 3), "per_token_us": round(m.per_token * 1e6, 3)}
        for name, m in fits.items()
        if m is not None
    }
    extra = {"latency_models_final": models, "dropped": job.reason}
    return RunResult(timings, wall, sum(step_tokens(trainer, s) for s in range(steps)), steps, extra)


def run_temporal(engine: Any, trainer: Any, trace: Trace, n: int) -> RunResult:
    done = {"steps": 0, "iterations": 0}

    def finetune() -> None:
        trainer.step(done["steps"])
        done["steps"] += 1

    def between() -> None:
        done["iterations"] += 1
        if done["iterations"] % n == 0:
            finetune()

    timings, wall = replay(engine, trace, between=between, idle=finetune)
    steps = done["steps"]
    return RunResult(timings, wall, sum(step_tokens(trainer, s) for s in range(steps)), steps)


def _spatial_tuner(
    model: str, args: dict[str, Any], go: Any, stop: Any, out: Any, device: str = "cpu"
) -> None:
    """The tuning worker of the spatial split: one torch thread, steps until told to stop (a
    random-weight model's base is made here from its config: the worker's own copy)."""
    import torch

    torch.set_num_threads(1)
    from elastune_worker.tuning.trainer import Trainer

    cfg, records = tuning_setup(argparse.Namespace(**args))
    trainer = Trainer(model, cfg, records, [], device=device)
    trainer.step(0)  # warm (not counted): the first step pays one-off costs
    go.set()
    steps, t0 = 0, time.perf_counter()
    tokens = 0
    while not stop.is_set():
        trainer.step(1 + steps)
        tokens += step_tokens(trainer, 1 + steps)
        steps += 1
    out.put({"steps": steps, "tokens": tokens, "seconds": time.perf_counter() - t0})


def run_spatial(
    engine: Any, model: Path, trace: Trace, args: argparse.Namespace, device: str = "cpu"
) -> RunResult:
    import torch

    ctx = mp.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    tuner_args = (str(model), vars(args), go, stop, out, device)
    proc = ctx.Process(target=_spatial_tuner, args=tuner_args, daemon=True)
    proc.start()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not go.wait(300):
            raise RuntimeError("the spatial tuner did not start")
        timings, wall = replay(engine, trace)
    finally:
        stop.set()
        torch.set_num_threads(before)
    res = out.get(timeout=300)
    proc.join(60)
    # Tokens of the steps finished while serving, over the serving wall time (the last step ran past it).
    rate_tokens = int(res["tokens"] * min(1.0, wall / res["seconds"])) if res["seconds"] > 0 else 0
    return RunResult(timings, wall, rate_tokens, res["steps"], {"tuner_seconds": round(res["seconds"], 3)})


def summarize(r: RunResult, slo_s: float) -> dict[str, Any]:
    done = [t for t in r.timings if t.tokens > 0]
    ttft = [(t.first - t.arrival) * 1e3 for t in done]
    tpot = [(t.last - t.first) / (t.tokens - 1) * 1e3 for t in done if t.tokens > 1]
    ok = sum(1 for x in tpot if x <= slo_s * 1e3)
    return {
        "finetune_tokens_s": round(r.finetune_tokens / r.wall_s, 1),
        "finetune_steps": r.finetune_steps,
        "slo_attainment_pct": round(100.0 * ok / len(tpot), 1) if tpot else float("nan"),
        "ttft_ms_p50": round(percentile(ttft, 50), 2),
        "ttft_ms_p99": round(percentile(ttft, 99), 2),
        "tpot_ms_p50": round(percentile(tpot, 50), 3),
        "tpot_ms_p99": round(percentile(tpot, 99), 3),
        "requests": len(done),
        "wall_s": round(r.wall_s, 2),
        **r.extra,
    }


def goal(result: dict[str, Any], load: str = "heavy") -> dict[str, Any]:
    """FlexLLM's claim: co-serving >= 1.9x the finetuning throughput of the best temporal setting under
    heavy load, at equal or better SLO attainment."""
    co = result["coserve"][load]
    temporal = {m: result[m][load] for m in MODES if m.startswith("temporal") and m in result}
    best = max(temporal, key=lambda m: temporal[m]["finetune_tokens_s"])
    matching = [m for m in temporal if temporal[m]["slo_attainment_pct"] >= co["slo_attainment_pct"]]
    best_matching = max(matching, key=lambda m: temporal[m]["finetune_tokens_s"]) if matching else None

    def ratio(m: str) -> float:
        return round(co["finetune_tokens_s"] / max(temporal[m]["finetune_tokens_s"], 1e-9), 2)

    r_best = ratio(best)
    return {
        "load": load,
        "best_temporal": best,
        "ratio_vs_best_temporal": r_best,
        "best_temporal_slo_attainment_pct": temporal[best]["slo_attainment_pct"],
        "coserve_slo_attainment_pct": co["slo_attainment_pct"],
        "best_temporal_at_equal_or_better_slo": best_matching,
        "ratio_vs_best_temporal_at_equal_or_better_slo": ratio(best_matching) if best_matching else None,
        "met": r_best >= 1.9 and co["slo_attainment_pct"] >= temporal[best]["slo_attainment_pct"],
    } | _capacity(result, load)


def _capacity(result: dict[str, Any], load: str) -> dict[str, Any]:
    """The inference-only reference, when it ran: is this load within what the pod serves alone?"""
    alone = result.get("inference_only", {}).get(load)
    if alone is None:
        return {}
    pct = alone["slo_attainment_pct"]
    return {"inference_only_slo_attainment_pct": pct, "load_within_capacity": pct >= CAPACITY_SLO_PCT}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune bench coserve", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests and shorter outputs")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--dataset", type=Path, default=datasets.sharegpt_path(),
        help=f"the inference trace (default: ${datasets.DATASET_ENV} or data/{datasets.SHAREGPT_FILE})",
    )  # fmt: skip
    p.add_argument("--requests", type=int, help="requests per load (default 200; --quick 80)")
    p.add_argument("--light-requests", type=int, help="requests of the light load (default: --requests)")
    p.add_argument("--light-rate", type=float, default=8.0, help="requests per second at light load")
    p.add_argument("--heavy-rate", type=float, default=48.0, help="requests per second at heavy load")
    p.add_argument("--max-prompt", type=int, default=256, help="prompt tokens at most")
    p.add_argument("--max-output", type=int, help="output tokens at most (default 64; --quick 32)")
    p.add_argument("--slo-factor", type=float, default=3.0, help="TPOT SLO / profiled 8-request decode step")
    p.add_argument("--batch-size", type=int, default=8, help="the tuning job's batch size")
    p.add_argument("--max-window", type=int, default=512, help="finetuning tokens per iteration at most")
    p.add_argument("--micro-batch", type=int, default=2, help="rows of one co-served sequence")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the one-process modes")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if present")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument(
        "--shape", choices=shape_names(), default=TINY,
        help="the model: the tiny Llama, or a random-weight shape (llama-3-8b on a GPU)",
    )  # fmt: skip
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES) or "coserve" not in modes or not any(m.startswith("temporal") for m in modes):
        p.error(
            f"--modes: names from {', '.join(MODES)}, with coserve and a temporal one (the goal compares)"
        )
    if not args.dataset.exists():  # the repository ships it: a missing one is a wrong --dataset
        print(f"bench coserve: {datasets.not_found(args.dataset, 'dataset', '--dataset')}", file=sys.stderr)
        return 2
    model = bench_model(args.shape)
    try:
        return _run(args, model, modes)
    finally:
        model.close()


def _write(result: dict[str, Any], path: Path | None) -> None:
    """The figures so far (a time box may end the run before ``finish``)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def _run(args: argparse.Namespace, model: BenchModel, modes: list[str]) -> int:
    import torch

    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.core.sampling import SamplingParams
    from elastune_worker.engine.llm_engine import LLMEngine
    from elastune_worker.engine.profile import profile_costs
    from elastune_worker.tuning.trainer import Trainer, load_base_model

    started = time.perf_counter()
    n = args.requests or (80 if args.quick else 200)
    n_light = args.light_requests or n
    max_out = args.max_output or (32 if args.quick else 64)
    threads = args.threads
    torch.set_num_threads(threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    engine = LLMEngine(
        model.path,
        EngineConfig(
            # 4,096 blocks of 16 tokens; 2,048 (32,768 tokens: 4 GiB) for a random shape (Llama-3-8B's
            # KV is 128 KiB a token), so that the engine, the trainer's copy and both working sets fit
            # an 80 GiB GPU.
            num_kv_blocks=2048 if model.random else 4096,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            device=device,  # type: ignore[arg-type]
        ),
        tokenizer=model.engine_tokenizer(),
    )
    engine.generate([[5 + i] * 16 for i in range(8)], SamplingParams(max_tokens=16, ignore_eos=True))
    cost = profile_costs(engine)  # after a warm-up: first calls pay torch's one-off costs
    decode8 = cost.decode_step_base_s + 8 * cost.decode_step_per_seq_s
    slo_s = args.slo_factor * decode8
    rates = (("light", args.light_rate, n_light), ("heavy", args.heavy_rate, n))
    traces = {
        load: load_trace(model.tokenizer, args.dataset, count, args.max_prompt, max_out, rate)
        for load, rate, count in rates
    }
    cfg, records = tuning_setup(args)
    t0 = time.perf_counter()
    # One base for every mode's trainer (a random shape's is made on the device from its config).
    base = load_base_model(model.path, device) if any(m != "spatial" for m in modes) else None
    if base is not None:
        # One untimed finetuning step on the shared base: its first backward pays one-off costs (on
        # the H200 at the 8B shape the modes run first read 0 % SLO attainment at light load and the
        # one run last 100 %). The spatial tuner warms its own (_spatial_tuner).
        warm = Trainer(model.path, cfg, records, [], device=device, base_model=base)
        warm.step(0)
        del warm
        gc.collect()
    base_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "config": {
            "requests": n, "light_requests": n_light, "max_output": max_out, "max_prompt": args.max_prompt,
            "light_rate": args.light_rate, "heavy_rate": args.heavy_rate, "slo_factor": args.slo_factor,
            "tuning": {"method": cfg.method, "batch_size": cfg.batch_size, "max_length": cfg.max_length,
                       "virtual_tokens": cfg.virtual_tokens},
            "max_window": args.max_window, "micro_batch": args.micro_batch, "torch_threads": threads,
            "quick": args.quick, "device": device, "modes": modes,
            "dataset": datasets.display_path(args.dataset),
        },
        "model": {"shape": model.shape, "random_weights": model.random,
                  "engine_dtype": str(engine.runner.dtype).removeprefix("torch."),
                  "trainer_dtype": str(next(base.parameters()).dtype).removeprefix("torch.")
                  if base is not None else None,
                  "kv_blocks": engine.config.num_kv_blocks, "trainer_base_s": round(base_s, 2)},
        "tpot_slo_ms": round(slo_s * 1e3, 3),
        "profiled": {"decode8_ms": round(decode8 * 1e3, 3),
                     "prefill_us_per_token": round(cost.prefill_s_per_token * 1e6, 3)},
        "machine": {"nproc": os.cpu_count(), "loadavg_before": loadavg()},
        "spatial_emulation": "two processes, 1 torch thread each (serving | tuning); other modes: one "
        f"process, {threads} torch threads",
    }  # fmt: skip
    if device == "cuda":
        result["model"]["gpu_memory_after_set_up_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    print(f"bench coserve on {model.label()}: {n_light} light / {n} heavy requests, TPOT SLO "
          f"{slo_s * 1e3:.2f} ms ({args.slo_factor} x profiled 8-request decode step {decode8 * 1e3:.2f} ms)"
          f", set up in {time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
    for mode in modes:
        result[mode] = {}
        for load, trace in traces.items():
            engine.reset_counters()  # the same cold prefix cache for every mode
            if mode == "spatial":
                r = run_spatial(engine, model.path, trace, args, device)
            elif mode == "inference_only":
                r = RunResult(*replay(engine, trace), finetune_tokens=0, finetune_steps=0)
            else:
                trainer = Trainer(model.path, cfg, records, [], device=device, base_model=base)
                if mode == "coserve":
                    r = run_coserve(engine, trainer, trace, slo_s, cost, args)
                else:
                    r = run_temporal(engine, trainer, trace, int(mode.split("_")[1]))
                del trainer
                gc.collect()  # the last trainer's graph and optimizer state go before the next
            f = result[mode][load] = summarize(r, slo_s)
            if device == "cuda":
                f["gpu_memory_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            _write(result, args.json)
            print(
                f"  {mode:12s} {load:5s} finetune {f['finetune_tokens_s']:8.1f} tok/s"
                f"  SLO {f['slo_attainment_pct']:5.1f} %  TPOT p50 {f['tpot_ms_p50']:7.2f} p99 "
                f"{f['tpot_ms_p99']:7.2f} ms  TTFT p50 {f['ttft_ms_p50']:8.1f} "
                f"p99 {f['ttft_ms_p99']:8.1f} ms  ({f['finetune_steps']} steps, {f['wall_s']} s)",
                flush=True,
            )
    result["goal"] = goal(result)
    result["machine"]["loadavg_after"] = loadavg()
    result["wall_total_s"] = round(time.perf_counter() - started, 1)
    g = result["goal"]
    print(f"  goal (heavy): co-serving / best temporal ({g['best_temporal']}) = "
          f"{g['ratio_vs_best_temporal']}x, "
          f"SLO {g['coserve_slo_attainment_pct']} % vs {g['best_temporal_slo_attainment_pct']} %: "
          f"{'met' if g['met'] else 'missed'}", flush=True)  # fmt: skip
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
