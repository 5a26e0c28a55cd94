"""The predictor service over real HTTP: a uvicorn process, httpx as the client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def service(predictor_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "ssjf"), str(ROOT / "worker"), str(ROOT / "contract"), env.get("PYTHONPATH", "")]
    )
    log = tmp_path_factory.mktemp("ssjf") / "service.log"
    cmd = [sys.executable, "-m", "elastune_ssjf", "--port", str(port), "--model", str(predictor_dir)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the service exited ({proc.returncode}): {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"the service did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_healthz(service: str):
    assert httpx.get(service + "/healthz").json() == {"status": "ok", "model": "ssjf-predictor-v1"}


def test_predict_length_returns_one_int_per_prompt_in_order(service: str):
    prompts = ["Write a long story about a dragon.", "hi", "List 20 countries and their capitals."]
    r = httpx.post(service + "/v1/predict_length", json={"prompts": prompts}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "ssjf-predictor-v1"
    got = body["predicted_output_tokens"]
    assert len(got) == 3 and all(isinstance(v, int) and v >= 1 for v in got)
    alone = httpx.post(service + "/v1/predict_length", json={"prompts": prompts[2:]}, timeout=30).json()
    assert alone["predicted_output_tokens"] == got[2:]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompts"),
        ({"prompts": []}, "prompts"),
        ({"prompts": "one string"}, "prompts"),
        ({"prompts": ["ok", 3]}, "prompts.1"),
        ([], "body"),
    ],
)
def test_bad_bodies_are_openai_shaped_400s(service: str, body: object, param: str):
    r = httpx.post(service + "/v1/predict_length", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["type"], err["param"]) == (400, "BadRequestError", param) and err["message"]


def test_invalid_json_is_a_400(service: str):
    r = httpx.post(
        service + "/v1/predict_length", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_startup_builds_the_predictor_when_the_cache_has_none(
    predictor_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """The build itself is the cached one copied in (a real build takes about a minute; test_ssjf_predictor
    checks what it writes): what is checked here is that startup notices the miss, builds, logs."""
    import logging
    import shutil

    from elastune_ssjf import build as B
    from elastune_ssjf import service

    built: list[Path | None] = []

    def fake_build(cache_dir: Path | None = None, **_: object) -> Path:
        built.append(cache_dir)
        shutil.copytree(predictor_dir, B.model_dir(cache_dir))
        return B.model_dir(cache_dir)

    monkeypatch.setattr(B, "ensure_predictor", fake_build)
    with caplog.at_level(logging.INFO, logger="elastune.ssjf"):
        p = service.load_predictor(None, tmp_path)
        assert built == [tmp_path] and "building the SSJF predictor" in caplog.text
        caplog.clear()
        service.load_predictor(None, tmp_path)  # now cached: no second build
    assert built == [tmp_path] and "building" not in caplog.text
    assert p.path == B.model_dir(tmp_path) and len(p.predict(["hello"])) == 1
