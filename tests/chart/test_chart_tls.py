"""The chart's TLS options (issue 39 item 6; docs/operations/tls.md): redis.tls (rediss:// with a CA from
a Secret; the bundled Redis serving TLS only) and gateway.workerTLS (HTTPS from the gateway to the
workers). Rendered offline; the bundled Redis's rendered flags are run on the real redis-server with
certificates the test makes, and every mount a flag or variable names is a volume of that Secret."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis

from chart_render import CUSTOM_GROUPS, KUBE_VERSION, RELEASE, helm, named, render, template_args
from elastune_common.servers import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
from tls_certs import CA

REDIS_TLS = ("redis.tls.enabled=true", "redis.tls.caSecret=redis-ca", "redis.tls.certSecret=redis-tls")
OPERATOR = f"{RELEASE}-operator"
WORKER_TLS = ("gateway.workerTLS.enabled=true", "gateway.workerTLS.caSecret=worker-ca")
EXTERNAL = (
    "redis.bundled.enabled=false", "redis.url=rediss://redis.data.svc:6380/0",
    "redis.auth.existingSecret=managed-redis", "redis.tls.enabled=true", "redis.tls.caSecret=managed-ca",
    "redis.tls.clientCertSecret=elastune-redis-client",
)  # fmt: skip


def pod(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    spec: dict[str, Any] = named(docs, "Deployment", name)["spec"]["template"]["spec"]
    return spec


def env(spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in spec["containers"][0].get("env", [])}


def secret_behind(spec: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file ``path`` in the first container: its mount's volume's Secret."""
    for m in spec["containers"][0].get("volumeMounts", []):
        if path.startswith(m["mountPath"] + "/"):
            volume = next(v for v in spec["volumes"] if v["name"] == m["name"])
            return volume["secret"]["secretName"], path[len(m["mountPath"]) + 1 :]
    raise AssertionError(f"{path} is on no mount")


def test_off_by_default_nothing_changes() -> None:
    docs = render()
    for name in (OPERATOR, f"{RELEASE}-gateway"):
        spec = pod(docs, name)
        assert not {"ELASTUNE_REDIS_CA_FILE", "ELASTUNE_WORKER_TLS_SECRET"} & set(env(spec))
        assert "--worker-ca-file" not in " ".join(spec["containers"][0].get("args", []))
    assert env(pod(docs, OPERATOR))["ELASTUNE_REDIS_URL"].startswith("redis://")
    assert "--port 6379" in pod(docs, f"{RELEASE}-redis")["containers"][0]["args"][0]


@pytest.mark.parametrize("sets", [(*REDIS_TLS, *WORKER_TLS), EXTERNAL], ids=["bundled", "external"])
def test_tls_renderings_validate_against_the_kubernetes_schemas(sets: tuple[str, ...]) -> None:
    for doc in render(*sets):
        if not doc["apiVersion"].startswith(CUSTOM_GROUPS):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_redis_clients_get_rediss_and_the_ca_from_its_secret() -> None:
    docs = render(*REDIS_TLS)
    operator, gateway = pod(docs, OPERATOR), pod(docs, f"{RELEASE}-gateway")
    url = f"rediss://{RELEASE}-redis.elastune-system.svc:6379/0"
    assert env(operator)["ELASTUNE_REDIS_URL"] == url
    assert f"--redis-url={url}" in gateway["containers"][0]["args"]
    for spec in (operator, gateway):
        assert secret_behind(spec, env(spec)["ELASTUNE_REDIS_CA_FILE"]) == ("redis-ca", "ca.crt")


