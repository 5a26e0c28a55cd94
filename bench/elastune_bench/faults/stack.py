"""The local stack the chaos experiments run against, and what they observe it with.

A redis-server this bench owns (so it can flush, stop and restart it), `elastune serve` over manifest
files a user would write (the tiny Llama's WarmPool of two warm workers, its LoRA adapter `units`, two
LoRAAdapters whose artifacts cannot be served, a short TuningJob, a pool whose model does not exist, two
API key Secrets) and HTTP clients that speak to the gateway with a key.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from elastune_common.bus import Bus
from elastune_common.servers import binary, free_port
from elastune_contract.api_keys import API_KEY_LABEL
from elastune_contract.protocol import WorkerRecord

MODEL = "elastune/tiny-llama"
ADAPTER = "units"
OVERFLOWING = "overflowing"
"""A LoRAAdapter whose finite weights overflow: refused at load by the workers' probe."""
CORRUPT = "corrupt"
"""A LoRAAdapter whose safetensors file cannot be read."""
BROKEN_MODEL = "elastune/no-such-model"
JOB = "chaos-job"
KEY = "sk-chaos-valid-0123456789"
DOOMED_KEY = "sk-chaos-doomed-0123456789"
"""The key whose Secret an experiment removes while Redis is down."""
CLI = [sys.executable, "-m", "elastune_cli"]
#: Two shared cores: one torch thread per process, and no spinning OpenMP threads.
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
DATASET = Path(__file__).resolve().parents[3] / "manifests" / "data" / "extract.jsonl"


@dataclass
class Outcome:
    held: bool
    detail: str
    seconds: float = 0.0


@dataclass
class Plan:
    quick: bool
    recover_s: float = 60.0
    redis_down_s: float = 20.0
    pause_s: float = 20.0
    """How long a worker is paused (past its 10 s registry TTL either way)."""
    job_iterations: int = 300
    light: bool = False
    """A lighter main stack (``--light``): one warm worker, the base model, the adapter and the keys; no
    TuningJob, no broken pool or adapters. Enough for the experiments that need nothing else (the suite's
    smoke test runs two of them so)."""


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


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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


def key_secret(name: str, key: str, **data: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "default", "labels": {API_KEY_LABEL: "true"}}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": {"key": key, **data}}


