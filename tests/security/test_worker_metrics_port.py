"""A worker's /metrics on a port of its own (issue 39 item 5, the worker half; docs/security.md).

Its series name every adapter loaded on the pod, whichever namespace owns it, and the serving port is the
one the gateway (and anything else the NetworkPolicy admits) reaches. Against a real worker process and a
real standalone engine over HTTP: /metrics answers 404 on the serving port and is served on the metrics
port, which serves nothing else. And the manifests agree: the operator's pods name the port, the chart's
PodMonitor scrapes it, and the workers' NetworkPolicy admits Prometheus to it only (its rules:
tests/security/test_worker_isolation.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from elastune_bench.processes import ServiceProcess, start_worker  # noqa: E402
from elastune_common.servers import free_port  # noqa: E402
from elastune_contract.api.resources import parse_resource  # noqa: E402
from elastune_contract.api.warmpool import WarmPool  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_operator.k8s.workload import worker_deployment  # noqa: E402
from elastune_testing.podworld.helm import template  # noqa: E402

MODEL = "tiny-llama"
REPO = Path(__file__).resolve().parents[2]
SMALL = ("--kv-cache-tokens", "2048", "--max-model-len", "128")


@pytest.fixture(scope="module")
def worker(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    logs = tmp_path_factory.mktemp("metrics-worker")
    model = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    w = start_worker(redis_server.url, f"mport{time.time_ns()}", "w-mport", model, MODEL, logs, *SMALL)
    try:
        yield w
        assert w.alive(), w.log_tail()
    finally:
        w.stop()


def test_the_worker_serves_metrics_only_on_its_metrics_port(worker: ServiceProcess) -> None:
    w = worker
    served = httpx.get(w.url + "/metrics", timeout=10)
    assert served.status_code == 404 and "vllm:" not in served.text, served.text[:200]
    assert "/metrics" not in httpx.get(w.url + "/openapi.json", timeout=10).json()["paths"]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(w.url + "/v1/completions", json=body, timeout=60).status_code == 200  # still serves
    # The record names the metrics listener: the same host, another port.
    serving, scraped = urlsplit(w.url), urlsplit(w.metrics_url)
    assert scraped.hostname == serving.hostname and scraped.port != serving.port
    text = httpx.get(w.metrics_url, timeout=10).text
    assert "elastune_worker_ready 1.0" in text and "vllm:num_requests_running" in text
    base = f"http://{scraped.netloc}"
    for path in ("/v1/models", "/healthz", "/readyz", "/status", "/openapi.json", "/docs"):
        assert httpx.get(base + path, timeout=10).status_code == 404, path  # /metrics and nothing else
    assert httpx.post(w.metrics_url, timeout=10).status_code == 405


def test_the_standalone_engine_moves_metrics_with_metrics_port(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    model = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    cmd = [sys.executable, "-m", "elastune_worker.engine", "--model", str(model),
           "--port", str(port), "--metrics-port", str(metrics_port), "--engine-in-thread", "--engine-cpus",
           "none", *SMALL]  # fmt: skip
    log = tmp_path / "engine.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        assert httpx.get(url + "/metrics", timeout=10).status_code == 404
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert "vllm:num_requests_running" in text
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/health", timeout=10).status_code == 404
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)  # SIGTERM stops the metrics listener with the serving one
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise


def _worker_container(namespace: str = "team-a") -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    doc["metadata"].update(namespace=namespace, uid="u-1")
    # A pool's author cannot move the listener off the port the policy and the PodMonitor name.
    doc["spec"]["worker"]["env"] = [{"name": "ELASTUNE_METRICS_PORT", "value": "8080"}]
    pool = parse_resource(doc)
    assert isinstance(pool, WarmPool)
    deployment = worker_deployment(pool, 1, "redis://r:6379/0", "elastune-redis")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_pods_podmonitor_and_network_policy_agree_on_the_metrics_port() -> None:
    container = _worker_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8080, "metrics": 9091} and container["ports"][0]["name"] == "http"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ELASTUNE_METRICS_PORT"] == "9091" and env["PORT"] == "8080"
    assert [e["name"] for e in container["env"]].count("ELASTUNE_METRICS_PORT") == 1
    assert container["readinessProbe"]["httpGet"]["port"] == 8080  # the kubelet probes the serving port
    namespaced = template(
        "elastune", "elastune-system", "metrics.podMonitor.enabled=true", "operator.watchNamespaces={team-a}"
    )
    (monitor,) = [d for d in namespaced if d["kind"] == "PodMonitor"]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    (policy,) = [
        d for d in namespaced if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == "team-a"
    ]
    cluster_wide = template("elastune", "elastune-system")
    deploy = next(
        d for d in cluster_wide if d["kind"] == "Deployment" and d["metadata"]["name"] == "elastune-operator"
    )
    env = {e["name"]: e.get("value", "") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    # Cluster-wide the operator writes the same rules into each pool namespace.
    assert json.loads(env["ELASTUNE_WORKER_NETWORK_POLICY"])["ingress"] == policy["spec"]["ingress"]
    by_port = {p["port"]: rule["from"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert set(by_port) == {"http", "metrics"} and set(by_port) <= set(ports)  # ports the pods name
    assert by_port["metrics"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]  # fmt: skip
    assert "prometheus" not in json.dumps(by_port["http"])
