"""The worker process's HTTP surface, over real HTTP: the Knative contract (/healthz, /readyz = warm,
/metrics, /status) and the OpenAI-shaped errors of /v1 before any engine serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from elastune_common.bus import Bus
from elastune_contract.protocol import WorkerRecord
from elastune_demo import build as tiny_build
from tiny_test_model import TEST_SPEC

CONTROL_TOKEN = "test-control-token"


def _get(
    url: str, body: dict[str, Any] | None = None, raw: bytes | None = None, token: str | None = None
) -> tuple[int, dict[str, Any] | str]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    except urllib.error.URLError as exc:  # not listening (yet)
        return 0, str(exc)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@pytest.fixture(scope="module")
def worker_url(worker: WorkerRecord) -> str:
    return worker.url


@pytest.fixture(scope="module")
def worker(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerRecord]:
    """The worker's registry record once it is ready (its serving and metrics URLs)."""
    model = tiny_build.ensure_tiny_model(spec=TEST_SPEC)
    ns = f"http{time.time_ns()}"
    log = (tmp_path_factory.mktemp("worker") / "worker.log").open("wb")
    cmd = [sys.executable, "-m", "elastune_worker", "serve", "--pool", "p", "--model", str(model)]
    cmd += ["--redis-url", redis_server.url, "--namespace", ns, "--worker-id", "w-http", "--port", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTUNE_CONTROL_TOKEN": CONTROL_TOKEN}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    bus = Bus(redis_server.url, ns)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            rec = bus.workers().get("w-http")
            if rec is not None and rec.url:
                status, _ = _get(rec.url + "/readyz")
                if status == 200:
                    yield rec
                    return
            assert proc.poll() is None, Path(log.name).read_text()
            time.sleep(0.2)
        pytest.fail("the worker never became ready: " + Path(log.name).read_text()[-2000:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        bus.close()


def test_container_contract(worker: WorkerRecord, worker_url: str) -> None:
    assert _get(worker_url + "/healthz") == (200, {"status": "ok"})
    status, ready = _get(worker_url + "/readyz")
    assert status == 200 and ready["status"] == "ready"  # type: ignore[index]
    status, metrics = _get(worker.metrics_url)  # its own port; the serving port's 404: tests/security
    assert status == 200 and "elastune_worker_ready" in str(metrics)
    assert _get(worker_url + "/status")[0] == 401  # the worker's record: its control token only
    status, record = _get(worker_url + "/status", token=CONTROL_TOKEN)
    assert status == 200 and record["id"] == "w-http"  # type: ignore[index]
    status, doc = _get(worker_url + "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in doc["paths"]  # type: ignore[index]


def test_errors_are_openai_shaped(worker_url: str) -> None:
    status, body = _get(worker_url + "/v1/completions", raw=b"{not json")
    assert status == 400 and body["error"]["type"] == "BadRequestError"  # type: ignore[index]
    status, body = _get(worker_url + "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -3})
    assert status == 400 and "max_tokens" in body["error"]["message"]  # type: ignore[index]
    status, body = _get(worker_url + "/nope")
    assert status == 404 and body["error"]["code"] == 404  # type: ignore[index]
