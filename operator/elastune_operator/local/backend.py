"""The Local backend: worker processes on this machine stand in for the Knative pods of a WarmPool.

Each "GPU" is one `python -m elastune_worker serve` process (one torch thread each, so a 2-core machine
holds two). Growing a pool starts processes; shrinking terminates the idle ones the core names. The
processes register through Redis exactly as pods do, so the core cannot tell the difference.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from elastune_contract.protocol import split_adapter_id, vouched_address
from elastune_contract.request_credential import namespace_key
from elastune_operator.control.backend import WorkerExit

LOOPBACK = "127.0.0.1"


@dataclass
class _Proc:
    wid: str
    pool: str
    """The pool's id (namespace/name) as the core names it."""
    model: str
    proc: subprocess.Popen[bytes]
    log: Path
    stopping: bool = False
    reported: bool = False


class LocalBackend:
    def __init__(
        self,
        work_dir: Path,
        redis_url: str,
        namespace: str = "elastune",
        *,
        threads_per_worker: int = 1,
        python: str = sys.executable,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.work_dir = Path(work_dir)
        self.redis_url = redis_url
        self.namespace = namespace
        self.threads = threads_per_worker
        self.python = python
        self.extra_env = extra_env or {}
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # The workers' control token (adapter load/unload, /status over HTTP), one per run: a file only
        # this user reads, named to the workers by path (not in their environment).
        self.control_token = secrets.token_urlsafe(32)
        self.control_token_file = self.work_dir / "control-token"
        self.control_token_file.touch(mode=0o600)
        self.control_token_file.chmod(0o600)
        self.control_token_file.write_text(self.control_token)
        # The gateway's request key (it signs every forwarded request) and the workers' key derived from
        # it (local workers have no namespace): files only this user reads (request_credential.py).
        secret = secrets.token_urlsafe(32).encode()
        self._request_secret = secret
        self.request_key_file = _private_file(self.work_dir / "request-key", secret)
        self.worker_request_key_file = _private_file(
            self.work_dir / "worker-request-key", namespace_key(secret, "")
        )
        self.procs: dict[str, _Proc] = {}
        self.pool_args: dict[str, list[str]] = {}
        """Extra worker flags per pool, by pool id (namespace/name; its serving section as engine flags)."""
        self._n = 0
        (self.work_dir / "logs").mkdir(parents=True, exist_ok=True)

    def grow(self, pool: str, model: str, count: int) -> None:
        """``pool``: the pool's id (namespace/name, as the core names it). A local process has no
        namespace of its own (a pod registers as <namespace>/<pod> with its WarmPool's name), so its
        workers register with the pool's id: two namespaces' pools of one name and model each bind their
        own (``records.record_pool``). They are numbered across pools, so their ids never repeat."""
        name = split_adapter_id(pool)[1]
        for _ in range(count):
            self._n += 1
            self.start_worker(f"{name}-w{self._n}", pool, model)

    def _request_key_env(self, wid: str) -> dict[str, str]:
        """The request key a worker verifies with: derived for its namespace, as the operator writes one
        per pool namespace (a worker id ``<namespace>/<pod>``, what a Kubernetes stand-in starts), else the
        local workers' key (no namespace)."""
        namespace = wid.split("/", 1)[0] if "/" in wid else ""
        if not namespace:
            return {"ELASTUNE_REQUEST_KEY_FILE": str(self.worker_request_key_file)}
        path = self.work_dir / f"worker-request-key-{namespace}"
        if not path.exists():
            _private_file(path, namespace_key(self._request_secret, namespace))
        return {"ELASTUNE_REQUEST_KEY_FILE": str(path), "POD_NAMESPACE": namespace}

    def start_worker(
        self, wid: str, pool: str, model: str, host: str = LOOPBACK, port: int = 0, *, key: str | None = None
    ) -> _Proc:
        """A worker process registered as ``wid`` of pool ``pool`` (its name), serving on ``host:port``
        (port 0: one it picks); ``key``: the pool's id its vouched list goes under (default: ``pool``)."""
        log = self.work_dir / "logs" / f"{wid.replace('/', '_')}.log"  # namespace/pod: one file
        argv = [self.python, "-m", "elastune_worker", "serve", "--pool", pool, "--model", model]
        argv += ["--redis-url", self.redis_url, "--namespace", self.namespace, "--worker-id", wid]
        argv += ["--host", host, "--port", str(port), "--threads", str(self.threads)]
        argv += self.pool_args.get(key or pool, self.pool_args.get(pool, []))
        env = {
            **os.environ,
            # Idle OpenMP threads must not spin: workers share the cores (~25x slower otherwise).
            "OMP_WAIT_POLICY": "PASSIVE",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **self.extra_env,
            "ELASTUNE_CONTROL_TOKEN_FILE": str(self.control_token_file),
            **self._request_key_env(wid),
        }
        with log.open("ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        p = _Proc(wid, key or pool, model, proc, log)
        self.procs[wid] = p
        return p

    def shrink(self, pool: str, worker_ids: list[str]) -> None:
        for wid in worker_ids:
            p = self.procs.get(wid)
            if p is not None and p.proc.poll() is None:
                p.stopping = True
                p.proc.send_signal(signal.SIGTERM)

    def mark_busy(self, pool: str, worker_ids: list[str], busy: bool) -> None:
        pass  # the core itself picks which local processes to stop: only idle ones

    def vouched(self) -> dict[str, dict[str, str]]:
        """The live worker processes per pool, at the loopback address they were told to bind: the
        gateway forwards only to these. The port is the worker's own pick (``--port 0``), so locally the
        host is what is vouched for, not host:port."""
        out: dict[str, dict[str, str]] = {}
        for wid, p in self.procs.items():
            if p.proc.poll() is None:
                out.setdefault(p.pool, {})[wid] = vouched_address(LOOPBACK)
        return out

    def kill(self, wid: str) -> None:
        """SIGKILL a worker as a crash would (tests)."""
        self.procs[wid].proc.kill()

    def exited(self) -> dict[str, WorkerExit]:
        out: dict[str, WorkerExit] = {}
        for wid, p in list(self.procs.items()):
            rc = p.proc.poll()
            if rc is None:
                continue
            if p.stopping:
                del self.procs[wid]
                continue
            detail = f"worker process {wid} exited with code {rc}; log {p.log}: {_tail(p.log)}"
            out[wid] = WorkerExit(p.model, detail, pool=p.pool)
        return out

    def close(self, timeout: float = 10.0) -> None:
        for p in self.procs.values():
            if p.proc.poll() is None:
                p.stopping = True
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) if text else "(empty log)"


def _private_file(path: Path, content: bytes) -> Path:
    """``content`` in a file only this user can read (0600 before anything is written)."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(content)
    return path
