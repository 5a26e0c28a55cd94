"""``elastune bench tenancy [--quick] [--json PATH]``: does one API key flooding the gateway starve another?

A real tiny-Llama worker (``--max-num-seqs``: its batch, which the gateway takes as its cap) in a real
Redis, two keys, and in front of that worker two gateways up at once, both with authentication on: one
with fair sharing (``--fair-share on``: at most the batch in flight, the rest in per-key queues served by
virtual token counters, at most ``queued_per_key`` queued per key) and one without (``--fair-share off``:
every request forwarded at once, the engine's FCFS queue); and a third gateway without fair sharing in
front of a second worker whose own queue shares by key (``--queue-policy fair``, the same counters in the
engine; the gateway names each request's key). Measured in turn in the same run.

First the worker's capacity is measured (closed loop through the fair gateway). Then for each gateway,
phase A: the victim key alone, open loop (Poisson arrivals) at ``victim_share`` of that capacity; phase
B: the victim at the same rate while the flooding key sends 10x the victim's rate (so twice what the
worker can serve). Every request is streamed with the same shape; TTFT is the time to the first byte of
the answer. Victim and flooder are driven from separate processes so the flood's client work does not
delay the victim's clock. Reported: the victim's p50/p99 TTFT alone and under the flood, the flooder's
answers by status (429: throttled at its per-key bound), its served throughput and TTFT. Goal (issue 25
item 3): with fair sharing, the victim's p99 TTFT under the flood within 1.5x of its p99 alone, and the
flooder throttled, not the victim.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from elastune_bench.processes import (
    ServiceProcess,
    publish_keys,
    start_gateway,
    start_worker,
    wait_for_endpoints,
)
from elastune_bench.sim.routing.metrics import percentile
from elastune_common.bus import Bus
from elastune_common.servers import start_redis
from elastune_contract.api_keys import KeySecret

RESULTS = Path("benchmarks/results/tenancy.json")
MODEL = "tiny-llama"
KEYS = {"victim": "sk-bench-tenancy-victim", "flood": "sk-bench-tenancy-flood"}
MODES = {"fair": ("on", "fcfs"), "fcfs": ("off", "fcfs"), "engine_fair": ("off", "fair")}
"""Mode -> (the gateway's --fair-share, the worker's --queue-policy). ``engine_fair``: the gateway forwards
everything at once and the engine's own queue shares by key (the gateway names each request's key to it,
``x-elastune-tenant``). A worker per queue policy, each in its own registry namespace, so each gateway
reaches only its own."""
GOAL_P99_RATIO = 1.5
FLOOD_FACTOR = 10


@dataclass(frozen=True)
class Setup:
    phase_s: float = 30.0
    """Seconds of each phase (victim alone; victim with the flood)."""
    victim_share: float = 0.2
    """The victim's rate as a share of the measured capacity (a modest load, below its fair half)."""
    max_tokens: int = 16
    """Output tokens of every request (ignore_eos: exactly this many)."""
    max_num_seqs: int = 8
    """The worker's batch: the fair gateway's per-endpoint cap."""
    queued_per_key: int = 64
    """The fair gateway's per-key queue bound (past it: 429)."""
    flood_connections: int = 256
    """Connections the flooding client keeps open at most (its requests beyond wait in its own pool)."""
    calibrate_s: float = 5.0
    seed: int = 25


# -- the clients ----------------------------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, float | None]:
    """(status, seconds to the first byte of a 200 answer) of one streamed request."""
    t0 = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for _ in r.aiter_raw():
            if first is None and r.status_code == 200:
                first = time.perf_counter() - t0
    return r.status_code, first


