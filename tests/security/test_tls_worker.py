"""Gateway → worker over HTTPS with a private CA (issue 39 item 6; docs/operations/tls.md).

A real worker process serving its tiny model with a certificate the test's CA signed for the name every
worker certificate carries (``elastune-worker``; the gateway dials pod IPs, which no certificate names),
and real gateway processes: one trusting that CA forwards; one trusting another CA, and one expecting
another name, refuse the worker with a prompt upstream error (not a hang). The worker serves no plain
HTTP on its serving port, and the operator's worker pods mount the certificate and probe over HTTPS."""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tls_certs import CA

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from elastune_bench.processes import ServiceProcess, start_gateway, start_worker  # noqa: E402
from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.api.resources import parse_resource  # noqa: E402
from elastune_contract.api.warmpool import WarmPool  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_gateway.server.upstream import ConnectFailed, UpstreamPool  # noqa: E402
from elastune_operator.k8s import worker_tls  # noqa: E402
from elastune_operator.k8s.workload import WORKER_PORT, worker_deployment  # noqa: E402

MODEL = "tiny-llama"
NAME = "elastune-worker"
SMALL = ("--kv-cache-tokens", "2048", "--max-model-len", "128")
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[CA, CA]:
    root = tmp_path_factory.mktemp("worker-pki")
    return CA(root / "worker-ca", "elastune worker CA"), CA(root / "other-ca", "someone else")


def _wait_https(w: ServiceProcess, redis_url: str, ns: str, ca: CA, timeout: float = 180.0) -> None:
    """Until the worker registered an https:// URL whose /readyz answers over TLS (its chain checked
    against ``ca``; its name, not the loopback address, is what the gateway checks)."""
    context = ssl.create_default_context(cafile=str(ca.ca_file))
    context.check_hostname = False
    bus = Bus(redis_url, ns)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert w.alive(), w.log_tail()
            rec = bus.workers().get(w.name)
            warm = rec is not None and rec.url and rec.serving is not None
            if warm and httpx.get(rec.url + "/readyz", verify=context, timeout=5).status_code == 200:
                w.url = rec.url
                return
            time.sleep(0.2)
        raise AssertionError(f"worker not ready over HTTPS within {timeout:.0f} s:\n{w.log_tail()}")
    finally:
        bus.close()


@pytest.fixture(scope="module")
def worker(
    redis_server: Any, pki: tuple[CA, CA], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceProcess, str]]:
    ca = pki[0]
    leaf = ca.issue("worker", dns=(NAME,))
    logs = tmp_path_factory.mktemp("tls-worker")
    ns = f"tls{time.time_ns()}"
    model = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    tls_env = {"ELASTUNE_WORKER_TLS_CERT_FILE": str(leaf.cert), "ELASTUNE_WORKER_TLS_KEY_FILE": str(leaf.key)}
    with pytest.MonkeyPatch.context() as mp:  # the worker process inherits the environment
        for k, v in tls_env.items():
            mp.setenv(k, v)
        w = start_worker(redis_server.url, ns, "w-tls", model, MODEL, logs, *SMALL, "--drain-seconds", "1",
                         wait=False)  # fmt: skip
    try:
        _wait_https(w, redis_server.url, ns, ca)
        yield w, ns
        assert w.alive(), w.log_tail()
    finally:
        w.stop()


def _gateway(redis_url: str, ns: str, logs: Path, ca: CA, name: str = NAME) -> ServiceProcess:
    args = ("--worker-ca-file", str(ca.ca_file), "--worker-tls-server-name", name, "--hold-timeout", "1")
    return start_gateway(redis_url, ns, logs, *args)


def test_the_worker_serves_https_only(worker: tuple[ServiceProcess, str]) -> None:
    w, _ = worker
    assert w.url.startswith("https://"), w.url
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the serving port gets no answer
        httpx.get(w.url.replace("https://", "http://") + "/readyz", timeout=5)


