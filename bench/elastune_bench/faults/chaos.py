"""`elastune bench chaos`: faults injected into real processes on this machine, each scored held or lost.

One local stack as a user runs it (issue 24 item 8): a redis-server this bench owns (so it can flush,
stop and restart it), `elastune serve` (the control core, local CPU worker processes, the gateway) over a
WarmPool of the tiny Llama with one LoRA adapter and a short TuningJob, and HTTP traffic through the
gateway. The experiments run one after the other on that stack, each waiting until the stack answers
again before the next starts, so each is judged on its own. The operator-killed experiment needs the
Kubernetes API emulator of the development extras (the real `elastune operator` process against it, the
worker played by the bench as in tests/test_failpoint_dispatch.py).

Prints a table (experiment | held/lost | what was seen); ``--json PATH`` writes
``{experiment: {"held": bool, "detail": str}}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml

from elastune_common.bus import Bus
from elastune_common.servers import binary, free_port
from elastune_contract.protocol import (
    WORKER_TTL_SECONDS,
    Event,
    WorkerRecord,
    WorkerState,
    assign_key,
    events_key,
    pools_key,
    worker_key,
)
from elastune_worker.serving.runner.sampler import FAILPOINT_SEED, SAMPLER_RAISE

MODEL = "elastune/tiny-llama"
ADAPTER = "units"
BROKEN_MODEL = "elastune/no-such-model"
JOB = "chaos-job"
#: Two shared cores: one torch thread per process, and no spinning OpenMP threads.
_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
#: The worker's sampling failpoint, armed on the stack's workers: only a request with seed
#: FAILPOINT_SEED fails in the engine step, as a sampling bug hit by one request would.
SAMPLER_FAILPOINT = SAMPLER_RAISE
_DATASET = Path(__file__).resolve().parents[3] / "manifests" / "data" / "extract.jsonl"


@dataclass
class Outcome:
    held: bool
    detail: str
    seconds: float = 0.0


def wait_until(cond: Callable[[], Any], timeout: float, every: float = 0.25) -> Any:
    """``cond()``'s first truthy value within ``timeout`` s, else None (exceptions count as falsy)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except Exception:
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(every)


