"""``elastune bench route [--quick] [--json PATH]``: where a request goes, measured.

a. prefix: a Preble-style workload (long shared documents behind a shared system prompt, a short
   question per request, short answers) sent with Poisson arrivals through each router in front of the
   SAME real local workers (tiny Llama, restarted before each router so every one starts with empty
   prefix caches): our gateway with round-robin, least-load and Preble's E2, and the peer routers
   ``vllm-router --policy cache_aware`` and SGLang's ``smg --policy cache_aware`` from their PyPI wheels
   (a peer that cannot run is recorded as skipped with the reason). The rate is set in the same run from
   the workers' measured service time. Then the same policies in the simulator at 8 and 32 endpoints
   with the cost model the real workers published (their profiled prefill/decode fit).
b. rank: CaraServe's rank-aware routing vs MostIdle / FirstFit / Random in the simulator (60 servers,
   skewed adapter popularity, mixed ranks): SLO attainment and time per token. Then on real workers
   (local processes, each holding adapters of ranks 8-64) through our gateway, which resolves each
   request's adapter and rank once and hands both to the policy: rank-aware and the combined router
   against round-robin and least-load on the same heterogeneous-rank Poisson trace.
c. ssjf: the engine-side SSJF benchmark (``python -m elastune_bench.serving.ssjf``) run as a subprocess,
   its figures merged here (skipped with the reason when that module is not installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from elastune_bench.processes import (
    ServiceProcess,
    start_gateway,
    start_peer,
    start_worker,
    wait_for_endpoints,
    wait_for_worker,
)
from elastune_bench.sim.routing.experiments import Experiment, run_experiment
from elastune_bench.sim.routing.metrics import percentile
from elastune_common.bus import Bus
from elastune_common.servers import Server, start_redis
from elastune_contract.protocol import ServingCost
from elastune_gateway.routing.cost import CostModel
from elastune_gateway.routing.policy import RoutingPolicyName
from elastune_gateway.server.views import cost_model

RESULTS = Path("benchmarks/results/route.json")
OURS: dict[str, RoutingPolicyName] = {"round_robin": "roundRobin", "least_load": "leastLoad", "e2": "preble"}
PEERS = {"vllm_router_cache_aware": "vllm-router", "smg_cache_aware": "smg"}
_WORDS = (
    "record", "value", "field", "table", "river", "city", "weather", "book", "author", "title", "unit",
    "metre", "gram", "litre", "hour", "minute", "north", "south", "east", "west", "answer", "question",
    "convert", "report", "summary", "account", "order", "invoice", "customer", "item", "price",
    "amount", "date", "region", "server", "request", "model", "adapter", "token", "cache", "prefix",
    "policy", "engine", "batch",
)  # fmt: skip


@dataclass(frozen=True)
class RealSetup:
    workers: int = 2
    documents: int = 12
    document_words: int = 550
    """≈ 1,200 tokens of the tiny Llama's tokenizer per prompt."""
    kv_cache_tokens: int = 8192
    """Per worker: about half the documents fit, so where a request goes decides its cache hits."""
    requests: int = 160
    output_tokens: int = 4
    utilization: float = 0.7
    """Offered load as a share of the pool's capacity at its all-miss service time."""
    seed: int = 0


# -- the workload ------------------------------------------------------------------------------------------
def prefix_prompts(setup: RealSetup, salt: int) -> list[str]:
    """Requests over shared documents. The order of documents and questions is the same for every
    ``salt``; the documents' words are drawn anew, so a router's run never finds another's documents in
    a cache while lengths and sharing stay the same."""
    order = random.Random(setup.seed)
    text = random.Random(1000 * setup.seed + salt)
    system = "You answer questions about the document below in one word. " * 4
    docs = [
        " ".join(text.choice(_WORDS) for _ in range(setup.document_words)) for _ in range(setup.documents)
    ]
    out = []
    for i in range(setup.requests):
        doc = docs[order.randrange(setup.documents)]
        out.append(f"{system}\n{doc}\nQuestion {i}: which {order.choice(_WORDS)} comes first?")
    return out


