"""`elastune bench ssjf`: FCFS vs speculative shortest-job-first on the real engine, three batching settings.

The experiment of the SSJF paper ("Efficient Interactive LLM Serving with Proxy Model-based Sequence
Length Prediction", §4.2) on Elastune's engine: the in-process ``LLMEngine`` serving the tiny Llama
(``tiny-llama-v1``) replays the trace of the predictor's held-out source in real time: AlpacaEval's
Self-Instruct prompts with gpt-3.5-turbo-0301's answers (``data/alpacaeval_gpt35_0301.json.gz``,
``--trace``/``--trace-source``), a source the predictor never trained on. Each request's prompt is the
dataset's prompt (the tiny Llama's tokens, the first ``--max-prompt``
kept) and its output length is forced to the dataset's response length (``max_tokens`` = that
length, ``ignore_eos``, greedy), so what a request costs is what it cost on the LLM that answered it.

For each batching setting (none, dynamic, continuous; ``--max-num-seqs`` 4, the paper's batch size) three
waiting-queue orders run on the same arrivals: FCFS; SJF on the predictor's lengths (``sjf``, the
request's ``priority`` = its predicted output tokens); SJF on the true lengths (oracle). The predicted
lengths are the built predictor's (``ssjf-predictor-v1``) on the trace's prompts; the JSON counts the
trace's prompts that are among the predictor's training prompts (``predictor.trace_prompts_in_training``,
0 for the held-out source).

Load. The dataset's arrivals (Poisson, 1 request/s) are compressed by a factor per setting so that the
offered output tokens per second equal ``--load`` × the setting's decode capacity, estimated before the
runs from measured step times (one request per step for none, ``max_num_seqs`` for the batching
settings). ``--load`` 1.0 (the default) offers what the engine can decode at best: queues build up,
which is where the order matters. The factors are in the JSON (``settings.<s>.arrival_speedup``).

Figures per run: job completion time (arrival → last token) mean and p99, throughput (output tokens
/ (last finish − first arrival)), the starvation guard's admissions. JSON (``--json``): ``ssjf.fcfs``,
``ssjf.sjf_predicted``, ``ssjf.sjf_oracle`` (continuous batching), ``ssjf.settings.<none|dynamic|
continuous>.<order>``, ``ssjf.predictor`` (the build's held-out-source MAE / Spearman / median
baseline and split, the bench requests' figures, per-prompt latency),
``ssjf.jct_mean_reduction_pct_vs_fcfs`` (continuous, predicted) and per setting, ``machine`` (load
average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastune_bench.stats import finish, loadavg, percentile
from elastune_common import datasets

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ssjf.json"
SETTINGS = ("none", "dynamic", "continuous")
ORDERS = ("fcfs", "sjf_predicted", "sjf_oracle")
HELD_OUT = "alpacaeval/selfinstruct"
"""The predictor's held-out source (``PredictorSpec.held_out_source``; this module imports no torch)."""


@dataclass(frozen=True)
class BenchRequest:
    rid: str
    prompt_ids: list[int]
    output_tokens: int
    """Forced output length: the dataset's response length."""
    predicted: int
    """The predictor's prediction (a source it never trained on, by default)."""
    at: float
    """Arrival, seconds from the trace's start (before scaling)."""


# -- the workload -----------------------------------------------------------------------------------
def workload(
    trace: Path, source: str | None, n: int | None, max_prompt: int, tokenizer: Any, predictor: Any
) -> tuple[list[BenchRequest], list[str]]:
    """The first ``n`` requests of the trace's ``source`` entries (all when None; every entry when no
    source), arrivals rebased to 0, each with the predictor's length; and their prompts."""
    from elastune_ssjf.build import load_dataset

    entries = [e for e in load_dataset(trace) if source is None or e.source == source]
    if not entries:
        raise ValueError(f"{trace} has no entry of source {source!r}")
    order = sorted(range(len(entries)), key=lambda i: entries[i].arrival_time)[:n]
    prompts = [entries[i].prompt for i in order]
    predicted = predictor.predict(prompts)
    t0 = entries[order[0]].arrival_time
    out = []
    for i, guess in zip(order, predicted, strict=True):
        e = entries[i]
        ids = list(tokenizer(e.prompt)["input_ids"])[:max_prompt] or [tokenizer.eos_token_id]
        out.append(BenchRequest(f"r{i}", ids, e.response_length, guess, e.arrival_time - t0))
    return out, prompts