class RedisProcess:
    """A redis-server on a fixed port that can be stopped and started again (empty: no persistence)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        argv = [binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        with (self.workdir / f"redis-{self.starts}.log").open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        bus = Bus(self.url)
        try:
            if not wait_until(lambda: bus.redis.ping(), 10, 0.05):
                raise RuntimeError(f"redis-server did not start on port {self.port}")
        finally:
            bus.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def manifests(folder: Path, adapter_dir: Path, job_iterations: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    serving = {"minReplicas": 1, "holdTimeout": "60s", "maxLoras": 2}
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "tiny-llama", "namespace": "default"},
            "spec": {"model": MODEL, "maxWarmGPUs": 2, "idleWindow": "900s", "serving": serving},
        },
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "broken", "namespace": "default"},
            "spec": {"model": BROKEN_MODEL, "maxWarmGPUs": 1, "idleWindow": "900s",
                     "serving": {"minReplicas": 0, "holdTimeout": "20s"}},
        },
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": ADAPTER, "namespace": "default"},
            "spec": {"baseModel": MODEL, "artifactURL": str(adapter_dir), "rank": 8},
        },
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "TuningJob",
            "metadata": {"name": JOB, "namespace": "default"},
            "spec": {"model": MODEL, "dataset": str(_DATASET), "termination": {"maxIterations": job_iterations},  # noqa: E501
                     "deadline": "30m", "promptBank": "never",
                     "hyperparameters": {"batchSize": 4, "virtualTokens": 8}},
        },
    ]  # fmt: skip
    for doc in docs:
        (folder / f"{doc['kind'].lower()}-{doc['metadata']['name']}.yaml").write_text(yaml.safe_dump(doc))
    return folder


class Stack:
    """redis-server + `elastune serve` (control core, local workers, gateway) on this machine."""

    def __init__(self, root: Path, job_iterations: int = 600) -> None:
        from elastune_worker.tiny import adapters as tiny_adapters
        from elastune_worker.tiny import build as tiny_build

        tiny_build.ensure_tiny_model(spec=tiny_build.TINY_LLAMA_SPEC)
        adapter_dir = tiny_adapters.ensure_tiny_adapter(8)
        self.root = root
        self.state = root / "state"
        self.redis = RedisProcess(root / "redis")
        self.redis.start()
        self.bus = Bus(self.redis.url)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = manifests(root / "manifests", adapter_dir, job_iterations)
        cmd = [
            sys.executable,
            "-m",
            "elastune_operator.cli",
            "serve",
            "-f",
            str(folder),
            "--port",
            str(self.port),
        ]
        cmd += ["--workers", "2", "--state-dir", str(self.state), "--redis-url", self.redis.url]
        self.serve_log = root / "serve.log"
        with self.serve_log.open("wb") as out:
            self.serve = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **_ENV, "ELASTUNE_FAILPOINT": SAMPLER_FAILPOINT},
                start_new_session=True,
            )
        self.http = httpx.Client(timeout=120)

    # --- observation -------------------------------------------------------------------------------
    def complete(self, model: str, *, max_tokens: int = 4, **extra: Any) -> httpx.Response:
        body = {"model": model, "prompt": "12 km ->", "max_tokens": max_tokens, "temperature": 0, **extra}
        return self.http.post(self.url + "/v1/completions", json=body)

    def answers(self, model: str) -> bool:
        return self.complete(model).status_code == 200

    def all_answer(self, models: tuple[str, ...] = (MODEL, ADAPTER)) -> bool:
        return all(self.answers(m) for m in models)

    def wait_serving(self, timeout: float) -> float | None:
        """Seconds until the base model and the adapter both answer 200, None if not within ``timeout``."""
        t0 = time.monotonic()
        ok = wait_until(self.all_answer, timeout, 0.5)
        return time.monotonic() - t0 if ok else None

    def job_status(self) -> dict[str, Any]:
        found = sorted((self.state / "status").glob(f"tuningjob-*{JOB}*.yaml"))
        return (yaml.safe_load(found[0].read_text()) or {}).get("status") or {} if found else {}

    def job_condition(self, ctype: str) -> str:
        return next(
            (c.get("status", "") for c in self.job_status().get("conditions", []) if c["type"] == ctype), ""
        )

    def serving_workers(self) -> dict[str, WorkerRecord]:
        return {k: r for k, r in self.bus.workers().items() if r.model == MODEL and r.url}

    def control_token(self) -> str:
        return (self.state / "control-token").read_text().strip()

    def serve_alive(self) -> bool:
        return self.serve.poll() is None

    def serve_log_text(self) -> str:
        return self.serve_log.read_text(errors="replace")

    def worker_logs(self) -> dict[str, str]:
        return {p.stem: p.read_text(errors="replace") for p in sorted((self.state / "logs").glob("*.log"))}

    def close(self) -> None:
        self.http.close()
        if self.serve.poll() is None:
            self.serve.send_signal(signal.SIGINT)
            try:
                self.serve.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.serve.pid, signal.SIGKILL)
                self.serve.wait()
        self.bus.close()
        self.redis.stop()


def worker_pid(stack: Stack, worker_id: str) -> int | None:
    """The pid of this stack's worker process ``worker_id``: the pid in its registry record, checked to be
    a child of this stack's `elastune serve` started with ``--worker-id worker_id`` (never another
    stack's process that happens to use the same worker id)."""
    rec = stack.bus.workers().get(worker_id)
    if rec is None or not rec.pid:
        return None
    proc = Path("/proc") / str(rec.pid)
    try:
        argv = (proc / "cmdline").read_bytes().split(b"\0")
        ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    ours = ppid == stack.serve.pid and b"--worker-id" in argv
    return rec.pid if ours and argv[argv.index(b"--worker-id") + 1].decode() == worker_id else None


@contextmanager
def traffic(stack: Stack, models: tuple[str, ...] = (MODEL, ADAPTER)) -> Iterator[dict[str, list[int]]]:
    """Requests in a loop in the background, the status codes (0: no answer) recorded per model."""
    codes: dict[str, list[int]] = {m: [] for m in models}
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                for m in models:
                    body = {"model": m, "prompt": "5 m ->", "max_tokens": 2, "temperature": 0}
                    try:
                        codes[m].append(http.post(stack.url + "/v1/completions", json=body).status_code)
                    except httpx.HTTPError:
                        codes[m].append(0)
                stop.wait(0.2)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield codes
    finally:
        stop.set()
        t.join(60)


