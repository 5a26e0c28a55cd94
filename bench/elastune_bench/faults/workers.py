"""Experiments on the workers under streams: stopped (SIGTERM: it drains), paused past its registry TTL (it
is re-admitted, not stopped), killed (SIGKILL), and clients that go away mid-stream (issue 38 item 1)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from elastune_contract.protocol import WORKER_TTL_SECONDS

from .stack import MODEL, Outcome, Plan, Stack, Streamed, metric, pid_alive, stream, wait_until, worker_pid

#: One long prompt: the router's prefix affinity sends the streams that share it to the same worker.
PROMPT = "Convert every distance to metres, one per line: " + ", ".join(f"{i} km" for i in range(40))


def _streams(stack: Stack, pool: ThreadPoolExecutor, n: int, max_tokens: int) -> list[Future[Streamed]]:
    """``n`` streams through the gateway; returns once each has its first chunk (or ended)."""
    started = [threading.Event() for _ in range(n)]
    # ignore_eos: each runs its max_tokens (the tiny model may end a greedy stream early), so the fault
    # meets streams still in flight.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    futures = [pool.submit(stream, stack.url, body, started=ev) for ev in started]
    for ev in started:
        ev.wait(60)
    return futures


def _busiest(stack: Stack) -> str | None:
    """The serving worker whose engine runs the most requests now (None: no engine runs any)."""
    load = {wid: _running(stack, [r.metrics_url]) for wid, r in stack.serving_workers().items()}
    return max(load, key=lambda w: load[w]) if load and max(load.values()) > 0 else None


def _running(stack: Stack, urls: list[str]) -> float:
    """Requests running or waiting on the engines whose /metrics are at ``urls``."""
    total = 0.0
    for url in urls:
        text = stack.http.get(url, timeout=5).text  # the worker's metrics port (record.metrics_url)
        total += metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")
    return total


def _requests(stack: Stack, pool: ThreadPoolExecutor, n: int) -> list[Future[tuple[int, float, float]]]:
    """``n`` short requests through the gateway: (status, seconds, when it ended)."""

    def one(i: int) -> tuple[int, float, float]:
        t0 = time.monotonic()
        try:
            code = stack.complete(MODEL, max_tokens=2, prompt=f"{i} m ->").status_code
        except Exception:
            code = 0
        return code, time.monotonic() - t0, time.monotonic()

    return [pool.submit(one, i) for i in range(n)]


def _ends(results: list[Streamed]) -> str:
    return ", ".join(f"{n}×{k}" for k, n in Counter(r.finish[:40] for r in results).items())


def exp_sigterm_drain(stack: Stack, plan: Plan) -> Outcome:
    """6 streams in flight on a worker sent SIGTERM (every scale-down, rollout or node drain): it leaves
    the registry at once, new requests go elsewhere, all 6 streams finish, then it exits."""
    if len(stack.serving_workers()) < 2:
        return Outcome(False, f"needs two serving workers, has {sorted(stack.serving_workers())}")
    with ThreadPoolExecutor(12) as pool:
        futures = _streams(stack, pool, 6, 160)
        wid = _busiest(stack)
        pid = worker_pid(stack, wid) if wid else None
        if wid is None or pid is None:
            return Outcome(False, f"no worker process found running the streams ({wid})")
        os.kill(pid, signal.SIGTERM)
        t0 = time.monotonic()
        left = wait_until(lambda: wid not in stack.bus.workers(), 10, 0.1)
        left_s = time.monotonic() - t0
        new = [f.result() for f in _requests(stack, pool, 6)]
        results = [f.result() for f in futures]
    exited = wait_until(lambda: not pid_alive(pid), 60, 0.2)
    exit_s = time.monotonic() - t0
    finished = sum(r.code == 200 and r.finish == "length" for r in results)
    drained = "drain" in stack.worker_log(wid)
    detail = (f"SIGTERM to {wid} with streams in flight: out of the registry "
              + (f"after {left_s:.1f} s" if left else "NOT within 10 s")
              + f"; new requests meanwhile: {sum(c == 200 for c, _, _ in new)}/6 ok; streams: {finished}/6 "
              f"finished ({_ends(results)}); process exited "
              + (f"{exit_s:.1f} s after the signal" if exited else "NOT within 60 s")
              + f"; its log {'says' if drained else 'does NOT say'} it drained")  # fmt: skip
    ok_new = all(c == 200 for c, _, _ in new)
    return Outcome(bool(left) and finished == 6 and ok_new and bool(exited) and drained, detail)


def exp_killed_mid_stream(stack: Stack, plan: Plan) -> Outcome:
    """SIGKILL to a worker with streams in flight: its streams end at once with an error event (never a
    silent cut that looks finished), new requests go elsewhere, and the pool is whole again."""
    if len(stack.serving_workers()) < 2:
        return Outcome(False, f"needs two serving workers, has {sorted(stack.serving_workers())}")
    with ThreadPoolExecutor(10) as pool:
        futures = _streams(stack, pool, 4, 400)
        wid = _busiest(stack)
        pid = worker_pid(stack, wid) if wid else None
        if wid is None or pid is None:
            return Outcome(False, f"no worker process found running the streams ({wid})")
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        new = [f.result() for f in _requests(stack, pool, 4)]
        results = [f.result() for f in futures]
    cut = [r for r in results if r.finish not in ("length", "stop")]
    told = all(r.finish.startswith("error") for r in cut)
    slowest = max((r.ended - t0 for r in cut), default=0.0)
    back = stack.wait_serving(plan.recover_s * 2)
    detail = (f"SIGKILL to {wid} under 4 streams: {len(cut)} cut, "
              f"{'each' if told else 'NOT each'} ended with an error "
              f"({_ends(results)}) within {slowest:.1f} s; "
              f"new requests meanwhile: {sum(c == 200 for c, _, _ in new)}/4 ok; pool whole again "
              + (f"after {back:.0f} s" if back is not None else "NOT in time"))  # fmt: skip
    held = bool(cut) and told and slowest < 10 and all(c == 200 for c, _, _ in new) and back is not None
    return Outcome(held, detail)


def exp_client_disconnect(stack: Stack, plan: Plan) -> Outcome:
    """4 clients ask for 400-token streams and go away after 2 chunks: the engines drop the requests
    (nothing runs on for nobody) and answer the next ones at once."""
    urls = [r.metrics_url for r in stack.serving_workers().values()]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        gone = list(pool.map(lambda _: stream(stack.url, body, stop_after=2), range(4)))
    t0 = time.monotonic()
    idle = wait_until(lambda: _running(stack, urls) == 0, 20, 0.2)
    took = time.monotonic() - t0
    after = stack.complete(MODEL, max_tokens=2).status_code
    detail = (f"4 streams of 400 tokens dropped by their clients after {[r.chunks for r in gone]} chunks: "
              + (f"the engines idle {took:.1f} s later" if idle else "requests STILL running after 20 s")
              + f"; the next request: {after}")  # fmt: skip
    return Outcome(bool(idle) and took < 10 and after == 200, detail)


def exp_paused(stack: Stack, plan: Plan) -> Outcome:
    """A worker paused (SIGSTOP) past its registry TTL with streams in flight, and requests sent while it
    is silent: those not started there are retried elsewhere once its record expires; on SIGCONT it is
    re-admitted, not stopped, its streams finish, and it is used again."""
    if len(stack.serving_workers()) < 2:
        return Outcome(False, f"needs two serving workers, has {sorted(stack.serving_workers())}")
    wlog = {}
    with ThreadPoolExecutor(10) as pool:
        futures = _streams(stack, pool, 3, 96)
        wid = _busiest(stack)
        pid = worker_pid(stack, wid) if wid else None
        if wid is None or pid is None:
            return Outcome(False, f"no worker process found running the streams ({wid})")
        wlog["before"] = len(stack.worker_log(wid))
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            waiting = _requests(stack, pool, 6)
            expired = wait_until(lambda: wid not in stack.bus.workers(), WORKER_TTL_SECONDS + 10, 0.2)
            time.sleep(max(0.0, plan.pause_s - (time.monotonic() - t_stop)))
        finally:
            os.kill(pid, signal.SIGCONT)
        t_cont = time.monotonic()
        paused = t_cont - t_stop
        silent = [f.result() for f in waiting]
        results = [f.result() for f in futures]
    before_cont = sum(c == 200 and end < t_cont for c, _, end in silent)
    slowest = max(s for _, s, _ in silent)
    back = wait_until(lambda: (r := stack.bus.workers().get(wid)) is not None and r.url, plan.recover_s, 0.5)

    def used() -> bool:
        # 4 at once with the streams' prompt: the router spreads them by load and prefix (one at a time,
        # an idle pool's ties may always go to the other worker).
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(4) as again:
            return any(s.endpoint == wid for s in again.map(lambda _: stream(stack.url, body), range(4)))

    used_again = bool(back) and bool(wait_until(used, plan.recover_s, 1.0))
    stopped = "draining" in stack.worker_log(wid)[wlog["before"] :] or not pid_alive(pid)
    finished = sum(r.code == 200 and r.finish == "length" for r in results)
    detail = (f"SIGSTOP {wid} for {paused:.0f} s with 3 streams in flight: its {WORKER_TTL_SECONDS} s record "
              f"{'expired' if expired else 'did NOT expire'}; 6 requests sent while it was silent: "
              f"{before_cont}/6 answered 200 before SIGCONT (slowest {slowest:.1f} s); SIGCONT: "
              + ("registered again" if back else f"NOT registered again within {plan.recover_s:.0f} s")
              + f", used again: {used_again}, "
              + ("STOPPED by the control plane; " if stopped else "not stopped; ")
              + f"streams: {finished}/3 finished ({_ends(results)})")  # fmt: skip
    held = bool(expired) and before_cont == 6 and used_again and not stopped and finished == 3
    return Outcome(held, detail)