def _body(i: int, who: str, tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"{who} {i}: convert {i % 97} km to metres.", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip


async def _open_loop(
    url: str, key: str, who: str, rate: float, duration: float, tokens: int, connections: int, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``duration`` s; requests still open at the end are cancelled
    (counted as ``unfinished``: the flood's backlog, which the next phase must not inherit)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    statuses: dict[str, int] = {}
    firsts: list[float] = []
    errors: list[str] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=300, limits=limits, headers=headers) as client:

        async def one(i: int) -> None:
            try:
                status, first = await _one(client, url, _body(i, who, tokens))
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if first is not None:
                firsts.append(first)

        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        due = start
        i = 0
        while True:
            due += rng.expovariate(rate)
            if due - start >= duration:
                break
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
            i += 1
        await asyncio.sleep(max(0.0, start + duration - time.perf_counter()))
        unfinished = sum(not t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"sent": i, "statuses": statuses, "firsts": firsts, "errors": errors, "unfinished": unfinished}


def drive(
    url: str, key: str, who: str, rate: float, duration: float, tokens: int, connections: int, seed: int
) -> dict[str, Any]:
    """One client process's open loop (picklable entry point for the process pool)."""
    return asyncio.run(_open_loop(url, key, who, rate, duration, tokens, connections, seed))


async def _closed_loop(url: str, key: str, concurrency: int, duration: float, tokens: int) -> float:
    """Answers per second of ``concurrency`` clients sending back to back for ``duration`` s."""
    done = 0
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        end = time.perf_counter() + duration

        async def loop(c: int) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < end:
                status, _ = await _one(client, url, _body(c * 100_000 + i, "calibrate", tokens))
                i += 1
                done += status == 200

        start = time.perf_counter()
        await asyncio.gather(*(loop(c) for c in range(concurrency)))
        return done / (time.perf_counter() - start)


# -- the stack ------------------------------------------------------------------------------------------
def _publish_keys(redis_url: str, ns: str) -> None:
    """Both keys without per-minute limits: what throttles the flooder is the fair line, nothing else."""
    secrets = [
        KeySecret(
            namespace="bench",
            name=who,
            key=key,
            models=(MODEL,),
            requests_per_minute=None,
            tokens_per_minute=None,
        )
        for who, key in KEYS.items()
    ]
    publish_keys(redis_url, ns, secrets, [MODEL])


def _wait_idle(redis_url: str, ns: str, worker: str, timeout: float = 120.0) -> None:
    """Until two heartbeats in a row of the worker report nothing running or waiting (read every 0.2 s:
    each heartbeat is seen once it is written, not up to a second later)."""
    bus = Bus(redis_url, ns)
    try:
        deadline, quiet, seen = time.time() + timeout, 0, None
        while time.time() < deadline and quiet < 2:
            rec = bus.workers().get(worker)
            if rec is not None and rec.heartbeat != seen:
                seen = rec.heartbeat
                idle = rec.serving is not None and not (rec.serving.running or rec.serving.waiting)
                quiet = quiet + 1 if idle else 0
            if quiet < 2:
                time.sleep(0.2)
    finally:
        bus.close()


def _ttft(firsts: list[float]) -> dict[str, float | None]:
    if not firsts:
        return {"ttft_ms_p50": None, "ttft_ms_p99": None}
    return {"ttft_ms_p50": round(1000 * percentile(firsts, 50), 1),
            "ttft_ms_p99": round(1000 * percentile(firsts, 99), 1)}  # fmt: skip


def _p99_with_missing(firsts: list[float], missing: int) -> float | None:
    """p99 TTFT (ms, nearest rank) counting requests that got no first byte (refused, unfinished at the
    end of the phase) as infinitely late: None when they reach the 99th percentile."""
    ranked = sorted(firsts) + [float("inf")] * missing
    if not ranked:
        return None
    value = ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))]
    return None if value == float("inf") else round(1000 * value, 1)


def _summary(run: dict[str, Any], duration: float, tokens: int) -> dict[str, Any]:
    ok = run["statuses"].get("200", 0)
    return {
        "ttft_ms_p99_counting_unanswered": _p99_with_missing(run["firsts"], run["sent"] - len(run["firsts"])),
        "sent": run["sent"], "statuses": run["statuses"], "errors": len(run["errors"]),
        "first_error": run["errors"][0] if run["errors"] else None, "unfinished": run["unfinished"],
        "served_per_s": round(ok / duration, 2), "served_tokens_per_s": round(ok * tokens / duration, 1),
        **_ttft(run["firsts"]),
    }  # fmt: skip