def _codes(codes: dict[str, list[int]]) -> str:
    parts = []
    for m, cs in codes.items():
        ok = sum(c == 200 for c in cs)
        bad = sorted({c for c in cs if c != 200})
        parts.append(f"{m.split('/')[-1]} {ok}/{len(cs)} ok" + (f" (others: {bad})" if bad else ""))
    return ", ".join(parts)


# --- the experiments -----------------------------------------------------------------------------------


def exp_redis_flush(stack: Stack, within: float) -> Outcome:
    with traffic(stack) as codes:
        time.sleep(2)
        stack.bus.redis.flushall()
        t0 = time.monotonic()
        back = wait_until(lambda: stack.all_answer(), within, 0.5)
        took = time.monotonic() - t0
        time.sleep(1)
    pools = stack.bus.redis.hlen(pools_key(stack.bus.ns))
    if back:
        return Outcome(True, f"FLUSHALL under traffic: base and adapter answer again after {took:.1f} s "
                             f"(pool records {pools}); traffic: {_codes(codes)}")  # fmt: skip
    return Outcome(False, f"FLUSHALL: not both answering within {within:.0f} s (pool records {pools}); "
                          f"traffic: {_codes(codes)}")  # fmt: skip


def exp_redis_down(stack: Stack, down_s: float, within: float) -> Outcome:
    with traffic(stack) as codes:
        time.sleep(1)
        stack.redis.stop()
        time.sleep(down_s)
        during = {m: list(cs) for m, cs in codes.items()}
        stack.redis.start()
        t0 = time.monotonic()
        back = wait_until(lambda: stack.all_answer(), within, 0.5)
        took = time.monotonic() - t0
    alive = stack.serve_alive()
    seen = (f"Redis down {down_s:.0f} s, restarted empty; during the outage: {_codes(during)}; "
            f"serve process {'alive' if alive else 'EXITED'}")  # fmt: skip
    if back and alive:
        return Outcome(True, f"{seen}; base and adapter answer again {took:.1f} s after the restart")
    return Outcome(False, f"{seen}; not both answering within {within:.0f} s after the restart")


def exp_result_suppressed(stack: Stack, timeout: float) -> Outcome:
    """The worker's result event refused by Redis (ACL: no XADD for the default user) until the worker has
    retried it a few seconds, then allowed again: the job ends Succeeded with exactly one result event."""

    def running() -> bool:
        return stack.job_condition("Running") == "True"

    def ended() -> bool:
        return "True" in (stack.job_condition("Succeeded"), stack.job_condition("Failed"))

    if not wait_until(lambda: running() or ended(), 180):
        return Outcome(False, f"the TuningJob never ran: status {stack.job_status()}")
    if ended():
        return Outcome(False, "the TuningJob ended before the fault could be injected (make it longer)")
    r = stack.bus.redis
    r.execute_command("ACL", "SETUSER", "default", "-xadd")
    t0 = time.monotonic()
    try:
        pat = re.compile(rf"cannot post (succeeded|failed) event of \S*{JOB}\S* .*retrying")
        seen = wait_until(lambda: any(pat.search(t) for t in stack.worker_logs().values()), timeout, 0.5)
        if seen:
            time.sleep(5)
    finally:
        r.execute_command("ACL", "SETUSER", "default", "+xadd")
    refused = time.monotonic() - t0
    if not seen:
        return Outcome(False, f"events refused {refused:.0f} s but the worker never tried to post a result")
    finished = wait_until(ended, 90)
    st = stack.job_status()
    results = [e for _, e in stack.bus.events(_job_key(stack)) if e.type in ("succeeded", "failed")]
    detail = (f"XADD refused {refused:.0f} s (the worker logged its result retries); job "
              f"Succeeded={stack.job_condition('Succeeded') or '-'}, attempts {st.get('attempts')}, "
              f"result events in the stream: {len(results)}")  # fmt: skip
    held = bool(finished) and stack.job_condition("Succeeded") == "True" and len(results) == 1
    return Outcome(held, detail)


