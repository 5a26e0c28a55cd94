"""Nothing of one tenant visible to another through the gateway (issue 39 item 5), and limits failing
closed while Redis is away (item 2): a real gateway process over real HTTP, a real Redis holding the
registry and the key map the operator would publish.

Two tenants: team-a's pool serves ``model-a`` with team-a's adapter ``a-helper``, team-b's pool serves
``model-b`` with its adapter ``b-secret``, each on a pod the pool record vouches for. The pods are one
stand-in worker (a small HTTP server): it answers a completion, or, for the prompt ``vanish``, the 404 a
real worker gives for an adapter it no longer holds (``engine/api/routes.py``: "Available:" followed by
every model and adapter loaded on the pod, any namespace's). What a team-a key may learn is checked for
every name of team-b, and for the names of team-a its key does not reach.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from elastune_bench.processes import ServiceProcess, start_gateway
from elastune_common.bus import Bus
from elastune_common.servers import Server, free_port
from elastune_contract.api_keys import ApiKeyRecord, key_digest, publish
from elastune_contract.protocol import (
    AdapterState,
    ServingPoolRecord,
    ServingState,
    WorkerRecord,
    WorkerState,
)
from real_servers import start_redis

TEAM_B_NAMES = ("team-b", "model-b", "b-secret", "pb-pod-1", "key-b")
KEYS = {
    "sk-a-narrow": ApiKeyRecord(secret="team-a/key-a", models=("model-a", "gone"), requests_per_minute=1000),
    "sk-a-debug": ApiKeyRecord(secret="team-a/ops", models=("model-a", "a-helper"), debug=True),
    "sk-b": ApiKeyRecord(secret="team-b/key-b", models=("model-b", "b-secret"), tokens_per_minute=10_000),
}


class _Worker(BaseHTTPRequestHandler):
    """A worker pod's answers: a completion, or its 404 listing everything the pod holds."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        answer: dict[str, Any]
        if body.get("prompt") == "vanish":
            status, answer = 404, {"error": {"message": f"The model `{body['model']}` does not exist. "
                                             "Available: model-a, a-helper, model-b, b-secret",
                                  "type": "NotFoundError", "param": "model", "code": 404}}  # fmt: skip
        else:
            status = 200
            answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": body["model"],
                      "choices": [{"index": 0, "text": " ok", "finish_reason": "stop", "logprobs": None}],
                      "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}  # fmt: skip
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


def _registry(bus: Bus, port: int) -> None:
    """Both tenants' pools, pods and adapters, as workers and the operator publish them."""
    for ns, pool, model, pod, adapter in (("team-a", "pa", "model-a", "pa-pod-1", "a-helper"),
                                          ("team-b", "pb", "model-b", "pb-pod-1", "b-secret")):  # fmt: skip
        held = [AdapterState(name=adapter, namespace=ns, rank=8, tier="device")]
        serving = ServingState(model=model, max_model_len=256, adapters=held)
        bus.publish_worker(
            WorkerRecord(id=pod, pool=pool, model=model, state=WorkerState.READY,
                         url=f"http://127.0.0.1:{port}", started_at=1.0, serving=serving),
            ttl=600,
        )  # fmt: skip
        bus.publish_pool(ServingPoolRecord(pool=pool, model=model, namespace=ns,
                                           vouched={pod: f"127.0.0.1:{port}"}))  # fmt: skip
    publish(bus.redis, bus.ns, {key_digest(k): r for k, r in KEYS.items()})


