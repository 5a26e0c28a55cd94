"""Workers serve only the gateway (issue 39 item 3): the per-request credential, over real HTTP.

A real worker process of namespace team-a (tiny Llama, two hand-loaded adapters ``units`` and ``other``)
holding team-a's request key, and a real gateway process holding the secret it is derived from. Through
the gateway (which signs each request) the base model and an adapter are served. Straight to the worker:
no credential, the gateway's namespace/tenant headers alone, a forged signature, an expired or too long
lived credential, a tampered payload, a credential for another namespace, one naming another adapter or
the base model for an adapter, one naming another namespace's adapter of that name → 401/403/404,
OpenAI-shaped, nothing served, each refusal counted on /metrics.

Before the credential the worker served every one of these (200): it trusted whoever reached its port,
and resolved ``units`` by name when no namespace header came.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from elastune_bench.processes import ServiceProcess, start_gateway, start_worker
from elastune_contract.request_credential import (
    CREDENTIAL_HEADER,
    Credential,
    namespace_key,
    seal,
)
from elastune_demo import adapters as A
from elastune_demo import build as B

MODEL = "tiny-llama"
NS = "team-a"
SECRET = b"the-gateways-secret-for-this-test"
KEY = namespace_key(SECRET, NS)


@pytest.fixture(scope="module")
def stack(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServiceProcess]]:
    logs = tmp_path_factory.mktemp("credential")
    (logs / NS).mkdir()  # the log is named after the worker id (namespace/pod)
    prefix = f"cred{time.time_ns()}"
    with pytest.MonkeyPatch.context() as mp:  # the worker's environment: a pod of team-a with its key
        mp.setenv("POD_NAMESPACE", NS)
        mp.setenv("ELASTUNE_REQUEST_KEY", KEY.decode())
        w = start_worker(
            redis_server.url, prefix, f"{NS}/w-cred", B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), MODEL,
            logs, "--kv-cache-tokens", "4096", "--max-model-len", "128", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8",
        )  # fmt: skip
    g: ServiceProcess | None = None
    try:
        for name in ("units", "other"):
            body = {"lora_name": name, "lora_path": str(A.ensure_tiny_adapter(8))}
            r = httpx.post(
                w.url + "/v1/load_lora_adapter", json=body, headers=w.control_headers(), timeout=60
            )
            assert r.status_code == 200, r.text
        g = start_gateway(redis_server.url, prefix, logs, env={"ELASTUNE_REQUEST_KEY": SECRET.decode()})
        # The worker publishes its adapters with its next heartbeat and the gateway re-reads the registry:
        # until then `units` is a 404 at the gateway (one run in three raced it).
        deadline = time.monotonic() + 30
        while "units" not in {m["id"] for m in httpx.get(g.url + "/v1/models", timeout=10).json()["data"]}:
            assert time.monotonic() < deadline, "the gateway never listed the worker's adapter"
            time.sleep(0.2)
        yield {"worker": w, "gateway": g}
        assert w.alive(), w.log_tail()
    finally:
        if g is not None:
            g.stop()
        w.stop()


def _body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "hello", "max_tokens": 2}


def _cred(model: str, *, adapter: bool, ns: str = NS, key: bytes = KEY, ttl: float = 20.0) -> dict[str, str]:
    return {CREDENTIAL_HEADER: seal(key, Credential(ns, model, adapter, "team-a/key-1", time.time() + ttl))}


def _post(w: ServiceProcess, model: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(w.url + "/v1/completions", json=_body(model), headers=headers, timeout=60)


def _refused(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] in ("AuthenticationError", "PermissionDeniedError"), err


def test_the_gateway_signs_and_the_worker_serves(stack: dict[str, ServiceProcess]) -> None:
    g = stack["gateway"]
    for model in (MODEL, "units"):
        r = httpx.post(g.url + "/v1/completions", json=_body(model), timeout=60)
        assert r.status_code == 200, (model, r.text)
        assert r.json()["choices"][0]["text"] is not None


def test_unsigned_requests_and_trusted_headers_are_refused(stack: dict[str, ServiceProcess]) -> None:
    w = stack["worker"]
    for model in (MODEL, "units"):
        _refused(_post(w, model, {}), 401)
        _refused(_post(w, model, {"x-elastune-namespace": "", "x-elastune-tenant": "team-a/key-1"}), 401)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(w.url + "/v1/chat/completions", json=chat, timeout=30)
    _refused(r, 401)


def test_forged_expired_and_tampered_credentials_are_refused(stack: dict[str, ServiceProcess]) -> None:
    w = stack["worker"]
    _refused(_post(w, MODEL, _cred(MODEL, adapter=False, key=namespace_key(b"a guess", NS))), 401)
    _refused(_post(w, MODEL, _cred(MODEL, adapter=False, key=SECRET)), 401)  # the secret is not the key
    _refused(_post(w, MODEL, _cred(MODEL, adapter=False, ttl=-60)), 401)  # expired
    _refused(_post(w, MODEL, _cred(MODEL, adapter=False, ttl=3600)), 401)  # lives longer than allowed
    good = _cred(MODEL, adapter=False)[CREDENTIAL_HEADER]
    version, payload, mac = good.split(".")
    other = _cred("units", adapter=True)[CREDENTIAL_HEADER].split(".")[1]
    _refused(_post(w, "units", {CREDENTIAL_HEADER: f"{version}.{other}.{mac}"}), 401)  # payload swapped
    _refused(_post(w, MODEL, {CREDENTIAL_HEADER: f"{version}.{payload}.{'0' * len(mac)}"}), 401)
    _refused(_post(w, MODEL, {CREDENTIAL_HEADER: "v1.garbage"}), 401)


def test_another_namespace_and_another_model_are_refused(stack: dict[str, ServiceProcess]) -> None:
    w = stack["worker"]
    # team-b's own key (a pod of team-b holds it) opens no team-a worker; team-a's key naming team-b: 403.
    _refused(
        _post(w, MODEL, _cred(MODEL, adapter=False, ns="team-b", key=namespace_key(SECRET, "team-b"))), 401
    )
    _refused(_post(w, MODEL, _cred(MODEL, adapter=False, ns="team-b")), 403)
    _refused(_post(w, "other", _cred("units", adapter=True)), 403)  # signed for units, asks other
    _refused(_post(w, "units", _cred(MODEL, adapter=False)), 403)  # signed for the base model
    _refused(_post(w, MODEL, _cred("units", adapter=True)), 403)
    # Another namespace's adapter of the same name: resolved in that namespace only, no fallback.
    r = _post(w, "units", _cred("team-b/units", adapter=True))
    assert r.status_code == 404, r.text
    ok = _post(w, "units", _cred("units", adapter=True))
    assert ok.status_code == 200, ok.text


def test_refusals_are_counted(stack: dict[str, ServiceProcess]) -> None:
    w = stack["worker"]
    _refused(_post(w, MODEL, {}), 401)
    text = httpx.get(w.metrics_url, timeout=10).text
    counts = {
        line.split('reason="')[1].split('"')[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("elastune_worker_request_credential_refused_total{")
    }
    assert counts.get("missing", 0) >= 1, counts
