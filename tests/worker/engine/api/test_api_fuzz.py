"""schemathesis against the serving API's own OpenAPI document: generated requests (valid, invalid,
edge cases) never get a 5xx and never crash the server, which still serves a normal request after."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from elastune_common.servers import free_port  # noqa: E402
from elastune_demo import build as B  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # A short context keeps generated requests (max_tokens up to the context) quick on CPUs.
    cmd = [sys.executable, "-m", "elastune_worker.engine", "--model", str(path), "--port", str(port)]
    cmd += ["--served-model-name", "tiny-llama", "--max-model-len", "128", "--kv-cache-tokens", "8192"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url
        assert proc.poll() is None, "the server crashed:\n" + log.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_schemathesis_finds_no_server_error(server: str, tmp_path: Path) -> None:
    st = shutil.which("schemathesis") or shutil.which("st")
    if st is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'")
    res = subprocess.run(
        [st, "run", server + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", "30",
         "--seed", "1", "--request-timeout", "60", "--generation-deterministic"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3}
    ok = httpx.post(server + "/v1/completions", json=body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
