"""Real serving processes for benchmarks and tests: worker pods (``python -m elastune_worker serve``,
started by module name: the gateway never imports the worker package) registered in a real Redis, the
gateway (``python -m elastune_gateway.server``) in front of them, over HTTP, and the peer routers
(vllm-router, SGLang's smg) from their own venv (``tools/peer_routers_venv.sh``)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from elastune_common.bus import Bus
from elastune_common.servers import free_port
from elastune_contract.api_keys import KeySecret, key_map, publish

ROUTERS_VENV = Path(os.environ.get("ELASTUNE_CACHE", "~/.cache/elastune")).expanduser() / "venvs" / "routers"
"""Where ``tools/peer_routers_venv.sh`` puts vllm-router==0.1.17 and sglang-router==0.3.2 (smg)."""

#: Two shared cores: one torch thread per process, and no spinning OpenMP threads.
_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


class ProcessFailed(RuntimeError):
    pass


@dataclass
class ServiceProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    name: str
    control_token: str = ""
    """A worker's control token (adapter load/unload, /status need it as a Bearer token)."""
    metrics_url: str = ""
    """A worker's /metrics, on its metrics port (the serving port answers 404 for it)."""

    def control_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.control_token}"}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as fh:
        return subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **_ENV, **(env or {})}
        )


def start_worker(
    redis_url: str,
    namespace: str,
    worker_id: str,
    model_path: str | Path,
    served_name: str,
    log_dir: Path,
    *extra: str,
    pool: str = "p",
    wait: bool = True,
    timeout: float = 180.0,
) -> ServiceProcess:
    """A worker serving ``served_name``; with ``wait``, returns once it is registered and ready."""
    log = log_dir / f"{worker_id}.log"
    cmd = [sys.executable, "-m", "elastune_worker", "serve", "--pool", pool, "--model", str(model_path)]
    cmd += ["--redis-url", redis_url, "--namespace", namespace, "--worker-id", worker_id, "--port", "0"]
    cmd += ["--served-model-name", served_name, *extra]
    token = secrets.token_urlsafe(24)
    w = ServiceProcess(_spawn(cmd, log, {"ELASTUNE_CONTROL_TOKEN": token}), "", log, worker_id, token)
    if wait:
        wait_for_worker(w, redis_url, namespace, timeout)
    return w


def wait_for_worker(w: ServiceProcess, redis_url: str, namespace: str, timeout: float = 180.0) -> None:
    bus = Bus(redis_url, namespace)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not w.alive():
                raise ProcessFailed(f"worker {w.name} exited:\n{w.log_tail()}")
            rec = bus.workers().get(w.name)
            warm = rec is not None and rec.url and rec.serving is not None
            if rec is not None and warm and httpx.get(rec.url + "/readyz", timeout=5).status_code == 200:
                w.url, w.metrics_url = rec.url, rec.metrics_url
                return
            time.sleep(0.2)
        raise ProcessFailed(f"worker {w.name} not ready within {timeout:.0f} s:\n{w.log_tail()}")
    finally:
        bus.close()


def start_gateway(
    redis_url: str,
    namespace: str,
    log_dir: Path,
    *extra: str,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """The gateway on a free port, returned once /readyz says it read the registry."""
    port = free_port()
    log = log_dir / f"gateway-{port}.log"
    cmd = [sys.executable, "-m", "elastune_gateway.server", "--redis-url", redis_url]
    cmd += ["--namespace", namespace, "--host", "127.0.0.1", "--port", str(port), *extra]
    g = ServiceProcess(_spawn(cmd, log, env), f"http://127.0.0.1:{port}", log, "gateway")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not g.alive():
            raise ProcessFailed(f"gateway exited:\n{g.log_tail()}")
        try:
            if httpx.get(g.url + "/readyz", timeout=2).status_code == 200:
                return g
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    g.stop()
    raise ProcessFailed(f"gateway not ready within {timeout:.0f} s:\n{g.log_tail()}")


def wait_for_endpoints(gateway_url: str, n: int, timeout: float = 30.0) -> None:
    """Until the gateway's /readyz counts ``n`` endpoints (it re-reads the registry every 250 ms)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if httpx.get(gateway_url + "/readyz", timeout=5).json().get("endpoints") == n:
            return
        time.sleep(0.1)
    raise ProcessFailed(f"the gateway never saw {n} endpoints within {timeout:.0f} s")


def start_peer(
    kind: str, worker_urls: Sequence[str], logs: Path, model: str, policy: str = "cache_aware"
) -> ServiceProcess:
    """``vllm-router`` or ``smg`` in front of ``worker_urls``, returned once it routed a request for
    ``model``; FileNotFoundError when its venv is missing, RuntimeError when it cannot route."""
    binary = ROUTERS_VENV / "bin" / kind
    if not binary.exists():
        raise FileNotFoundError(
            f"{binary} is missing: run tools/peer_routers_venv.sh (vllm-router==0.1.17, "
            "sglang-router==0.3.2 in their own venv)"
        )
    port = free_port()
    cmd = [str(binary), *(["launch"] if kind == "smg" else []), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--policy", policy, "--worker-urls", *worker_urls]
    # Their metrics stay on (as ours), each on a port of its own: both default to 29000.
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    log = logs / f"{kind}-{port}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    peer = ServiceProcess(proc, f"http://127.0.0.1:{port}", log, kind)
    deadline = time.time() + 60
    body = {"model": model, "prompt": "hello", "max_tokens": 1}
    while time.time() < deadline:
        if not peer.alive():
            raise RuntimeError(f"{kind} exited: {peer.log_tail(600)}")
        try:
            if httpx.post(peer.url + "/v1/completions", json=body, timeout=5).status_code == 200:
                return peer
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    peer.stop()
    raise RuntimeError(f"{kind} never routed a request within 60 s: {peer.log_tail(600)}")


def publish_keys(redis_url: str, ns: str, secrets: list[KeySecret], models: list[str]) -> None:
    """API keys as the operator publishes them (digests, scopes, limits), for a gateway with --auth
    required; every key's namespace serves ``models``."""
    bus = Bus(redis_url, ns)
    try:
        publish(bus.redis, ns, key_map(secrets, {s.namespace: models for s in secrets}))
    finally:
        bus.close()
