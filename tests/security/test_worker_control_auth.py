"""Worker control endpoints need the worker's control token (issue 25 item 4, docs/design.md §6 Tenancy).

Against a real worker process over real HTTP: an unauthenticated POST /v1/unload_lora_adapter used to
remove a served adapter; now it is a 401 (OpenAI-shaped) and the adapter is still served, while the same
call with the token succeeds. Inference and health stay open (/metrics too, on the metrics port:
test_worker_metrics_port.py); an unknown path is still a 404.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("peft")

from elastune_bench.processes import ServiceProcess, start_worker  # noqa: E402
from elastune_demo import adapters as A  # noqa: E402
from elastune_demo import build as B  # noqa: E402

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def worker(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    logs = tmp_path_factory.mktemp("control-worker")
    w = start_worker(
        redis_server.url, f"ctl{time.time_ns()}", "w-ctl", B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC),
        MODEL, logs, "--kv-cache-tokens", "4096", "--max-model-len", "128", "--enable-lora",
        "--max-loras", "1", "--max-lora-rank", "8",
    )  # fmt: skip
    try:
        yield w
        assert w.alive(), w.log_tail()
    finally:
        w.stop()


def served(w: ServiceProcess) -> set[str]:
    return {m["id"] for m in httpx.get(w.url + "/v1/models", timeout=10).json()["data"]}


def complete(w: ServiceProcess, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    return httpx.post(w.url + "/v1/completions", json=body, timeout=60)


def test_unload_without_the_token_is_401_and_the_adapter_stays(worker: ServiceProcess) -> None:
    w = worker
    adapter = {"lora_name": "units", "lora_path": str(A.ensure_tiny_adapter(8))}
    r = httpx.post(w.url + "/v1/load_lora_adapter", json=adapter, timeout=60)
    assert r.status_code == 401, r.text  # loading needs it too
    assert "units" not in served(w)
    r = httpx.post(w.url + "/v1/load_lora_adapter", json=adapter, headers=w.control_headers(), timeout=60)
    assert r.status_code == 200, r.text
    assert "units" in served(w)

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": w.control_token}):
        r = httpx.post(w.url + "/v1/unload_lora_adapter", json={"lora_name": "units"}, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert (
            err["code"] == 401 and err["type"] == "AuthenticationError" and "control token" in err["message"]
        )
    assert "units" in served(w)
    assert complete(w, "units").status_code == 200  # still served

    r = httpx.post(
        w.url + "/v1/unload_lora_adapter", json={"lora_name": "units"}, headers=w.control_headers()
    )
    assert r.status_code == 200, r.text
    assert "units" not in served(w)
    assert complete(w, "units").status_code == 404


def test_inference_health_and_metrics_stay_open_status_needs_the_token(worker: ServiceProcess) -> None:
    w = worker
    for path in ("/healthz", "/readyz", "/health", "/v1/models", "/openapi.json"):
        assert httpx.get(w.url + path, timeout=10).status_code == 200, path
    assert httpx.get(w.metrics_url, timeout=10).status_code == 200  # its own port (issue 39 item 5)
    assert complete(w, MODEL).status_code == 200
    assert httpx.get(w.url + "/status", timeout=10).status_code == 401
    r = httpx.get(w.url + "/status", headers=w.control_headers(), timeout=10)
    assert r.status_code == 200 and r.json()["id"] == "w-ctl"
    assert httpx.get(w.url + "/nope", timeout=10).status_code == 404  # no route: still its 404


def test_local_backend_gives_its_workers_a_token_file_per_run(tmp_path: Path) -> None:
    """`elastune serve` (LocalBackend): each run makes a token, in a file only its user reads, and names
    that file to every worker it starts."""
    from elastune_operator.local.backend import LocalBackend

    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\nenv > {tmp_path}/env.txt\n")
    fake.chmod(0o755)
    runs = [LocalBackend(tmp_path / f"run{i}", "redis://127.0.0.1:1", python=str(fake)) for i in range(2)]
    assert runs[0].control_token != runs[1].control_token and len(runs[0].control_token) >= 32
    b = runs[0]
    assert stat.S_IMODE(os.stat(b.control_token_file).st_mode) == 0o600
    assert b.control_token_file.read_text() == b.control_token
    p = b.start_worker("p-w1", "p", "m")
    assert p.proc.wait(timeout=30) == 0
    env = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines() if "=" in line)
    assert env["ELASTUNE_CONTROL_TOKEN_FILE"] == str(b.control_token_file)
    assert b.control_token not in (tmp_path / "env.txt").read_text()


def test_the_token_comes_from_the_mounted_file_first(tmp_path: Path) -> None:
    """Pods get it as a file (the operator's Secret, mounted); an empty file is refused, never a guessable
    token; without any, a random one (the control routes closed over HTTP)."""
    from elastune_worker.server.control_auth import control_token

    f = tmp_path / "token"
    f.write_text("from-the-secret\n")
    env = {"ELASTUNE_CONTROL_TOKEN_FILE": str(f), "ELASTUNE_CONTROL_TOKEN": "from-env"}
    assert control_token(env) == ("from-the-secret", str(f))
    assert control_token({"ELASTUNE_CONTROL_TOKEN": "from-env"})[0] == "from-env"
    f.write_text("")
    with pytest.raises(ValueError, match="empty"):
        control_token(env)
    token, source = control_token({})
    assert source == "random" and len(token) >= 32 and token != control_token({})[0]