def poisson_times(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def drive(
    url: str, model: str, prompts: Sequence[str], times: Sequence[float], max_tokens: int
) -> dict[str, Any]:
    """Sends each prompt at its time (open loop) and measures arrival → answer."""
    latencies: list[float] = []
    errors: list[str] = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(prompt: str, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            t0 = time.perf_counter()
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            try:
                r = await client.post(url + "/v1/completions", json=body)
                if r.status_code != 200:
                    errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                    return
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(p, t) for p, t in zip(prompts, times, strict=True)))
        wall = time.perf_counter() - start
    if not latencies:
        raise RuntimeError(f"every request failed: {errors[:3]}")
    return {
        "latency_s_mean": round(statistics.fmean(latencies), 4),
        "latency_s_p50": round(percentile(latencies, 50), 4),
        "latency_s_p99": round(percentile(latencies, 99), 4),
        "requests": len(latencies),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 2),
    }


# -- the pool of real workers -----------------------------------------------------------------------------
class Pool:
    """Real worker processes (tiny Llama) registered in a real Redis, restarted on demand."""

    MODEL = "tiny-llama"

    def __init__(self, setup: RealSetup, redis: Server, logs: Path) -> None:
        self.setup, self.redis, self.logs = setup, redis, logs
        self.ns = f"route{time.time_ns()}"
        self.procs: list[ServiceProcess] = []

    def restart(self) -> list[str]:
        self.stop()
        self.ns = f"route{time.time_ns()}"
        extra = (
            "--kv-cache-tokens",
            str(self.setup.kv_cache_tokens),
            "--threads",
            "1",
            "--engine-threads",
            "1",
        )
        self.procs = [
            start_worker(
                self.redis.url,
                self.ns,
                f"w{i}",
                "elastune/tiny-llama",
                self.MODEL,
                self.logs,
                *extra,
                wait=False,
            )
            for i in range(self.setup.workers)
        ]
        for p in self.procs:
            wait_for_worker(p, self.redis.url, self.ns)
        return [p.url for p in self.procs]

    def published_cost(self) -> ServingCost | None:
        bus = Bus(self.redis.url, self.ns)
        try:
            for rec in bus.workers().values():
                if rec.serving is not None and rec.serving.cost is not None:
                    return rec.serving.cost
        finally:
            bus.close()
        return None

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        self.procs = []