def run(setup: Setup, logs: Path, say: Callable[[str], None]) -> dict[str, Any]:
    redis = start_redis(logs)
    ns = f"tenancy{time.time_ns()}"
    procs: list[ServiceProcess] = []
    out: dict[str, Any] = {"setup": asdict(setup)}
    try:
        workers: dict[str, str] = {}  # queue policy -> its registry namespace
        for policy in dict.fromkeys(q for _, q in MODES.values()):
            workers[policy] = f"{ns}-{policy}"
            _publish_keys(redis.url, workers[policy])
            procs.append(
                start_worker(
                    redis.url, workers[policy], f"w-{policy}", "elastune/tiny-llama", MODEL, logs,
                    "--threads", "1", "--engine-threads", "1", "--max-num-seqs", str(setup.max_num_seqs),
                    "--queue-policy", policy,
                )
            )  # fmt: skip
        urls: dict[str, str] = {}
        for mode, (flag, policy) in MODES.items():
            extra = (
                "--auth",
                "required",
                "--fair-share",
                flag,
                "--max-queued-per-key",
                str(setup.queued_per_key),
            )
            g = start_gateway(redis.url, workers[policy], logs, *extra)
            procs.append(g)
            wait_for_endpoints(g.url, 1)
            urls[mode] = g.url
        concurrency = 2 * setup.max_num_seqs
        capacity = asyncio.run(
            _closed_loop(urls["fair"], KEYS["victim"], concurrency, setup.calibrate_s, setup.max_tokens)
        )
        victim_rate = max(0.5, setup.victim_share * capacity)
        flood_rate = FLOOD_FACTOR * victim_rate
        out["capacity_per_s"] = round(capacity, 1)
        out["victim_rate_per_s"] = round(victim_rate, 2)
        out["flood_rate_per_s"] = round(flood_rate, 2)
        say(f"capacity {capacity:.1f} answers/s; victim {victim_rate:.1f}/s, flood {flood_rate:.1f}/s")
        d, tokens = setup.phase_s, setup.max_tokens
        with ProcessPoolExecutor(max_workers=2) as pool:
            for mode, url in urls.items():
                policy = MODES[mode][1]
                wns, wid = workers[policy], f"w-{policy}"
                _wait_idle(redis.url, wns, wid)
                alone = pool.submit(
                    drive, url, KEYS["victim"], "victim", victim_rate, d, tokens, 64, setup.seed
                )
                a = _summary(alone.result(), d, tokens)
                _wait_idle(redis.url, wns, wid)
                victim = pool.submit(
                    drive, url, KEYS["victim"], "victim", victim_rate, d, tokens, 64, setup.seed
                )
                flood = pool.submit(
                    drive, url, KEYS["flood"], "flood", flood_rate, d, tokens, setup.flood_connections,
                    setup.seed + 1,
                )  # fmt: skip
                v, f = _summary(victim.result(), d, tokens), _summary(flood.result(), d, tokens)
                row: dict[str, Any] = {"victim_alone": a, "victim_with_flood": v, "flood": f}
                if a["ttft_ms_p99"] and v["ttft_ms_p99"]:
                    row["victim_p99_ratio"] = round(v["ttft_ms_p99"] / a["ttft_ms_p99"], 2)
                out[mode] = row
                say(
                    f"{mode}: victim p99 TTFT alone {a['ttft_ms_p99']} ms, with flood {v['ttft_ms_p99']} ms "
                    f"(x{row.get('victim_p99_ratio')}), victim statuses {v['statuses']}; flood statuses "
                    f"{f['statuses']}, served {f['served_per_s']}/s, unfinished {f['unfinished']}; "
                    f"load {os.getloadavg()[0]:.1f}"
                )
        for policy, wns in workers.items():
            _wait_idle(redis.url, wns, f"w-{policy}")
        out["goal"] = goal(out)
    finally:
        for p in reversed(procs):
            p.stop()
        redis.proc.kill()
        redis.proc.wait()
    return out


def goal(out: dict[str, Any]) -> dict[str, Any]:
    """Issue 25 item 3 with fair sharing: the victim's p99 TTFT within 1.5x of alone, the flooder throttled
    (429s), the victim not (no 429/503)."""
    fair = out["fair"]
    ratio = fair.get("victim_p99_ratio")
    victim_refused = sum(n for code, n in fair["victim_with_flood"]["statuses"].items() if code != "200")
    flood_throttled = fair["flood"]["statuses"].get("429", 0)
    return {
        "victim_p99_ratio_at_most": GOAL_P99_RATIO,
        "victim_p99_ratio": ratio,
        "fcfs_victim_p99_ratio": out["fcfs"].get("victim_p99_ratio"),
        "engine_fair_victim_p99_ratio": out["engine_fair"].get("victim_p99_ratio"),
        "flood_429": flood_throttled,
        "victim_refused": victim_refused,
        "met": ratio is not None and ratio <= GOAL_P99_RATIO and flood_throttled > 0 and victim_refused == 0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune bench tenancy", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 s phases (a smoke test, not a measurement)")
    p.add_argument("--json", metavar="PATH", help=f"write the results (default {RESULTS} for a full run)")
    p.add_argument("--phase-s", type=float, help="seconds per phase (default 30)")
    p.add_argument("--max-num-seqs", type=int, default=Setup.max_num_seqs)
    args = p.parse_args(argv)
    setup = Setup(
        phase_s=args.phase_s or (4.0 if args.quick else Setup.phase_s),
        calibrate_s=2.0 if args.quick else Setup.calibrate_s,
        max_num_seqs=args.max_num_seqs,
    )
    say = lambda text: print(text, flush=True)  # noqa: E731
    started = time.time()
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "loadavg_1m_start": round(os.getloadavg()[0], 2)}
    }
    with tempfile.TemporaryDirectory(prefix="elastune-tenancy-") as logs:
        result.update(run(setup, Path(logs), say))
    result["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.time() - started, 1)
    say(f"goal: {json.dumps(result['goal'])}")
    target = Path(args.json) if args.json else (None if args.quick else RESULTS)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
