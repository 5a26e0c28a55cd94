"""``elastune bench gateway [--quick] [--json PATH]``: what a router in front of a worker costs.

One real worker (tiny Llama) registered in a real Redis, and in front of that same worker, all up at
once: the Elastune gateway with authentication and per-key limits on (a key with requests/min and
tokens/min, so every request is authenticated, scoped and counted in Redis), the Elastune gateway with
authentication off, ``vllm-router`` and SGLang's ``smg`` from their PyPI wheels (``--policy
cache_aware``; a peer that cannot run is recorded as skipped with the reason), and optionally the
gateway of another checkout (``--before-src``: a before/after comparison in the same conditions).

Two loads, each a closed loop of N requests at concurrency C: ``short`` (non-streamed, max_tokens 1) and
``stream`` (streamed, a few tokens). Rounds are interleaved (every front once per round, the order
rotated) so the other work on a shared machine falls on all fronts alike. Per front: CPU seconds per
request of its process tree (/proc, user + system), and latency p50/p99 minus the same figures of the
direct calls to the worker in the same rounds (added latency). The goal of issue 25 item 6: with
authentication and limits on, at most 2x smg's CPU per request and at most 5 ms added p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from elastune_bench.processes import (
    ServiceProcess,
    publish_keys,
    start_gateway,
    start_peer,
    start_worker,
    wait_for_endpoints,
)
from elastune_bench.sim.routing.metrics import percentile
from elastune_common.servers import start_redis
from elastune_contract.api_keys import KeySecret

RESULTS = Path("benchmarks/results/gateway.json")
MODEL = "tiny-llama"
BENCH_KEY = "sk-bench-gateway-overhead"
LOADS = ("short", "stream")
PEERS = {"vllm_router": "vllm-router", "smg": "smg"}
GOAL_CPU_VS_SMG = 2.0
GOAL_ADDED_P50_MS = 5.0


@dataclass(frozen=True)
class Setup:
    requests: int = 300
    """Per front, load and round."""
    concurrency: int = 16
    rounds: int = 2
    stream_tokens: int = 8
    """Output tokens of a streamed request (ignore_eos: exactly this many)."""
    warmup: int = 16
    """Requests sent through a front before each measured run (connections, caches), not counted."""


# -- measuring ---------------------------------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except OSError:
            continue
    return out


def cpu_times(pid: int) -> dict[int, int]:
    """Nanoseconds on a CPU of every thread of ``pid`` and its descendants, by thread id (from
    /proc/*/task/*/schedstat: exact, where /proc/*/stat counts 10 ms ticks)."""
    out: dict[int, int] = {}
    for p in _tree(pid):
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/schedstat") as fh:
                    out[int(tid)] = int(fh.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return out


def cpu_seconds_since(before: dict[int, int], pid: int) -> float:
    """CPU seconds the threads of ``pid``'s tree spent since ``before`` (threads that ended in between
    are not counted: the routers keep theirs for the run)."""
    return sum(ns - before.get(tid, 0) for tid, ns in cpu_times(pid).items()) / 1e9


def _body(i: int, load: str, setup: Setup) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL, "prompt": f"Request {i}: convert {i % 97} km to metres.", "temperature": 0,
        "max_tokens": 1 if load == "short" else setup.stream_tokens, "ignore_eos": True,
    }  # fmt: skip
    if load == "stream":
        body["stream"] = True
    return body


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the whole answer, seconds to the first byte) of one request; raises on an error."""
    t0 = time.perf_counter()
    first = 0.0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for _ in r.aiter_raw():
            first = first or time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
    return time.perf_counter() - t0, first


async def drive(url: str, load: str, setup: Setup, n: int, offset: int) -> dict[str, Any]:
    """A closed loop: ``setup.concurrency`` clients send ``n`` requests in all."""
    latencies: list[float] = []
    firsts: list[float] = []
    errors: list[str] = []
    headers = {"Authorization": f"Bearer {BENCH_KEY}"}  # the peers and the worker ignore it
    limits = httpx.Limits(max_connections=setup.concurrency, max_keepalive_connections=setup.concurrency)
    numbers: Iterator[int] = iter(range(offset, offset + n))
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as client:

        async def loop() -> None:
            for i in numbers:
                try:
                    total, first = await _one(client, url, _body(i, load, setup))
                except (httpx.HTTPError, RuntimeError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                latencies.append(total)
                firsts.append(first)

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(setup.concurrency)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "firsts": firsts, "errors": errors, "wall_s": wall}


@dataclass
class Front:
    name: str
    url: str
    pids: tuple[int, ...]
    """The processes whose CPU counts as this front's (the worker's, for ``direct``)."""


def measure(front: Front, worker_pid: int, load: str, setup: Setup, offset: int) -> dict[str, Any]:
    asyncio.run(drive(front.url, load, setup, setup.warmup, offset + 10**6))
    cpu0 = [cpu_times(p) for p in front.pids]
    worker0 = cpu_times(worker_pid)
    client0 = time.process_time()
    run = asyncio.run(drive(front.url, load, setup, setup.requests, offset))
    client = time.process_time() - client0
    worker = cpu_seconds_since(worker0, worker_pid)
    cpu = sum(cpu_seconds_since(c, p) for p, c in zip(front.pids, cpu0, strict=True))
    done = max(1, len(run["latencies"]))
    return {
        "latencies": run["latencies"], "firsts": run["firsts"], "errors": run["errors"],
        "requests_per_s": len(run["latencies"]) / run["wall_s"],
        "cpu_s": cpu, "worker_cpu_s": worker, "client_cpu_s": client, "done": len(run["latencies"]),
        "cpu_ms_per_request": 1000 * cpu / done,
    }  # fmt: skip


def summarize(rounds: list[dict[str, Any]], direct: list[dict[str, Any]] | None) -> dict[str, Any]:
    lat = [x for r in rounds for x in r["latencies"]]
    first = [x for r in rounds for x in r["firsts"]]
    done = sum(r["done"] for r in rounds)
    out: dict[str, Any] = {
        "requests": done,
        "errors": sum(len(r["errors"]) for r in rounds),
        "first_error": next((r["errors"][0] for r in rounds if r["errors"]), None),
        "cpu_ms_per_request": round(1000 * sum(r["cpu_s"] for r in rounds) / max(1, done), 3),
        "cpu_ms_per_request_by_round": [round(r["cpu_ms_per_request"], 3) for r in rounds],
        "worker_cpu_ms_per_request": round(1000 * sum(r["worker_cpu_s"] for r in rounds) / max(1, done), 3),
        "client_cpu_ms_per_request": round(1000 * sum(r["client_cpu_s"] for r in rounds) / max(1, done), 3),
        "requests_per_s": round(statistics.fmean(r["requests_per_s"] for r in rounds), 1),
    }
    if lat:
        out.update(
            latency_ms_p50=round(1000 * percentile(lat, 50), 2),
            latency_ms_p99=round(1000 * percentile(lat, 99), 2),
            first_byte_ms_p50=round(1000 * percentile(first, 50), 2),
        )
    if direct is not None and lat:
        base = [x for r in direct for x in r["latencies"]]
        base_first = [x for r in direct for x in r["firsts"]]
        out["added_ms_p50"] = round(1000 * (percentile(lat, 50) - percentile(base, 50)), 2)
        out["added_ms_p99"] = round(1000 * (percentile(lat, 99) - percentile(base, 99)), 2)
        out["added_first_byte_ms_p50"] = round(1000 * (percentile(first, 50) - percentile(base_first, 50)), 2)
    return out


# -- the stack ---------------------------------------------------------------------------------------------
def _publish_key(redis_url: str, ns: str) -> None:
    """The key every request carries, as the operator publishes it: scoped to the model, with limits far
    above what the bench sends (each request is still counted in Redis)."""
    secret = KeySecret(
        namespace="bench", name="gateway-overhead", key=BENCH_KEY, models=(MODEL,),
        requests_per_minute=10_000_000, tokens_per_minute=1_000_000_000,
    )  # fmt: skip
    publish_keys(redis_url, ns, [secret], [MODEL])


def run(setup: Setup, before_src: Path | None, logs: Path, say: Callable[[str], None]) -> dict[str, Any]:
    redis = start_redis(logs)
    ns = f"gwbench{time.time_ns()}"
    procs: list[ServiceProcess] = []
    out: dict[str, Any] = {"setup": asdict(setup), "skipped": {}}
    try:
        _publish_key(redis.url, ns)
        worker = start_worker(
            redis.url, ns, "w0", "elastune/tiny-llama", MODEL, logs, "--threads", "1", "--engine-threads", "1"
        )
        procs.append(worker)
        fronts = [Front("direct", worker.url, (worker.proc.pid,))]
        gateways: list[tuple[str, tuple[str, ...], dict[str, str] | None]] = [
            ("elastune", ("--auth", "required"), None),
            ("elastune_auth_off", ("--auth", "off"), None),
        ]
        if before_src is not None:
            path = os.pathsep.join(
                [str(before_src / "gateway"), str(before_src / "contract"), os.environ.get("PYTHONPATH", "")]
            )
            gateways.append(("elastune_before", ("--auth", "required"), {"PYTHONPATH": path}))
        for name, extra, env in gateways:
            g = start_gateway(redis.url, ns, logs, *extra, env=env)
            procs.append(g)
            wait_for_endpoints(g.url, 1)
            fronts.append(Front(name, g.url, (g.proc.pid,)))
        for name, kind in PEERS.items():
            try:
                peer = start_peer(kind, [worker.url], logs, MODEL)
            except (OSError, RuntimeError) as exc:
                out["skipped"][name] = str(exc)[:500]
                say(f"{name} skipped: {str(exc)[:200]}")
                continue
            procs.append(peer)
            fronts.append(Front(name, peer.url, (peer.proc.pid,)))
        names = ", ".join(f.name for f in fronts)
        say(f"fronts: {names}; {setup.rounds} round(s) x {setup.requests} requests")
        raw: dict[str, dict[str, list[dict[str, Any]]]] = {
            load: {f.name: [] for f in fronts} for load in LOADS
        }
        offset = 0
        for r in range(setup.rounds):
            order = fronts[r % len(fronts) :] + fronts[: r % len(fronts)]
            for load in LOADS:
                for front in order:
                    offset += 10 * setup.requests
                    res = measure(front, worker.proc.pid, load, setup, offset)
                    raw[load][front.name].append(res)
                    p50 = 1000 * percentile(res["latencies"], 50) if res["latencies"] else float("nan")
                    say(
                        f"round {r + 1} {load:6s} {front.name:18s} {res['cpu_ms_per_request']:6.3f} CPU "
                        f"ms/req  p50 {p50:7.1f} ms  {res['requests_per_s']:6.1f} req/s  errors "
                        f"{len(res['errors'])}  load {os.getloadavg()[0]:.1f}"
                    )
        for load in LOADS:
            direct = raw[load]["direct"]
            out[load] = {
                name: summarize(rounds, None if name == "direct" else direct)
                for name, rounds in raw[load].items()
            }
        out["goal"] = goal(out)
    finally:
        for p in reversed(procs):
            p.stop()
        redis.proc.kill()
        redis.proc.wait()
    return out


def goal(out: dict[str, Any]) -> dict[str, Any]:
    """Issue 25 item 6 on each load: the gateway with auth and limits on against smg."""
    res: dict[str, Any] = {"cpu_vs_smg_at_most": GOAL_CPU_VS_SMG, "added_p50_ms_at_most": GOAL_ADDED_P50_MS}
    for load in LOADS:
        ours, smg = out[load].get("elastune", {}), out[load].get("smg", {})
        row: dict[str, Any] = {"added_ms_p50": ours.get("added_ms_p50")}
        if smg.get("cpu_ms_per_request"):
            row["cpu_vs_smg"] = round(ours["cpu_ms_per_request"] / smg["cpu_ms_per_request"], 2)
        row["met"] = (
            row.get("cpu_vs_smg") is not None
            and row["cpu_vs_smg"] <= GOAL_CPU_VS_SMG
            and row["added_ms_p50"] is not None
            and row["added_ms_p50"] <= GOAL_ADDED_P50_MS
        )
        res[load] = row
    return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune bench gateway", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round of 100 requests per front and load")
    p.add_argument("--json", metavar="PATH", help=f"write the results (default {RESULTS} for a full run)")
    p.add_argument("--requests", type=int, help="requests per front, load and round (default 300)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 2)")
    p.add_argument(
        "--before-src", type=Path, metavar="DIR",
        help="also measure the gateway of this checkout (DIR/gateway, DIR/contract), e.g. an older commit",
    )  # fmt: skip
    args = p.parse_args(argv)
    setup = Setup(
        requests=args.requests or (100 if args.quick else 300),
        concurrency=args.concurrency,
        rounds=args.rounds or (1 if args.quick else 2),
    )
    say = lambda text: print(text, flush=True)  # noqa: E731
    started = time.time()
    machine = {"cpus": os.cpu_count(), "loadavg_1m_start": round(os.getloadavg()[0], 2)}
    result: dict[str, Any] = {"machine": machine}
    with tempfile.TemporaryDirectory(prefix="elastune-gwbench-") as logs:
        result.update(run(setup, args.before_src, Path(logs), say))
    result["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.time() - started, 1)
    for load in LOADS:
        for name, row in result[load].items():
            say(
                f"{load:6s} {name:18s} {row['cpu_ms_per_request']:6.3f} CPU ms/req"
                f"  p50 {row.get('latency_ms_p50', 0):7.2f} ms (+{row.get('added_ms_p50', 0):6.2f})"
                f"  p99 {row.get('latency_ms_p99', 0):7.2f} ms (+{row.get('added_ms_p99', 0):6.2f})"
                f"  errors {row['errors']}"
            )
    say(f"goal: {json.dumps(result['goal'])}")
    target = Path(args.json) if args.json else (None if args.quick else RESULTS)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
