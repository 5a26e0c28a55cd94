"""`elastune serve` stopped by SIGTERM (what Kubernetes, systemd and a terminal's `kill` send) at any
moment, start-up included, stops everything it started: its Redis, gateway and workers run in sessions
of their own, so a signal that ends serve before its clean-up would orphan them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from serve_process import ElastuneServe, processes_under, write_manifests

MODEL = "elastune/tiny-llama"


def holders_of(root: Path) -> list[str]:
    """Processes with a file open under ``root`` (the state dir: logs, Redis's dir), as 'pid cmdline'."""
    return [f"{pid} {cmd[:160]}" for pid, cmd in processes_under(root)]


def test_sigterm_during_start_up_leaves_no_process_behind(tmp_path: Path) -> None:
    pool = {
        "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
        "metadata": {"name": "tiny-llama", "namespace": "default"},
        "spec": {"model": MODEL, "maxWarmGPUs": 1, "serving": {"minReplicas": 0}},
    }  # fmt: skip
    state = tmp_path / "state"
    serve = ElastuneServe(write_manifests(tmp_path / "manifests", [pool]), state)
    gateway_log = state / "logs" / "gateway.log"
    deadline = time.monotonic() + 60
    while not gateway_log.exists():  # its Redis runs and the gateway is starting: mid start-up
        assert serve.proc.poll() is None and time.monotonic() < deadline, serve.output()
        time.sleep(0.02)
    serve.proc.send_signal(signal.SIGTERM)
    serve.proc.wait(timeout=60)
    deadline = time.monotonic() + 15
    while (left := holders_of(state)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for line in left:  # end what the old code left, then fail
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, f"elastune serve left these behind: {left}"


@pytest.fixture(autouse=True)
def _linux_proc() -> None:
    if not Path("/proc/self/fd").exists():
        pytest.skip("reads /proc to find processes (Linux)")
