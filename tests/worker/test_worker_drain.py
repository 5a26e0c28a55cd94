"""A worker given SIGTERM drains (issue 38 item 1): it stops taking requests (readiness false, out of the
registry, new requests 503 with the draining header so a gateway retries them elsewhere), finishes every
stream in flight, then exits. Before, the process exited at once and every stream ended with "the engine
process exited". A real `elastune worker` process of the tiny Llama, the real `openai` client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from elastune_common.bus import Bus  # noqa: E402
from elastune_demo import build as B  # noqa: E402

MODEL = "tiny-llama"
STREAMS = 6
TOKENS = 160


def _start(redis_url: str, ns: str, log_path: Path, drain_s: float) -> tuple[subprocess.Popen[bytes], str]:
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    cmd = [sys.executable, "-m", "elastune_worker", "serve", "--pool", "p", "--model", str(path)]
    cmd += ["--redis-url", redis_url, "--namespace", ns, "--worker-id", "w-drain", "--port", "0"]
    cmd += ["--served-model-name", MODEL, "--kv-cache-tokens", "16384", "--drain-seconds", str(drain_s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    bus = Bus(redis_url, ns)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            rec = bus.workers().get("w-drain")
            if rec is not None and rec.url:
                ready = httpx.get(rec.url + "/readyz")
                if ready.status_code == 200:
                    return proc, rec.url
                # while the weights load, readiness says so (issue 37 item 3)
                assert ready.json()["status"] == "loading", ready.text
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
    finally:
        bus.close()
    proc.kill()
    pytest.fail("worker never became ready: " + log_path.read_text()[-2000:])


def test_sigterm_finishes_every_stream_in_flight_then_exits(
    redis_server: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ns = f"drain{time.time_ns()}"
    log_path = tmp_path / "worker.log"
    proc, url = _start(redis_server.url, ns, log_path, drain_s=120)
    request.addfinalizer(proc.kill)  # a failed assertion must not leave the worker behind
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    errors: list[BaseException] = []
    first_chunk = threading.Barrier(STREAMS + 1, timeout=120)

    def stream(i: int) -> None:
        try:
            chunks = client.completions.create(
                model=MODEL, prompt=f"{i} km →", max_tokens=TOKENS, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            got = []
            for n, chunk in enumerate(chunks):
                if n == 0:
                    first_chunk.wait()
                got.append(chunk.choices[0].text)
                finished[i] = chunk.choices[0].finish_reason
            texts[i] = "".join(got)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    first_chunk.wait()  # every stream is running
    proc.send_signal(signal.SIGTERM)
    bus = Bus(redis_server.url, ns)
    try:
        # not ready, out of the registry, and a new request is refused so it can go elsewhere
        deadline = time.time() + 10
        while time.time() < deadline and "w-drain" in bus.workers():
            time.sleep(0.05)
        assert "w-drain" not in bus.workers(), "a draining worker stayed in the registry"
        ready = httpx.get(url + "/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers.get("x-elastune-draining") == "1", r.text
        assert proc.poll() is None, "the worker exited with streams in flight"
    finally:
        bus.close()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sorted(finished) == list(range(STREAMS)) and set(finished.values()) == {"length"}, finished
    assert proc.wait(timeout=60) == 0, log_path.read_text()[-2000:]
    assert "drained: no request in flight" in log_path.read_text()


def test_the_drain_deadline_bounds_the_wait(
    redis_server: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Streams longer than the drain's deadline do not keep the pod past its grace period: the worker
    exits once the deadline passes, saying how many were still in flight."""
    ns = f"drain{time.time_ns()}"
    log_path = tmp_path / "worker.log"
    proc, url = _start(redis_server.url, ns, log_path, drain_s=0.5)
    request.addfinalizer(proc.kill)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    started = threading.Barrier(9, timeout=120)

    def long_stream(i: int) -> None:
        try:
            chunks = client.completions.create(
                model=MODEL, prompt=f"{i} km →", max_tokens=1800, stream=True, extra_body={"ignore_eos": True}
            )
            for n, _ in enumerate(chunks):
                if n == 0:
                    started.wait()
        except Exception:  # cut at the deadline, as it must be
            pass

    threads = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    started.wait()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert time.monotonic() - sent < 30
    assert "drain deadline (0.5 s) passed with" in log_path.read_text(), log_path.read_text()[-2000:]