def service_time(url: str, model: str, prompts: Sequence[str], max_tokens: int) -> float:
    """Median seconds of one request alone on a worker, every prompt a cache miss (fresh documents)."""
    times = []
    with httpx.Client(timeout=120) as c:
        for p in prompts:
            t0 = time.perf_counter()
            body = {
                "model": model,
                "prompt": p,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            c.post(url + "/v1/completions", json=body).raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_real(setup: RealSetup, logs: Path, say: Callable[[str], None]) -> dict[str, Any]:
    redis = start_redis(logs)
    pool = Pool(setup, redis, logs)
    out: dict[str, Any] = {}
    try:
        urls = pool.restart()
        probe = prefix_prompts(replace(setup, requests=5, seed=setup.seed + 99), salt=999)
        alone = service_time(urls[0], Pool.MODEL, probe, setup.output_tokens)
        rate = setup.utilization * setup.workers / alone
        times = poisson_times(setup.requests, rate, setup.seed)
        out["setup"] = {
            **setup.__dict__, "service_time_s_all_miss": round(alone, 4), "rate_per_s": round(rate, 3),
            "published_cost": (c.model_dump() if (c := pool.published_cost()) else None),
        }  # fmt: skip
        say(
            f"prefix.real: {setup.workers} workers, miss service time {alone * 1000:.0f} ms"
            f" -> {rate:.2f} req/s"
        )
        routers = [*OURS, *PEERS]
        for salt, name in enumerate(routers, start=1):
            urls = pool.restart()  # empty prefix caches for every router
            prompts = prefix_prompts(setup, salt)
            front: ServiceProcess | None = None
            try:
                if name in OURS:
                    front = start_gateway(redis.url, pool.ns, logs, "--policy", OURS[name])
                    wait_for_endpoints(front.url, setup.workers)
                else:
                    front = start_peer(PEERS[name], urls, logs, Pool.MODEL)
            except (OSError, RuntimeError) as exc:
                out[name] = {"skipped": str(exc)[:500]}
                say(f"  {name:24s} skipped: {str(exc)[:160]}")
                continue
            try:
                load_before = os.getloadavg()[0]
                res = asyncio.run(drive(front.url, Pool.MODEL, prompts, times, setup.output_tokens))
                res["loadavg_1m_before"], res["loadavg_1m_after"] = (
                    round(load_before, 2),
                    round(os.getloadavg()[0], 2),
                )
                out[name] = res
                say(
                    f"  {name:24s} mean {res['latency_s_mean'] * 1000:7.0f} ms"
                    f"  p99 {res['latency_s_p99'] * 1000:7.0f} ms"
                    f"  errors {res['errors']}  load {load_before:.1f}"
                )
            finally:
                front.stop()
    finally:
        pool.stop()
        redis.proc.kill()
        redis.proc.wait()
    return out


# -- the simulator ----------------------------------------------------------------------------------------
def _request_seconds(cost: CostModel, prompt: float, output: float) -> float:
    return cost.prefill_seconds(int(prompt)) + output * (cost.iteration_base + cost.decode_per_seq)


def run_sim_prefix(endpoints: int, fitted: CostModel | None, quick: bool) -> dict[str, Any]:
    """Same policies in the simulator. With the real workers' fitted cost (tiny Llama on this CPU), the
    arrival rate is scaled so one request's service time relative to the inter-arrival time equals the
    default experiment's; without it, the placeholder GPU-shaped cost model (routing/cost.py)."""
    base = Experiment(workload="prefix", endpoints=endpoints, requests=1200 if quick else None)
    exp = base
    scale = 1.0
    if fitted is not None:
        mean_prompt, mean_output = 200 + 2750 + 110, 36  # PrefixWorkload's defaults
        scale = _request_seconds(CostModel(), mean_prompt, mean_output) / _request_seconds(
            fitted, mean_prompt, mean_output
        )
        exp = replace(base, cost=fitted, rate=base.pool_rate * scale, requests=base.n_requests)
    out: dict[str, Any] = {
        "cost": "fitted from the real workers" if fitted else "placeholder",
        "rate_scale": round(scale, 3),
    }
    for key, policy in OURS.items():
        s = run_experiment(exp, policy).summary
        out[key] = {
            "latency_s_mean": round(s.mean_latency, 4), "latency_s_p99": round(s.p99_latency, 4),
            "cache_hit_pct": round(100 * s.cache_hit, 1),
        }  # fmt: skip
    return out


RANK_RATES_PER_SERVER = (5.0, 5.5, 6.0, 7.0)
"""Requests per second per server of the rank sweep; the headline is 5.5/s, where the baselines miss
TPOT SLOs (at 5/s every policy but FirstFit nearly meets them; from 6/s rank-aware falls to 99 % and
below)."""
RANK_HEADLINE_RATE = 5.5
RANK_POLICIES: tuple[tuple[str, RoutingPolicyName], ...] = (
    ("rank_aware", "rankAware"), ("most_idle", "mostIdle"), ("first_fit", "firstFit"), ("random", "random"),
)  # fmt: skip
RANK_REAL_POLICIES: tuple[tuple[str, RoutingPolicyName], ...] = (
    ("rank_aware", "rankAware"), ("combined", "combined"), ("round_robin", "roundRobin"),
    ("least_load", "leastLoad"),
)  # fmt: skip
"""On real workers: CaraServe's policy and ours against the gateway's usual defaults."""


def run_sim_rank() -> dict[str, Any]:
    """CaraServe §7.5's comparison at 60 servers (1,000 adapters of ranks 8–64, Zipf popularity, TPOT
    SLO 50 ms), over a sweep of loads; the headline figures are at RANK_HEADLINE_RATE."""
    out: dict[str, Any] = {"sweep": {}}
    for per_server in RANK_RATES_PER_SERVER:
        exp = Experiment(workload="lora", endpoints=60, rate=60 * per_server, requests=6000)
        row: dict[str, Any] = {}
        for key, policy in RANK_POLICIES:
            s = run_experiment(exp, policy).summary
            row[key] = {
                "slo_attainment_pct": round(100 * (s.slo_attainment or 0.0), 2),
                "tpot_ms_mean": round(1000 * s.mean_tpot, 2), "tpot_ms_p99": round(1000 * s.p99_tpot, 2),
                "latency_s_mean": round(s.mean_latency, 4),
            }  # fmt: skip
        out["sweep"][f"{per_server:g}_per_server"] = row
        if per_server == RANK_HEADLINE_RATE:
            out.update(row)
            out["setup"] = exp.describe()
    return out


@dataclass(frozen=True)
class RankSetup:
    workers: int = 3
    requests: int = 150
    rate: float = 15.0
    """Poisson requests per second over the pool."""
    output_tokens: int = 24
    seed: int = 0


def _adapter_paths() -> dict[int, str]:
    """The project's rank 8/16/32/64 adapters (built by the worker package if missing)."""
    code = (
        "import json; from elastune_demo.adapters import ensure_tiny_adapter as e; "
        "print(json.dumps({r: str(e(r)) for r in (8, 16, 32, 64)}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


async def _stream_tpot(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int, headers: dict[str, str]
) -> float:
    """Seconds per output token after the first, of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    stamps: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"text":""' not in line:
                stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


async def _drive_rank(
    url: str, requests: list[tuple[float, str, str]], tokens: int, slo_s: float
) -> list[float]:
    headers = {"x-slo-tpot-ms": f"{slo_s * 1000:.3f}"}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(at: float, model: str, prompt: str) -> float:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await _stream_tpot(client, url, model, prompt, tokens, headers)

        return list(await asyncio.gather(*(one(*r) for r in requests)))


def run_rank_real(setup: RankSetup, logs: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """CaraServe's comparison on real workers: each holds the four adapters (ranks 8-64, padded kernel,
    their LoRA cost profiled at start and published); the same Poisson trace of streamed requests with
    a TPOT SLO through our gateway under each policy. The SLO is the TPOT of 8 concurrent rank-64
    requests alone on one worker, measured in the same run."""
    paths = _adapter_paths()
    redis = start_redis(logs)
    ns = f"rank{time.time_ns()}"
    mods = [f"r{r}={p}" for r, p in paths.items()]
    extra = ("--kv-cache-tokens", "8192", "--threads", "1", "--engine-threads", "1", "--max-loras", "4",
             "--lora-modules", *mods)  # fmt: skip
    procs = [
        start_worker(redis.url, ns, f"w{i}", "elastune/tiny-llama", Pool.MODEL, logs, *extra, wait=False)
        for i in range(setup.workers)
    ]
    out: dict[str, Any] = {}
    try:
        for p in procs:
            wait_for_worker(p, redis.url, ns)
        probe = [(0.0, "r64", f"{i} km →") for i in range(8)]
        slo = statistics.median(asyncio.run(_drive_rank(procs[0].url, probe, setup.output_tokens, 1.0)))
        rng = random.Random(setup.seed)
        times = poisson_times(setup.requests, setup.rate, setup.seed)
        trace = [
            (t, f"r{rng.choice((8, 16, 32, 64))}", f"{i} {rng.choice(_WORDS)} →") for i, t in enumerate(times)
        ]
        out["setup"] = {**setup.__dict__, "tpot_slo_ms": round(slo * 1000, 2), "kernel": "padded"}
        say(f"rank.real: {setup.workers} workers, TPOT SLO {slo * 1000:.2f} ms (8 x rank 64 alone)")
        for key, policy in RANK_REAL_POLICIES:
            gw = start_gateway(redis.url, ns, logs, "--policy", policy)
            try:
                wait_for_endpoints(gw.url, setup.workers)
                load = os.getloadavg()[0]
                tpots = asyncio.run(_drive_rank(gw.url, trace, setup.output_tokens, slo))
            finally:
                gw.stop()
            met = sum(t <= slo for t in tpots) / len(tpots)
            mean = statistics.fmean(tpots)
            out[key] = {
                "slo_attainment_pct": round(100 * met, 2), "tpot_ms_mean": round(1000 * mean, 2),
                "tpot_ms_p99": round(1000 * percentile(tpots, 99), 2), "loadavg_1m_before": round(load, 2),
            }  # fmt: skip
            say(f"  {key:11s} SLO attainment {100 * met:6.2f} %  TPOT mean {1000 * mean:.2f} ms")
        out["vs"] = {
            f"{subject}_vs_{base}": _attainment_ratio(out, base, subject)
            for subject in ("rank_aware", "combined")
            for base in ("round_robin", "least_load")
        }
    finally:
        for p in procs:
            p.stop()
        redis.proc.kill()
        redis.proc.wait()
    return out


def _attainment_ratio(section: dict[str, Any], baseline: str, subject: str) -> dict[str, float] | None:
    """Subject's SLO attainment over the baseline's (> 1: ahead) and its TPOT mean under it."""
    a, b = section.get(baseline, {}), section.get(subject, {})
    if not a.get("slo_attainment_pct") or not b.get("tpot_ms_mean"):
        return None
    return {
        "slo_attainment": round(b["slo_attainment_pct"] / a["slo_attainment_pct"], 3),
        "tpot_mean_lower": round(a["tpot_ms_mean"] / b["tpot_ms_mean"], 3),
    }


def run_ssjf(quick: bool, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ssjf.json"
        cmd = [
            sys.executable,
            "-m",
            "elastune_bench.serving.ssjf",
            "--json",
            str(path),
            *(["--quick"] if quick else []),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0 or not path.exists():
            why = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"skipped": f"{' '.join(cmd[1:4])} failed: {why[0][:300]}"}
        say(res.stdout.strip())
        data = json.loads(path.read_text())
        return dict(data.get("ssjf", data))


# -- report -----------------------------------------------------------------------------------------------
def ratios(section: dict[str, Any], baseline: str, subject: str) -> dict[str, float] | None:
    a, b = section.get(baseline, {}), section.get(subject, {})
    if "latency_s_mean" not in a or "latency_s_mean" not in b:
        return None
    return {
        "mean": round(a["latency_s_mean"] / b["latency_s_mean"], 2),
        "p99": round(a["latency_s_p99"] / b["latency_s_p99"], 2),
    }


def target_of(args: argparse.Namespace) -> Path | None:
    """Where the results go: ``--json``, else the committed file for a full run (none for --quick)."""
    return Path(args.json) if args.json else (None if args.quick else RESULTS)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune bench route", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (a few minutes)")
    p.add_argument("--json", metavar="PATH", help=f"write the results (default {RESULTS} for a full run)")
    p.add_argument("--workers", type=int, default=2, help="real workers behind each router")
    p.add_argument(
        "--only", choices=("prefix", "rank", "rank_real", "ssjf"), action="append",
        help="run only these parts (repeatable); they replace the same parts of an existing --json file "
        "(rank_real: the real workers of rank, keeping the file's simulated part)",
    )  # fmt: skip
    args = p.parse_args(argv)
    parts = set(args.only or ("prefix", "rank", "ssjf"))
    say = lambda text: print(text, flush=True)  # noqa: E731
    started = time.time()
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "loadavg_1m_start": round(os.getloadavg()[0], 2)}
    }
    if "prefix" in parts:
        setup = RealSetup(workers=args.workers, requests=80 if args.quick else 160)
        with tempfile.TemporaryDirectory(prefix="elastune-route-") as logs:
            real = run_real(setup, Path(logs), say)
        cost = real.get("setup", {}).get("published_cost")
        fitted = cost_model(ServingCost(**cost)) if cost else None
        result["prefix"] = {"real": real}
        for n in (8, 32):
            result["prefix"][f"sim_{n}"] = run_sim_prefix(n, fitted, args.quick)
            result["prefix"][f"sim_{n}_placeholder_cost"] = run_sim_prefix(n, None, args.quick)
        for key in ("real", "sim_8", "sim_32", "sim_8_placeholder_cost", "sim_32_placeholder_cost"):
            section = result["prefix"][key]
            section["e2_vs_round_robin"] = ratios(section, "round_robin", "e2")
            if key == "real":
                section["e2_vs_vllm_router"] = ratios(section, "vllm_router_cache_aware", "e2")
                section["e2_vs_smg"] = ratios(section, "smg_cache_aware", "e2")
            say(f"prefix.{key}: E2 vs round-robin (x lower latency): {section['e2_vs_round_robin']}")
    written = target_of(args)
    if "rank_real" in parts and "rank" not in parts:
        earlier = json.loads(written.read_text()) if written is not None and written.exists() else {}
        with tempfile.TemporaryDirectory(prefix="elastune-rank-") as logs:
            real = run_rank_real(RankSetup(requests=60 if args.quick else 150), Path(logs), say)
        result["rank"] = {**earlier.get("rank", {}), "real": real}
    if "rank" in parts:
        result["rank"] = {"sim": run_sim_rank()}
        with tempfile.TemporaryDirectory(prefix="elastune-rank-") as logs:
            result["rank"]["real"] = run_rank_real(
                RankSetup(requests=60 if args.quick else 150), Path(logs), say
            )
        sims = result["rank"]["sim"]
        for rate, row in sims["sweep"].items():
            text = ", ".join(f"{k} {v['slo_attainment_pct']}" for k, v in row.items())
            say(f"rank.sim at {rate}: SLO attainment % {text}")
    if "ssjf" in parts:
        result["ssjf"] = run_ssjf(args.quick, say)
    result["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.time() - started, 1)
    target = target_of(args)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        if args.only and target.exists():  # a partial run updates its parts of an earlier full run
            result = {**json.loads(target.read_text()), **result}
        target.write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
