"""`elastune serve -f <folder>` as a user runs it: a subprocess over manifest files, its gateway on a free
loopback port, its state (status files, logs) under ``state``. Used by the tests that drive the local
default end to end (serving, S3 artifacts, API keys)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import yaml

from elastune_common.servers import free_port


def write_manifests(folder: Path, docs: Iterable[dict[str, Any]]) -> Path:
    """One YAML file per object, named after it, as a user keeps them; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for doc in docs:
        (folder / f"{doc['kind'].lower()}-{doc['metadata']['name']}.yaml").write_text(yaml.safe_dump(doc))
    return folder


class ElastuneServe:
    def __init__(self, folder: Path, state: Path, workers: int = 1) -> None:
        self.port, self.state = free_port(), state
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastune_cli", "serve", "-f", str(folder),
             "--port", str(self.port), "--workers", str(workers), "--state-dir", str(state)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip

    @property
    def metrics_url(self) -> str:
        """The gateway's /metrics (a port of its own, written into the state directory)."""
        return (self.state / "gateway-metrics-url").read_text().strip()

    def wait_up(self, timeout: float = 60.0) -> ElastuneServe:
        """Until the gateway answers /healthz; fails with the output when the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"elastune serve exited with {self.proc.returncode}: {self.output()}")
            try:
                httpx.get(self.url + "/healthz", timeout=2)
                return self
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "elastune serve never came up"
                time.sleep(0.3)

    def openai_client(self, api_key: str = "unused", timeout: float = 180.0) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, timeout=timeout, max_retries=0)

    def status(self, kind: str, name: str, namespace: str = "default") -> dict[str, Any]:
        """The status `elastune serve` writes for an object (what kubectl get -o yaml shows on a cluster)."""
        path = self.state / "status" / f"{kind.lower()}-{namespace}-{name}.yaml"
        status: dict[str, Any] = yaml.safe_load(path.read_text())["status"]
        return status

    def log(self, pod: str) -> Path:
        return self.state / "logs" / f"{pod}.log"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> str:
        """Signal the process, wait for it (kill after ``timeout``) and return everything it printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out.decode()

    def output(self) -> str:
        return self.proc.stdout.read().decode() if self.proc.stdout else ""


def processes_under(root: Path) -> list[tuple[int, str]]:
    """(pid, command line) of the processes with a file open under ``root`` (a serve's state dir: logs,
    its Redis's dir): what `elastune serve` started, found as a user would with lsof."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(root)) for fd in fds):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append((int(pid), cmd))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found