def _job_key(stack: Stack) -> str:
    prefix, suffix = events_key(stack.bus.ns, "").split("::")
    keys = [
        str(k)[len(prefix) + 1 : -len(suffix) - 1] for k in stack.bus.redis.scan_iter(f"{prefix}:*:{suffix}")
    ]
    return next((k for k in keys if JOB in k), f"default/{JOB}")


def exp_poison(stack: Stack, within: float) -> Outcome:
    r = stack.bus.redis
    ns = stack.bus.ns
    bad_worker = worker_key(ns, "poison-w")
    r.set(bad_worker, b"\xff\xfe{not json", ex=60)
    r.sadd(f"{ns}:workers", "poison-w")  # in case the registry keeps an index of ids
    r.hset(pools_key(ns), "poison-pool", '{"pool": 1}')
    r.xadd(events_key(ns, "default/poison-job"), {"event": b"\xff not an event"})
    time.sleep(6)  # a control round and a gateway refresh or more
    ready = stack.http.get(stack.url + "/readyz").status_code
    ok = stack.all_answer()
    metrics = stack.http.get(stack.url + "/metrics").text
    counted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("elastune_gateway_poison_records_total")
    )
    poison_logged = (
        "poison" in stack.serve_log_text().lower() or "malformed" in stack.serve_log_text().lower()
    )
    r.delete(bad_worker)
    r.srem(f"{ns}:workers", "poison-w")
    r.hdel(pools_key(ns), "poison-pool")
    alive = stack.serve_alive()
    detail = (f"malformed worker record, pool record and event written: gateway /readyz {ready}, base and "
              f"adapter {'answer' if ok else 'DO NOT answer'}, gateway counted {counted:.0f} poison records, "
              f"control {'logged' if poison_logged else 'did not log'} them, serve "
              f"{'alive' if alive else 'EXITED'}")  # fmt: skip
    return Outcome(ok and alive and ready == 200 and counted > 0, detail)


def exp_bad_request(stack: Stack) -> Outcome:
    """8 streams; while they run, one request with seed 2**64 (must be refused with a 400 naming it) and
    one whose sampling raises inside the engine step (the worker's ``sampler-raise`` failpoint, armed on
    this stack's workers: seed FAILPOINT_SEED): only that request fails, the 8 complete."""

    def stream(i: int, seed: int) -> tuple[int, int, str, float]:
        body = {"model": ADAPTER if i % 2 else MODEL, "prompt": f"{i} km ->", "max_tokens": 192,
                "temperature": 0.8, "seed": seed, "stream": True}  # fmt: skip
        chunks, finish = 0, ""
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", stack.url + "/v1/completions", json=body) as r,
        ):
            if r.status_code != 200:
                return r.status_code, 0, r.read().decode()[:80], time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    doc = json.loads(line[6:])
                    if "error" in doc:
                        return 500, chunks, "error: " + str(doc["error"])[:80], time.monotonic()
                    chunks += 1
                    finish = doc["choices"][0].get("finish_reason") or finish
        return 200, chunks, finish, time.monotonic()

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(stream, i, i) for i in range(8)]
        time.sleep(0.2)
        poisoned = pool.submit(stream, 8, FAILPOINT_SEED)
        bad = stack.complete(MODEL, seed=18446744073709551616, temperature=0.8)
        t_bad = time.monotonic()
        results = [f.result() for f in futures]
        p_code, p_chunks, p_end, _ = poisoned.result()
    complete = sum(code == 200 and finish in ("length", "stop") for code, _, finish, _ in results)
    running = sum(t_end > t_bad for *_, t_end in results)
    failed_alone = p_code != 200 or p_end.startswith("error")
    detail = (f"seed 2**64 answered {bad.status_code} ({bad.text[:70]!r}) while {running}/8 streams ran; "
              f"a request failing inside the sampling step: {p_code} after {p_chunks} chunks ({p_end!r}); "
              f"{complete}/8 streams completed")  # fmt: skip
    return Outcome(bad.status_code == 400 and complete == 8 and failed_alone, detail)