def write_docs(folder: Path, docs: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for doc in docs:
        (folder / f"{doc['kind'].lower()}-{doc['metadata']['name']}.yaml").write_text(yaml.safe_dump(doc))
    return folder


def bad_adapters(root: Path, good: Path) -> dict[str, Path]:
    """Copies of the good adapter: one whose safetensors file is not one, one whose finite weights
    overflow (1e20 everywhere: the product of A and B is inf in float32)."""
    from safetensors.torch import load_file, save_file

    corrupt, overflow = root / CORRUPT, root / OVERFLOWING
    for d in (corrupt, overflow):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(good, d)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    weights = load_file(str(good / "adapter_model.safetensors"))
    save_file(
        {k: v.clone().fill_(1e20) for k, v in weights.items()}, str(overflow / "adapter_model.safetensors")
    )
    return {CORRUPT: corrupt, OVERFLOWING: overflow}


def manifests(
    folder: Path, adapter_dir: Path, broken: dict[str, Path], job_iterations: int, warm: int = 2
) -> Path:
    """The stack's manifests; ``job_iterations`` 0: no TuningJob, ``warm`` 1: no broken pool either (the
    light stack, whose ``broken`` is empty)."""
    serving = {"minReplicas": warm, "holdTimeout": "60s", "maxLoras": 2}
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "tiny-llama", "namespace": "default"},
            "spec": {"model": MODEL, "maxWarmGPUs": 3, "idleWindow": "900s", "serving": serving},
        },
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "broken", "namespace": "default"},
            "spec": {"model": BROKEN_MODEL, "maxWarmGPUs": 1, "idleWindow": "900s",
                     "serving": {"minReplicas": 0, "holdTimeout": "20s"}},
        },
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "TuningJob",
            "metadata": {"name": JOB, "namespace": "default"},
            "spec": {"model": MODEL, "dataset": str(DATASET), "deadline": "30m",
                     "termination": {"maxIterations": job_iterations},
                     "promptBank": "never", "hyperparameters": {"batchSize": 4, "virtualTokens": 8}},
        },
        # debug: its answers name the worker that served them (x-elastune-endpoint), which the worker
        # experiments read.
        key_secret("chaos-valid", KEY, debug="true"),
        key_secret("chaos-doomed", DOOMED_KEY),
    ]  # fmt: skip
    if warm < 2:
        docs = [d for d in docs if d["metadata"]["name"] != "broken"]
    if job_iterations <= 0:
        docs = [d for d in docs if d["kind"] != "TuningJob"]
    for name, path in {ADAPTER: adapter_dir, **broken}.items():
        docs.append({
            "apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"baseModel": MODEL, "artifactURL": str(path), "rank": 8},
        })  # fmt: skip
    return write_docs(folder, docs)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Stack:
    """redis-server + `elastune serve` (control core, three local CPU workers, gateway) on this machine."""

    def __init__(self, root: Path, job_iterations: int = 600, *, light: bool = False) -> None:
        from elastune_demo import adapters as tiny_adapters
        from elastune_demo import build as tiny_build

        tiny_build.ensure_tiny_model(spec=tiny_build.TINY_LLAMA_SPEC)
        self.adapter_dir = tiny_adapters.ensure_tiny_adapter(8)
        self.root = root
        self.state = root / "state"
        self.broken = {} if light else bad_adapters(root / "adapters", self.adapter_dir)
        self.warm = 1 if light else 2
        """Warm serving workers the stack keeps (and waits for)."""
        self.redis = RedisProcess(root / "redis")
        self.redis.start()
        self.bus = Bus(self.redis.url)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.folder = manifests(root / "manifests", self.adapter_dir, self.broken,
                                0 if light else job_iterations, self.warm)  # fmt: skip
        cmd = [*CLI, "serve", "-f", str(self.folder), "--port", str(self.port)]
        cmd += ["--workers", str(self.warm + 1), "--state-dir", str(self.state)]
        cmd += ["--redis-url", self.redis.url]
        self.serve_log = root / "serve.log"
        from elastune_worker.engine.model_runner.sampler import SAMPLER_RAISE

        # The sampling failpoint, armed on the workers: only a request with seed FAILPOINT_SEED fails in
        # the engine step, as a sampling bug hit by one request would.
        with self.serve_log.open("wb") as out:
            self.serve = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **ENV, "ELASTUNE_FAILPOINT": SAMPLER_RAISE},
            )  # fmt: skip
        self.http = httpx.Client(timeout=120, headers=auth())

    # --- observation -------------------------------------------------------------------------------
    def complete(self, model: str, *, max_tokens: int = 4, **extra: Any) -> httpx.Response:
        body = {"model": model, "prompt": "12 km ->", "max_tokens": max_tokens, "temperature": 0, **extra}
        return self.http.post(self.url + "/v1/completions", json=body)

    def answers(self, model: str) -> bool:
        return self.complete(model).status_code == 200

    def all_answer(self, models: tuple[str, ...] = (MODEL, ADAPTER)) -> bool:
        return all(self.answers(m) for m in models)

    def wait_serving(self, timeout: float, workers: int | None = None) -> float | None:
        """Seconds until the base model and the adapter both answer 200 and ``workers`` (default: the
        stack's warm count) serving workers are registered, None if not within ``timeout``."""
        workers = self.warm if workers is None else workers
        t0 = time.monotonic()
        ok = wait_until(lambda: len(self.serving_workers()) >= workers and self.all_answer(), timeout, 0.5)
        return time.monotonic() - t0 if ok else None

    def job_status(self) -> dict[str, Any]:
        found = sorted((self.state / "status").glob(f"tuningjob-*{JOB}*.yaml"))
        return (yaml.safe_load(found[0].read_text()) or {}).get("status") or {} if found else {}

    def job_condition(self, ctype: str) -> str:
        return next(
            (c.get("status", "") for c in self.job_status().get("conditions", []) if c["type"] == ctype), ""
        )

    def adapter_status(self, name: str) -> dict[str, Any]:
        path = self.state / "status" / f"loraadapter-default-{name}.yaml"
        return (yaml.safe_load(path.read_text()) or {}).get("status") or {} if path.exists() else {}

    def serving_workers(self) -> dict[str, WorkerRecord]:
        return {k: r for k, r in self.bus.workers().items() if r.model == MODEL and r.url}

    def control_token(self) -> str:
        return (self.state / "control-token").read_text().strip()

    def worker_headers(self, model: str = MODEL) -> dict[str, str]:
        """What a request straight to a worker needs: the gateway's per-request credential where this
        version of `elastune serve` keeps a request key (signed by the bench, which owns the state
        directory, as the gateway would sign it: local workers have no namespace), nothing otherwise."""
        key_file = self.state / "request-key"
        if not key_file.exists():
            return {}
        from elastune_contract import request_credential as rc

        value = rc.sign(key_file.read_bytes().strip(), "", model, adapter=False, key_id="default/chaos")
        return {rc.CREDENTIAL_HEADER: value}

    def serve_alive(self) -> bool:
        return self.serve.poll() is None

    def serve_log_text(self) -> str:
        return self.serve_log.read_text(errors="replace")

    def worker_log(self, wid: str) -> str:
        path = self.state / "logs" / f"{wid}.log"
        return path.read_text(errors="replace") if path.exists() else ""

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