def test_the_gateway_forwards_to_a_worker_its_ca_signed(
    worker: tuple[ServiceProcess, str], redis_server: Any, pki: tuple[CA, CA], tmp_path: Path
) -> None:
    _, ns = worker
    g = _gateway(redis_server.url, ns, tmp_path, pki[0])
    try:
        r = httpx.post(g.url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] is not None
    finally:
        g.stop()


@pytest.mark.parametrize("wrong", ["ca", "name"])
def test_the_gateway_refuses_a_worker_it_cannot_verify(
    wrong: str, worker: tuple[ServiceProcess, str], redis_server: Any, pki: tuple[CA, CA], tmp_path: Path
) -> None:
    """Another CA's trust, or a name the certificate lacks: an upstream error within seconds, and the
    gateway's log says why."""
    _, ns = worker
    ca, name = (pki[1], NAME) if wrong == "ca" else (pki[0], "elastune-worker.other")
    g = _gateway(redis_server.url, ns, tmp_path, ca, name)
    try:
        started = time.monotonic()
        r = httpx.post(g.url + "/v1/completions", json=BODY, timeout=60)
        took = time.monotonic() - started
        assert r.status_code in (502, 503), r.text
        assert took < 10, f"{took:.1f} s"
        deadline = time.monotonic() + 5
        why = "is not a worker the worker CA vouches for"
        while why not in g.log_tail(20000) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert why in g.log_tail(20000) and "CERTIFICATE_VERIFY_FAILED" in g.log_tail(20000), g.log_tail()
    finally:
        g.stop()


def test_with_worker_tls_a_plain_http_worker_is_refused() -> None:
    """A worker registered at http:// (a pod without its certificate) is never used in the clear."""
    import asyncio

    async def go() -> None:
        pool = UpstreamPool(1.0, 1.0, ssl_context=ssl.create_default_context(), server_hostname=NAME)
        try:
            with pytest.raises(ConnectFailed, match="plain HTTP"):
                await pool.post("http://127.0.0.1:9", "/v1/completions", b"{}")
        finally:
            await pool.close()

    asyncio.run(go())


def test_the_operators_worker_pods_mount_the_certificate_and_probe_over_https(
    monkeypatch: pytest.MonkeyPatch, pki: tuple[CA, CA]
) -> None:
    monkeypatch.setenv(worker_tls.WORKER_TLS_SECRET_ENV, "elastune-worker-tls")
    monkeypatch.setenv("ELASTUNE_REDIS_CA_FILE", str(pki[0].ca_file))
    pool = parse_resource(
        {"apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
         "metadata": {"name": "p", "namespace": "team-a", "uid": "u"},
         "spec": {"model": "m", "worker": {"image": "w:1"}}}
    )  # fmt: skip
    assert isinstance(pool, WarmPool)
    rediss = "rediss://r.elastune-system.svc:6379/0"
    spec = worker_deployment(pool, 1, rediss, None)["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ELASTUNE_WORKER_TLS_CERT_FILE"] == "/var/run/elastune/tls/tls.crt"
    assert env["ELASTUNE_REDIS_CA_FILE"] == "/var/run/elastune/redis-ca/ca.crt"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["serving-tls"]["secret"] == {"secretName": "elastune-worker-tls"}  # not optional
    assert volumes["redis-ca"]["secret"]["secretName"] == worker_tls.REDIS_CA_SECRET
    probes = [container[p]["httpGet"] for p in ("readinessProbe", "livenessProbe") if p in container]
    assert probes and all(p["scheme"] == "HTTPS" for p in probes if p["port"] == WORKER_PORT)
    # Off: nothing of it (a plain redis:// URL mounts no CA either).
    monkeypatch.delenv(worker_tls.WORKER_TLS_SECRET_ENV)
    spec = worker_deployment(pool, 1, "redis://r:6379/0", None)["spec"]["template"]["spec"]
    assert not {"serving-tls", "redis-ca"} & {v["name"] for v in spec.get("volumes", [])}
    assert os.environ.get(worker_tls.WORKER_TLS_SECRET_ENV) is None