def exp_unload(stack: Stack, within: float) -> Outcome:
    workers = stack.serving_workers()
    holders = [r for r in workers.values() if _lists(stack, r.url, ADAPTER)]
    if not holders:
        return Outcome(False, f"no worker lists {ADAPTER} (workers: {sorted(workers)})")
    w = holders[0]
    body = {"lora_name": ADAPTER}
    anon = stack.http.post(w.url + "/v1/unload_lora_adapter", json=body)
    auth = {"Authorization": f"Bearer {stack.control_token()}"}
    unloaded = stack.http.post(w.url + "/v1/unload_lora_adapter", json=body, headers=auth)
    gone = not _lists(stack, w.url, ADAPTER)
    t0 = time.monotonic()
    back_on_worker = wait_until(lambda: _lists(stack, w.url, ADAPTER), within, 0.5)
    took = time.monotonic() - t0
    try:
        served = str(stack.http.post(stack.url + "/v1/completions", timeout=15, json={
            "model": ADAPTER, "prompt": "1 m ->", "max_tokens": 2}).status_code)  # fmt: skip
    except httpx.HTTPError as exc:
        served = f"no answer ({type(exc).__name__})"
    detail = (f"unauthenticated unload on {w.id}: {anon.status_code}; with the control token: "
              f"{unloaded.status_code} (gone from its /v1/models: {gone}); "
              + (f"loaded there again after {took:.1f} s" if back_on_worker
                 else f"NOT loaded there again within {within:.0f} s")
              + f"; a request for it through the gateway: {served}")  # fmt: skip
    return Outcome(anon.status_code == 401 and bool(back_on_worker) and served == "200", detail)


def _lists(stack: Stack, url: str, model: str) -> bool:
    return model in {m["id"] for m in stack.http.get(url + "/v1/models").json()["data"]}


def exp_paused_worker(stack: Stack, within: float) -> Outcome:
    workers = stack.serving_workers()
    if not workers:
        return Outcome(False, "no serving worker registered")
    wid = sorted(workers)[0]
    pid = worker_pid(stack, wid)
    if pid is None:
        return Outcome(False, f"no process found for worker {wid}")
    log = stack.state / "logs" / f"{wid}.log"
    log_before = log.stat().st_size if log.exists() else 0
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        # Past its heartbeat TTL: until its registry record expired, and 2 s more.
        expired = wait_until(lambda: wid not in stack.bus.workers(), WORKER_TTL_SECONDS + 10, 0.2)
        time.sleep(2)
    finally:
        os.kill(pid, signal.SIGCONT)
    paused = time.monotonic() - t_stop
    t0 = time.monotonic()
    back = wait_until(lambda: stack.bus.workers().get(wid) and stack.bus.workers()[wid].url, within, 0.5)
    took = time.monotonic() - t0

    def used() -> bool:
        for i in range(8):
            body = {"model": MODEL, "prompt": f"{i} g ->", "max_tokens": 2, "stream": True}
            with stack.http.stream("POST", stack.url + "/v1/completions", json=body) as r:
                r.read()
                if r.headers.get("x-elastune-endpoint") == wid:
                    return True
        return False

    used_again = bool(back) and wait_until(used, within, 1.0)
    told_to_stop = "signal 15" in (log.read_text(errors="replace")[log_before:] if log.exists() else "")
    detail = (f"SIGSTOP {wid} (pid {pid}) for {paused:.0f} s: its {WORKER_TTL_SECONDS} s registry record "
              f"{'expired' if expired else 'did NOT expire'}; SIGCONT: registered again "
              + (f"after {took:.1f} s" if back else f"NOT within {within:.0f} s")
              + f"; a request routed to it again: {bool(used_again)}"
              + ("; it got SIGTERM (stopped by the control plane)" if told_to_stop else ""))  # fmt: skip
    return Outcome(bool(expired) and bool(used_again), detail)