# -- the engine -------------------------------------------------------------------------------------
def make_engine(model: Path, batching: str, policy: str, args: argparse.Namespace, tokenizer: Any) -> Any:
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.llm_engine import LLMEngine

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=args.kv_tokens,
        batching=batching,  # type: ignore[arg-type]
        queue_policy=policy,  # type: ignore[arg-type]
        sjf_max_bypass=args.sjf_max_bypass,
        device="cpu",
        dtype="float32",
    )
    return LLMEngine(model, config, tokenizer=tokenizer)


def step_seconds(engine: Any, batch: int, steps: int = 48) -> float:
    """Median CPU seconds of a decode step with ``batch`` requests of a 128-token prompt."""
    from elastune_worker.engine.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"cal{batch}-{b}", [5 + (b * 7 + t) % 500 for t in range(128)], params)
    engine.step()  # the prefills
    times = []
    while engine.has_unfinished():
        t0 = time.process_time()
        engine.step()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def replay(
    engine: Any, reqs: list[BenchRequest], speedup: float, order: str, clock: str = "cpu"
) -> dict[str, Any]:
    """Add each request at its (compressed) arrival, step the engine while it has work; JCT of each.

    clock "cpu": time is the engine's own CPU time (``time.process_time`` around each iteration, the
    process runs one torch thread), idle gaps jump to the next arrival: other jobs on shared cores
    neither slow the engine down in the figures nor change what it was loaded with. clock "wall":
    real time, with sleeps while idle."""
    from elastune_worker.engine.core.sampling import SamplingParams

    pending = sorted(reqs, key=lambda r: r.at)
    by_id = {r.rid: r for r in reqs}
    arrival: dict[str, float] = {}
    finish: dict[str, float] = {}
    tokens = 0
    i = 0
    wall = clock == "wall"
    t0 = time.monotonic() + 0.01
    vnow = 0.0
    while len(finish) < len(reqs):
        now = time.monotonic() - t0 if wall else vnow
        c0 = time.process_time()
        while i < len(pending) and pending[i].at / speedup <= now:
            r = pending[i]
            at = r.at / speedup
            prio = 0 if order == "fcfs" else r.output_tokens if order == "sjf_oracle" else r.predicted
            params = SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(r.rid, r.prompt_ids, params, priority=prio, arrival_time=at)
            arrival[r.rid] = at
            i += 1
        if engine.has_unfinished():
            outputs = engine.step()
            vnow += time.process_time() - c0
            for out in outputs:
                tokens += len(out.new_token_ids)
                if out.finished:
                    finish[out.request_id] = time.monotonic() - t0 if wall else vnow
                    if out.completion_tokens != by_id[out.request_id].output_tokens:
                        raise RuntimeError(f"{out.request_id} stopped early: {out.finish_reason}")
        elif i < len(pending):
            if wall:
                time.sleep(max(0.0, pending[i].at / speedup - (time.monotonic() - t0)))
            else:
                vnow = pending[i].at / speedup
    jct = [finish[r] - arrival[r] for r in finish]
    span = max(finish.values()) - min(arrival.values())
    waiting = engine.scheduler.waiting
    return {
        "requests": len(reqs),
        "output_tokens": tokens,
        "jct_s_mean": round(statistics.fmean(jct), 3),
        "jct_s_p50": round(percentile(jct, 50), 3),
        "jct_s_p99": round(percentile(jct, 99), 3),
        "throughput_tok_s": round(tokens / span, 1),
        "makespan_s": round(span, 3),
        "starved_admissions": int(getattr(waiting, "num_starved_admissions", 0)),
        "preemptions": engine.stats().preemptions,
    }


def reduction(base: dict[str, Any], other: dict[str, Any]) -> float:
    return round(100 * (1 - other["jct_s_mean"] / base["jct_s_mean"]), 1)