def test_external_redis_with_a_client_certificate() -> None:
    docs = render(*EXTERNAL)
    for spec in (pod(docs, OPERATOR), pod(docs, f"{RELEASE}-gateway")):
        e = env(spec)
        assert secret_behind(spec, e["ELASTUNE_REDIS_CA_FILE"]) == ("managed-ca", "ca.crt")
        assert secret_behind(spec, e["ELASTUNE_REDIS_CERT_FILE"]) == ("elastune-redis-client", "tls.crt")
        assert secret_behind(spec, e["ELASTUNE_REDIS_KEY_FILE"]) == ("elastune-redis-client", "tls.key")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("redis.tls.enabled=true", "redis.tls.certSecret=x"), "redis.tls.caSecret"),
        (("redis.tls.enabled=true", "redis.tls.caSecret=x"), "redis.tls.certSecret"),
        (("redis.bundled.enabled=false", "redis.url=redis://r:6379/0", "redis.tls.enabled=true",
          "redis.tls.caSecret=x"), "rediss://"),
        (("redis.url=rediss://r:6379/0", "redis.bundled.enabled=false", "redis.tls.enabled=true",
          "redis.tls.caSecret=x", "redis.tls.caSecret=Bad_Name"), "caSecret"),
        (("gateway.workerTLS.enabled=true",), "gateway.workerTLS.caSecret"),
    ],
    ids=["no-ca", "bundled-no-cert", "external-not-rediss", "bad-secret-name", "worker-no-ca"],
)  # fmt: skip
def test_incomplete_tls_values_are_refused_with_a_message(sets: tuple[str, ...], message: str) -> None:
    result = helm(*template_args(sets))
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_the_bundled_redis_flags_serve_tls_only_on_the_real_redis(tmp_path: Path) -> None:
    """The rendered `redis-server` flags, their paths mapped onto certificates made here, on the real
    redis-server: TLS on the Service's port, no plain port, and the readiness probe's redis-cli answers."""
    spec = pod(render(*REDIS_TLS), f"{RELEASE}-redis")
    script = spec["containers"][0]["args"][0]
    line = next(ln for ln in script.splitlines() if "exec redis-server" in ln)
    flags = shlex.split(line.split("/tmp/redis.conf", 1)[1])
    ca = CA(tmp_path / "ca", "redis CA")
    leaf = ca.issue("redis", dns=(f"{RELEASE}-redis.elastune-system.svc", "localhost"))
    files = {("redis-tls", "tls.crt"): leaf.cert, ("redis-tls", "tls.key"): leaf.key,
             ("redis-ca", "ca.crt"): ca.ca_file}  # fmt: skip
    port = free_port()
    argv = []
    for flag in flags:
        if flag.startswith("/var/run/"):
            flag = str(files[secret_behind(spec, flag)])
        argv.append({"6379": str(port), "/data": str(tmp_path)}.get(flag, flag))
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--tls-port") + 1] == str(port)
    proc = subprocess.Popen(["redis-server", *argv, "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="localhost", port=port, ssl=True, ssl_ca_certs=str(ca.ca_file))
        probe = spec["containers"][0]["readinessProbe"]["exec"]["command"][2]
        command = probe.split("$(", 1)[1].split(")", 1)[0]
        cli = shlex.split(command.replace("/var/run/elastune/redis-ca/ca.crt", str(ca.ca_file)))
        cli = [a if a != "6379" else str(port) for a in cli if a not in ("--user", "elastune-gateway")]
        for _ in range(100):
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                subprocess.run(["sleep", "0.05"], check=True)
        else:
            pytest.fail("the TLS Redis never answered")
        out = subprocess.run(cli, capture_output=True, text=True, timeout=10)
        assert "NOAUTH" in out.stdout or out.stdout.strip() == "PONG", out  # TLS talked; no password here
    finally:
        proc.kill()
        proc.wait()


def test_worker_tls_reaches_the_gateway_and_the_operator() -> None:
    docs = render(*WORKER_TLS, "gateway.workerTLS.serverName=workers.example")
    gateway = pod(docs, f"{RELEASE}-gateway")
    args = gateway["containers"][0]["args"]
    ca_file = next(a.split("=", 1)[1] for a in args if a.startswith("--worker-ca-file="))
    assert secret_behind(gateway, ca_file) == ("worker-ca", "ca.crt")
    assert "--worker-tls-server-name=workers.example" in args
    # The operator mounts the serving certificate Secret of this name into each pool's worker pods.
    assert env(pod(docs, OPERATOR))["ELASTUNE_WORKER_TLS_SECRET"] == "elastune-worker-tls"