def exp_crash_loop(stack: Stack, window: float) -> Outcome:
    """Demand for a pool whose workers cannot start (unknown model): they exit at once, again and again.
    Held when the request for it is answered with an error in bounded time and the healthy pool keeps
    answering while the broken one loops."""
    logs = stack.state / "logs"
    before = {p.name for p in logs.glob("broken-*.log")}
    t0 = time.monotonic()
    with traffic(stack) as codes:
        try:
            r = stack.complete(BROKEN_MODEL)
            code, text = r.status_code, r.text[:100]
        except httpx.HTTPError as exc:
            code, text = 0, str(exc)
        waited = time.monotonic() - t0
        time.sleep(max(0.0, window - waited))
    elapsed = time.monotonic() - t0
    starts = len({p.name for p in logs.glob("broken-*.log")} - before)
    alive = stack.serve_alive()
    healthy = all(cs and sum(c == 200 for c in cs) == len(cs) for cs in codes.values())
    detail = (f"request for the broken pool: {code} after {waited:.1f} s ({text!r}); {starts} worker "
              f"processes started for it in {elapsed:.0f} s; healthy pool meanwhile: {_codes(codes)}; serve "
              f"{'alive' if alive else 'EXITED'}")  # fmt: skip
    return Outcome(code in (503, 504) and healthy and alive, detail)