@dataclass
class Stack:
    redis: Server
    bus: Bus
    gateway: ServiceProcess
    """As started before issue 39 item 5: authentication on, no metrics port, limits by default."""
    scraped: ServiceProcess
    """As the chart starts it (a metrics port), with ``--limits-on-redis-outage open``."""
    metrics_port: int


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("visibility")
    redis = start_redis(tmp)
    worker = ThreadingHTTPServer(("127.0.0.1", 0), _Worker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    bus = Bus(redis.url, f"vis{time.time_ns()}")
    procs: list[ServiceProcess] = []
    try:
        _registry(bus, worker.server_address[1])
        procs.append(start_gateway(redis.url, bus.ns, tmp, "--auth", "required"))
        port = free_port()
        flags = ("--metrics-port", str(port), "--limits-on-redis-outage", "open")
        procs.append(start_gateway(redis.url, bus.ns, tmp, "--auth", "required", *flags))
        for g in procs:  # until the registry read names both pools' endpoints
            deadline = time.time() + 10
            while httpx.get(g.url + "/readyz").json().get("endpoints") != 2 and time.time() < deadline:
                time.sleep(0.1)
        yield Stack(redis, bus, procs[0], procs[1], port)
    finally:
        for g in procs:
            g.stop()
        worker.shutdown()
        bus.close()
        redis.stop()


def _leaks(text: str, names: tuple[str, ...] = TEAM_B_NAMES) -> list[str]:
    return [n for n in names if n in text]


def _post(url: str, key: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"max_tokens": 2, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip


def test_readyz_names_no_model_adapter_or_pod(stack: Stack) -> None:
    gateway = stack.gateway
    ready = httpx.get(gateway.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["endpoints"] == 2  # how many, never which
    assert _leaks(ready.text, (*TEAM_B_NAMES, "model-a", "a-helper", "pa-pod-1")) == [], ready.text


def test_openapi_names_no_model(stack: Stack) -> None:
    """Served before any key is checked: with authentication it has no model names as examples."""
    gateway = stack.gateway
    doc = httpx.get(gateway.url + "/openapi.json")
    assert doc.status_code == 200 and "/v1/completions" in doc.json()["paths"]
    assert _leaks(doc.text, (*TEAM_B_NAMES, "model-a", "a-helper")) == [], _leaks(doc.text)
    assert "/metrics" not in doc.json()["paths"]


def test_errors_name_only_what_the_key_may_use(stack: Stack) -> None:
    gateway = stack.gateway
    # The gateway's own 404: a name in the key's scope that nothing serves lists only the key's models.
    r = _post(gateway.url, "sk-a-narrow", model="gone", prompt="x")
    assert r.status_code == 404 and "model-a" in r.json()["error"]["message"]
    assert _leaks(r.text, (*TEAM_B_NAMES, "a-helper")) == [], r.text
    # Another tenant's model: 403 naming the caller's key and the name it sent, whether or not it exists.
    r = _post(gateway.url, "sk-a-narrow", model="b-secret", prompt="x")
    assert r.status_code == 403 and _leaks(r.text, ("team-b", "model-b", "pb-pod-1", "key-b")) == [], r.text
    absent = _post(gateway.url, "sk-a-narrow", model="nothing-b", prompt="x")
    assert absent.status_code == 403
    assert r.json()["error"]["message"].replace("b-secret", "?") == absent.json()["error"]["message"].replace(
        "nothing-b", "?"
    )


def test_a_workers_404_is_not_relayed(stack: Stack) -> None:
    """A worker's 404 lists what its pod holds: the gateway answers in its own words."""
    gateway = stack.gateway
    r = _post(gateway.url, "sk-a-narrow", model="model-a", prompt="vanish")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert _leaks(r.text, (*TEAM_B_NAMES, "a-helper", "pa-pod-1")) == [], r.text


def test_the_endpoint_header_only_for_a_debug_key(stack: Stack) -> None:
    gateway = stack.gateway
    plain = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-a-narrow", max_retries=0)
    raw = plain.completions.with_raw_response.create(model="model-a", prompt="hi", max_tokens=2)
    assert raw.parse().choices[0].text == " ok"
    assert "x-elastune-endpoint" not in raw.headers
    assert _leaks(str(dict(raw.headers)), ("pa-pod-1", "team-a")) == []
    debug = _post(gateway.url, "sk-a-debug", model="model-a", prompt="hi")
    assert debug.status_code == 200 and debug.headers["x-elastune-endpoint"] == "pa-pod-1"


def test_metrics_only_on_the_metrics_port(stack: Stack) -> None:
    # With authentication and no metrics port, /metrics is served nowhere.
    assert httpx.get(stack.gateway.url + "/metrics").status_code == 404
    scraped = stack.scraped
    assert _post(scraped.url, "sk-b", model="model-b", prompt="hi").status_code == 200
    assert httpx.get(scraped.url + "/metrics").status_code == 404
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics").text
    assert 'elastune_gateway_key_requests_total{code="200",key="team-b/key-b"} 1.0' in text
    assert httpx.get(f"http://127.0.0.1:{stack.metrics_port}/v1/models").status_code == 404  # /metrics only


def test_limits_fail_closed_while_redis_is_away(stack: Stack) -> None:
    """Last (it stops the module's Redis). A key with limits gets 503 + Retry-After once Redis cannot
    count (the default: closed), and is let through uncounted with ``--limits-on-redis-outage open``; a
    key without limits is not affected. The key map stays in force meanwhile (auth_stale_s)."""
    closed, opened = stack.gateway, stack.scraped
    for g in (closed, opened):  # counted, then past the limiter: nothing serves `gone`
        assert _post(g.url, "sk-a-narrow", model="gone", prompt="x").status_code == 404
    stack.redis.stop()
    r = _post(closed.url, "sk-a-narrow", model="gone", prompt="x")
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "5" and "Rate limits cannot be counted" in r.text
    assert _post(opened.url, "sk-a-narrow", model="gone", prompt="x").status_code == 404
    assert _post(closed.url, "sk-b", model="model-b", prompt="hi").status_code == 503  # tokens/min: same
    assert _post(closed.url, "sk-a-debug", model="model-a", prompt="hi").status_code == 200  # no limits