# -- the predictor ----------------------------------------------------------------------------------
def predictor_figures(
    reqs: list[BenchRequest], prompts: list[str], predictor: Any, pdir: Path
) -> dict[str, Any]:
    """The build's held-out-source figures and split, the bench requests' figures, per-prompt latency."""
    from elastune_ssjf.build import mae, prompt_digest, spearman
    from elastune_ssjf.predictor import dataset_predictions

    info = predictor.info
    test = info["metrics"]["test"]
    trained = set(dataset_predictions(pdir)["split"]["train_prompts"])
    lat = []
    for p in prompts:  # one at a time, as the gateway asks for each request
        t0 = time.perf_counter()
        predictor.predict([p])
        lat.append((time.perf_counter() - t0) * 1000)
    pred = [r.predicted for r in reqs]
    truth = [r.output_tokens for r in reqs]
    rho = spearman(pred, truth)
    return {
        "model": info["name"],
        "mae_tokens": test["mae_tokens"],
        "spearman": test["spearman"],
        "baseline_mae_tokens": test["baseline_mae_tokens"],
        "baseline_median_tokens": test["baseline_median_tokens"],
        "heldout_prompts": test["n"],
        "split": info["split"],
        "loso_mean_spearman": info["metrics"]["loso"]["mean_spearman"],
        "trace_prompts_in_training": sum(prompt_digest(p) in trained for p in prompts),
        "bench_requests": {
            "n": len(reqs),
            "mae_tokens": round(mae(pred, truth), 2),
            "spearman": None if rho is None else round(rho, 4),
        },
        "latency_ms_mean": round(statistics.fmean(lat), 2),
        "latency_ms_p99": round(percentile(lat, 99), 2),
    }


# -- the run ----------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastune bench ssjf", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the first 40 requests of the trace (< 2 min)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--dataset", type=Path, default=datasets.sharegpt_path(),
        help=f"the predictor's ShareGPT training data (default: ${datasets.DATASET_ENV} or "
        f"data/{datasets.SHAREGPT_FILE})",
    )  # fmt: skip
    p.add_argument(
        "--trace", type=Path, default=datasets.alpacaeval_path(),
        help=f"the replayed requests (default: data/{datasets.ALPACAEVAL_FILE})",
    )  # fmt: skip
    p.add_argument(
        "--trace-source", default=HELD_OUT,
        help=f"replay only the trace's entries of this source ('' for all; default: {HELD_OUT}, the "
        "predictor's held-out source)",
    )  # fmt: skip
    p.add_argument("--requests", type=int, help="requests from the trace's start (default all; --quick 40)")
    p.add_argument("--load", type=float, default=1.0, help="offered tokens/s over estimated capacity")
    p.add_argument("--max-num-seqs", type=int, default=4, help="batch size (the paper's 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prompt", type=int, default=512, help="prompt tokens kept at most")
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--sjf-max-bypass", type=int, default=64, help="the starvation guard (0: off)")
    p.add_argument("--reps", type=int, help="runs of each order, interleaved; the median is kept (default 1)")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the engine's CPU time (robust on shared cores, default); wall: real time",
    )
    p.add_argument("--settings", default=",".join(SETTINGS), help="batching settings to run")
    return p


