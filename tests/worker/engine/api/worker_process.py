"""A real `elastune_worker serve` process of the tiny Llama for HTTP tests: started, waited for until
its registry record has a URL whose /readyz answers, stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest

from elastune_common.bus import Bus
from elastune_demo import build as B


@contextlib.contextmanager
def served_worker(
    redis_url: str,
    namespace: str,
    worker_id: str,
    log_path: Path,
    model_name: str,
    extra_args: tuple[str, ...] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Yields the worker's URL as it registered it."""
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    cmd = [sys.executable, "-m", "elastune_worker", "serve", "--pool", "p", "--model", str(path)]
    cmd += ["--redis-url", redis_url, "--namespace", namespace, "--worker-id", worker_id, "--port", "0"]
    cmd += ["--served-model-name", model_name, "--kv-cache-tokens", "16384", *extra_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", **(extra_env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    bus = Bus(redis_url, namespace)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            rec = bus.workers().get(worker_id)
            if rec is not None and rec.url and httpx.get(rec.url + "/readyz").status_code == 200:
                yield rec.url
                return
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        pytest.fail("worker never became ready: " + log_path.read_text()[-2000:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        bus.close()