def start_stack(
    root: Path, job_iterations: int, out: Any, *, wait: bool = True, light: bool = False
) -> Stack:
    """A stack; with ``wait``, returned once the base model and the adapter answer on its warm workers."""
    stack = Stack(root, job_iterations=job_iterations, light=light)
    if not wait:
        return stack
    try:
        ready = stack.wait_serving(300)
        if ready is None:
            raise RuntimeError(f"the stack never served:\n{stack.serve_log_text()[-3000:]}")
    except BaseException:
        stack.close()
        raise
    print(f"[chaos] stack serving after {ready:.0f} s", file=out, flush=True)
    return stack


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
        with httpx.Client(timeout=30, headers=auth()) as http:
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


def summary(codes: dict[str, list[int]]) -> str:
    parts = []
    for m, cs in codes.items():
        ok = sum(c == 200 for c in cs)
        bad = sorted({c for c in cs if c != 200})
        parts.append(f"{m.split('/')[-1]} {ok}/{len(cs)} ok" + (f" (others: {bad})" if bad else ""))
    return ", ".join(parts)


@dataclass
class Streamed:
    """One streamed completion as the client saw it."""

    code: int = 0
    chunks: int = 0
    finish: str = ""
    """The last finish_reason, or ``error: ...`` when an error event (or a broken connection) ended it."""
    endpoint: str = ""
    ended: float = 0.0


def stream(url: str, body: dict[str, Any], *, started: threading.Event | None = None,
           headers: dict[str, str] | None = None, stop_after: int | None = None) -> Streamed:  # fmt: skip
    """POST ``body`` with stream on; ``started`` is set at the first chunk; ``stop_after`` chunks: the
    client goes away (closes the connection) after that many."""
    res = Streamed()
    try:
        with (
            httpx.Client(timeout=120, headers=headers if headers is not None else auth()) as http,
            http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r,
        ):
            res.code, res.endpoint = r.status_code, r.headers.get("x-elastune-endpoint", "")
            if r.status_code != 200:
                res.finish = "error: " + r.read().decode(errors="replace")[:100]
                return res
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    res.finish = "error: " + str(doc["error"])[:100]
                    break
                res.chunks += 1
                if started is not None:
                    started.set()
                res.finish = doc["choices"][0].get("finish_reason") or res.finish
                if stop_after is not None and res.chunks >= stop_after:
                    break
    except httpx.HTTPError as exc:
        res.finish = f"error: {type(exc).__name__}"
    finally:
        res.ended = time.monotonic()
        if started is not None:
            started.set()
    return res


def lists(stack: Stack, url: str, model: str) -> bool:
    return model in {m["id"] for m in stack.http.get(url + "/v1/models").json()["data"]}


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples in ``text`` (any labels)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total