def run(quick: bool, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Everything, measured (``args``: the CLI's options; default: its defaults)."""
    args = args if args is not None else parser().parse_args([])
    args.quick = quick
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import AutoTokenizer

    from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model
    from elastune_ssjf.build import ensure_predictor
    from elastune_ssjf.predictor import LengthPredictor

    torch.set_num_threads(1)
    machine: dict[str, Any] = {"nproc": os.cpu_count(), "loadavg_before": loadavg(), "torch_threads": 1}
    n = args.requests or (40 if args.quick else None)
    reps = args.reps or 1
    model = ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    pdir = ensure_predictor(dataset=args.dataset)
    length_predictor = LengthPredictor.load(pdir)
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    tok.model_max_length = 1 << 30  # prompts are cut to --max-prompt tokens below
    source = args.trace_source or None
    reqs, prompts = workload(args.trace, source, n, args.max_prompt, tok, length_predictor)
    predictor = predictor_figures(reqs, prompts, length_predictor, pdir)
    del length_predictor
    print(
        f"bench ssjf: {len(reqs)} requests of {source or 'every source'}, "
        f"{sum(r.output_tokens for r in reqs)} output tokens ({predictor['trace_prompts_in_training']} of "
        f"their prompts in the predictor's training); predictor on them: MAE "
        f"{predictor['bench_requests']['mae_tokens']}, Spearman {predictor['bench_requests']['spearman']}; "
        f"build's held-out MAE {predictor['mae_tokens']} (median {predictor['baseline_mae_tokens']}), "
        f"Spearman {predictor['spearman']}; {predictor['latency_ms_mean']} ms per prompt",
        flush=True,
    )

    # Capacity: decode steps at batch 1 and at max_num_seqs (the engine's real cost on this machine).
    cal = make_engine(model, "continuous", "fcfs", args, tok)
    step1, step_b = step_seconds(cal, 1), step_seconds(cal, args.max_num_seqs)
    del cal
    print(
        f"  decode step {step1 * 1000:.2f} ms (1 request), {step_b * 1000:.2f} ms ({args.max_num_seqs});"
        f" load {args.load}, clock {args.clock}",
        flush=True,
    )
    trace_s = max(r.at for r in reqs) or 1.0
    offered = sum(r.output_tokens for r in reqs) / trace_s  # output tokens/s of the uncompressed trace
    settings: dict[str, Any] = {}
    for setting in [s for s in args.settings.split(",") if s]:
        if setting not in SETTINGS:
            raise SystemExit(f"unknown batching setting {setting!r}; choose from {', '.join(SETTINGS)}")
        capacity = 1 / step1 if setting == "none" else args.max_num_seqs / step_b
        speedup = args.load * capacity / offered
        row: dict[str, Any] = {
            "arrival_speedup": round(speedup, 3),
            "capacity_tok_s_estimate": round(capacity, 1),
            "offered_tok_s": round(offered * speedup, 1),
        }
        runs: dict[str, list[dict[str, Any]]] = {order: [] for order in ORDERS}
        for rep in range(reps):  # interleaved, alternating the order, so drift hits all alike
            for order in ORDERS if rep % 2 == 0 else ORDERS[::-1]:
                engine = make_engine(model, setting, "fcfs" if order == "fcfs" else "sjf", args, tok)
                runs[order].append(replay(engine, reqs, speedup, order, args.clock))
                f = runs[order][-1]
                print(
                    f"  {setting:10s} {order:13s} JCT mean {f['jct_s_mean']:7.2f} s"
                    f"  p99 {f['jct_s_p99']:7.2f} s  {f['throughput_tok_s']:7.1f} tok/s"
                    f"  starved {f['starved_admissions']}",
                    flush=True,
                )
        for order in ORDERS:
            ordered = sorted(runs[order], key=lambda r: r["jct_s_mean"])
            row[order] = {
                **ordered[len(ordered) // 2],
                "jct_s_mean_runs": [r["jct_s_mean"] for r in runs[order]],
            }
        row["jct_mean_reduction_pct_vs_fcfs"] = reduction(row["fcfs"], row["sjf_predicted"])
        row["jct_mean_reduction_pct_vs_fcfs_oracle"] = reduction(row["fcfs"], row["sjf_oracle"])
        settings[setting] = row
    machine["loadavg_after"] = loadavg()
    machine["step_ms_batch1"] = round(step1 * 1000, 3)
    machine[f"step_ms_batch{args.max_num_seqs}"] = round(step_b * 1000, 3)
    ssjf: dict[str, Any] = {"settings": settings, "predictor": predictor}
    if "continuous" in settings:
        cont = settings["continuous"]
        ssjf.update({order: cont[order] for order in ORDERS})
        ssjf["jct_mean_reduction_pct_vs_fcfs"] = cont["jct_mean_reduction_pct_vs_fcfs"]
        ssjf["jct_mean_reduction_pct_vs_fcfs_oracle"] = cont["jct_mean_reduction_pct_vs_fcfs_oracle"]
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
    return {
        "ssjf": ssjf,
        "config": {
            **config,
            "dataset": datasets.display_path(args.dataset),
            "trace": datasets.display_path(args.trace),
            "requests": len(reqs),
            "model": TINY_LLAMA_SPEC.name,
        },
        "machine": machine,
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for path, flag in ((args.dataset, "--dataset"), (args.trace, "--trace")):
        if not path.exists():
            print(f"bench ssjf: {datasets.not_found(path, 'dataset', flag)}", file=sys.stderr)
            return 2
    result = run(args.quick, args)
    for name, row in result["ssjf"]["settings"].items():
        print(
            f"  {name}: SJF (predicted) mean JCT {row['jct_mean_reduction_pct_vs_fcfs']:+.1f} % vs FCFS "
            f"reduction; oracle {row['jct_mean_reduction_pct_vs_fcfs_oracle']:+.1f} %",
            flush=True,
        )
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