def exp_operator_killed(root: Path) -> Outcome:
    """The real `elastune operator` (kopf) against the Kubernetes API emulator (development extras), a
    real Redis, the worker played by the bench: ELASTUNE_FAILPOINT=dispatch-after-status ends the operator
    after the attempt's status write and before its dispatch; restarted, it runs the job once more and the
    job ends Succeeded exactly once."""
    try:
        emulator_mod = importlib.import_module("elastune_testing.emulator")
        k8s = importlib.import_module("kubernetes")
    except ImportError as exc:
        return Outcome(False, f"not run: needs the development extras ({exc}): pip install -e '.[dev]'")
    redis = RedisProcess(root / "op-redis")
    redis.start()
    emulator = emulator_mod.start_emulator(root / "emulator")
    bus = Bus(redis.url, f"chaos{time.time_ns()}")
    procs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    wid = "tiny-pod-1"
    try:
        api = k8s.config.new_client_from_config(config_file=str(emulator.kubeconfig_path))
        custom = k8s.client.CustomObjectsApi(api)
        # The cold pool the operator counts: one emulated node with 2 GPUs (k8s.node_capacity).
        importlib.import_module("elastune_testing.nodes").add_gpu_node(api, "gpu-node-0", 2)
        grp, ver = "elastune.dev", "v1alpha1"

        def create(plural: str, kind: str, name: str, spec: dict[str, Any]) -> None:
            obj = {"apiVersion": f"{grp}/{ver}", "kind": kind, "metadata": {"name": name}, "spec": spec}
            custom.create_namespaced_custom_object(grp, ver, "default", plural, obj)

        def status() -> dict[str, Any]:
            obj = custom.get_namespaced_custom_object(grp, ver, "default", "tuningjobs", "once")
            return dict(obj.get("status") or {})

        def cond(ctype: str) -> str:
            return next((c["status"] for c in status().get("conditions", []) if c["type"] == ctype), "")

        def operator(failpoint: str | None) -> subprocess.Popen[bytes]:
            env = {**os.environ, "KUBECONFIG": str(emulator.kubeconfig_path), "ELASTUNE_REDIS_URL": redis.url,
                   "ELASTUNE_REDIS_SECRET": "", "ELASTUNE_NAMESPACE": bus.ns,
                   "ELASTUNE_WORK_DIR": str(root / "op-work"), "ELASTUNE_METRICS_PORT": "0",
                   "ELASTUNE_PROOF_KEY": f"proof-{bus.ns}"}  # fmt: skip
            env.pop("ELASTUNE_FAILPOINT", None)
            if failpoint:
                env["ELASTUNE_FAILPOINT"] = failpoint
            cmd = [
                sys.executable,
                "-m",
                "elastune_operator.cli",
                "operator",
                "--standalone",
                "--all-namespaces",
            ]
            with (root / f"operator-{len(procs) + 1}.log").open("wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            return procs[-1]

        def beat() -> None:
            started = time.time()
            while not stop.is_set():
                rec = WorkerRecord(id=wid, pool="tiny", model="test/model", state=WorkerState.READY,
                                   started_at=started - 3, ready_at=started)  # fmt: skip
                bus.publish_worker(rec)
                stop.wait(1.0)

        pool = {
            "model": "test/model",
            "maxWarmGPUs": 1,
            "volumes": [{"claimName": "shared", "jobStorage": True}],
        }
        create("warmpools", "WarmPool", "tiny", pool)
        create("tuningjobs", "TuningJob", "once", {
            "model": "test/model", "dataset": "/data/train.jsonl", "termination": {"maxIterations": 20},
            "deadline": "10m", "promptBank": "never"})  # fmt: skip
        first = operator("dispatch-after-status")
        threading.Thread(target=beat, daemon=True).start()
        if not wait_until(lambda: first.poll() is not None, 90):
            return Outcome(False, "the operator never reached the failpoint dispatch-after-status")
        st1 = status()
        pushed = bus.redis.llen(assign_key(bus.ns, wid))
        operator(None)
        assigns = []
        a = wait_until(lambda: bus.pop_assignment(wid, timeout=0.5), 120)
        if a is None:
            return Outcome(
                False, f"exit {first.returncode} at the failpoint; the restarted operator never dispatched"
            )
        assigns.append(a)
        bus.post(Event(type="started", job=a.job, attempt=a.attempt, rank=0, worker=wid, proof=a.proof))
        bus.post(Event(type="succeeded", job=a.job, attempt=a.attempt, rank=0, worker=wid, proof=a.proof,
                       iterations=20,
                       artifact=a.artifact_dir))  # fmt: skip
        done = wait_until(lambda: cond("Succeeded") == "True", 60)
        time.sleep(3)
        extra = bus.pop_assignment(wid, timeout=0.5)
        st = status()
        detail = (f"operator exited {first.returncode} at the failpoint with attempts={st1.get('attempts')}"
                  f" in status and {pushed} assignment(s) pushed; restarted: attempt {a.attempt} dispatched"
                  f" (attempt 1 cancelled: {bus.cancelled(a.job, 1)}), job Succeeded={bool(done)}, "
                  f"attempts {st.get('attempts')}, further dispatch after success: {extra is not None} "
                  f"(worker played by the bench)")  # fmt: skip
        held = first.returncode == 86 and pushed == 0 and bool(done) and extra is None
        return Outcome(held, detail)
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
        bus.close()
        emulator.stop()
        redis.stop()


# --- the bench ---------------------------------------------------------------------------------------


@dataclass
class Plan:
    quick: bool
    recover_s: float = 60.0
    redis_down_s: float = 20.0
    job_iterations: int = 300
    results: dict[str, Outcome] = field(default_factory=dict)


STACK_EXPERIMENTS = (
    "result-suppressed",
    "redis-flushed",
    "redis-down",
    "poison-record-and-event",
    "bad-request-among-8-streams",
    "adapter-unloaded-behind-back",
    "worker-paused-past-ttl",
    "crash-looping-worker",
)


def experiments(plan: Plan) -> dict[str, Callable[[Stack], Outcome]]:
    return {
        "result-suppressed": lambda st: exp_result_suppressed(st, 120),
        "redis-flushed": lambda st: exp_redis_flush(st, plan.recover_s),
        "redis-down": lambda st: exp_redis_down(st, plan.redis_down_s, plan.recover_s),
        "poison-record-and-event": lambda st: exp_poison(st, plan.recover_s),
        "bad-request-among-8-streams": exp_bad_request,
        "adapter-unloaded-behind-back": lambda st: exp_unload(st, plan.recover_s),
        "worker-paused-past-ttl": lambda st: exp_paused_worker(st, plan.recover_s),
        "crash-looping-worker": lambda st: exp_crash_loop(st, 30 if plan.quick else 60),
    }


def start_stack(root: Path, job_iterations: int, out: Any, *, wait: bool = True) -> Stack:
    """A stack; with ``wait``, returned once the base model and the adapter answer."""
    stack = Stack(root, job_iterations=job_iterations)
    if not wait:
        return stack
    try:
        ready = stack.wait_serving(240)
        if ready is None:
            raise RuntimeError(f"the stack never served:\n{stack.serve_log_text()[-3000:]}")
    except BaseException:
        stack.close()
        raise
    print(f"[chaos] stack serving after {ready:.0f} s", file=out, flush=True)
    return stack


def run(plan: Plan, root: Path, only: set[str] | None = None, out: Any = sys.stdout) -> dict[str, Outcome]:
    """Run the experiments (``only``: these) and return their outcomes. Each stack experiment runs on the
    shared stack; one that left the stack not serving (its `elastune serve` exited) gets a fresh stack
    for the next, so each is judged on its own."""

    def record(name: str, fn: Callable[[], Outcome]) -> None:
        print(f"[chaos] {name} ...", file=out, flush=True)
        t0 = time.monotonic()
        try:
            res = fn()
        except Exception as exc:
            res = Outcome(False, f"the experiment raised {type(exc).__name__}: {exc}")
        res.seconds = time.monotonic() - t0
        plan.results[name] = res
        verdict = "held" if res.held else "LOST"
        print(f"[chaos] {name}: {verdict} ({res.seconds:.0f} s) {res.detail}", file=out, flush=True)

    todo = [n for n in STACK_EXPERIMENTS if only is None or n in only]
    fns = experiments(plan)
    stack: Stack | None = None
    n_stacks = 0
    try:
        for name in todo:
            if stack is None:
                n_stacks += 1
                long_job = n_stacks == 1 and "result-suppressed" in todo
                iterations = plan.job_iterations if long_job else 5
                # The TuningJob runs while the stack starts: its experiment starts with the stack.
                stack = start_stack(root / f"stack-{n_stacks}", iterations, out, wait=not long_job)
            record(name, partial(fns[name], stack))
            if not stack.serve_alive():
                last = [ln for ln in stack.serve_log_text().splitlines() if ln.strip()][-1:]
                plan.results[
                    name
                ].detail += (
                    f"; `elastune serve` EXITED (code {stack.serve.returncode}: {(last or [''])[0][:160]})"
                )
                plan.results[name].held = False
            # A lost experiment, or a stack that does not serve after it: the next one gets a fresh stack.
            if not plan.results[name].held or not stack.wait_serving(plan.recover_s):
                print(f"[chaos] a fresh stack after {name}", file=out, flush=True)
                stack.close()
                stack = None
    finally:
        if stack is not None:
            stack.close()
    if only is None or "operator-killed-at-dispatch" in only:
        record("operator-killed-at-dispatch", lambda: exp_operator_killed(root))
    return plan.results


def table(results: dict[str, Outcome]) -> str:
    rows = [("experiment", "held/lost", "what was seen")]
    rows += [(n, "held" if r.held else "LOST", r.detail) for n, r in results.items()]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = [f"| {a:<{w0}} | {b:<{w1}} | {c} |" for a, b, c in rows]
    lines.insert(1, f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|---|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="elastune bench chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Redis down 8 s instead of 20 s; shorter windows")
    ap.add_argument("--json", metavar="PATH", help="write {experiment: {held, detail}} here")
    ap.add_argument("--only", action="append", help="run only this experiment (repeatable)")
    ap.add_argument("--keep", metavar="DIR", help="keep state and logs in DIR (default: a temporary folder)")
    args = ap.parse_args(argv)
    plan = Plan(
        quick=args.quick, recover_s=30.0 if args.quick else 90.0, redis_down_s=8.0 if args.quick else 20.0
    )
    t0 = time.monotonic()
    if args.keep:
        root = Path(args.keep)
        root.mkdir(parents=True, exist_ok=True)
        results = run(plan, root, set(args.only) if args.only else None)
    else:
        with tempfile.TemporaryDirectory(prefix="elastune-chaos-") as tmp:
            results = run(plan, Path(tmp), set(args.only) if args.only else None)
    print()
    print(table(results))
    held = sum(r.held for r in results.values())
    print(f"\n{held}/{len(results)} held in {time.monotonic() - t0:.0f} s"
          + (f" (quick: Redis down {plan.redis_down_s:.0f} s, not 20 s)" if args.quick else ""))  # fmt: skip
    if args.json:
        doc = {n: {"held": r.held, "detail": r.detail} for n, r in results.items()}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if held == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
