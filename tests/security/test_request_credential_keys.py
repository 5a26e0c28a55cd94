"""Where the request credential's keys come from (issue 39 item 3): the chart gives the gateway and the
operator one secret (operator-keys, ``request-key``); the operator writes into each pool namespace only
that namespace's derived key and mounts it into the pool's worker pods; a namespace's key verifies no
credential for another namespace. Rendered with the real helm binary; the operator's Secret through the
real kubernetes client's call."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from chart_render import RELEASE, named, render
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.request_credential import (
    KEY_FILE_ENV,
    REQUEST_KEY_SECRET,
    CredentialError,
    namespace_key,
    sign,
    verify,
)
from elastune_operator.k8s import request_key
from elastune_operator.k8s.workload import worker_deployment

KEYS = f"{RELEASE}-operator-keys"


def _env(docs: tuple[dict[str, Any], ...], deployment: str) -> dict[str, Any]:
    container = named(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in container.get("env", [])}


def test_the_chart_gives_the_gateway_and_operator_the_request_secret() -> None:
    docs = render()
    data = named(docs, "Secret", KEYS)["data"]
    assert len(base64.b64decode(data["request-key"])) == 48
    for deployment in (f"{RELEASE}-gateway", f"{RELEASE}-operator"):
        ref = _env(docs, deployment)["ELASTUNE_REQUEST_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": KEYS, "key": "request-key"}, deployment
    gateway = named(docs, "Deployment", f"{RELEASE}-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "--request-credential-ttl=30" in gateway["args"]

    off = render("gateway.requestCredential.enabled=false")
    assert "request-key" not in named(off, "Secret", KEYS)["data"]
    for deployment in (f"{RELEASE}-gateway", f"{RELEASE}-operator"):
        assert "ELASTUNE_REQUEST_KEY" not in _env(off, deployment), deployment


class _Core:
    """Records the Secrets the operator creates (the kubernetes client's CoreV1Api call)."""

    def __init__(self) -> None:
        self.created: list[tuple[str, dict[str, Any]]] = []

    def create_namespaced_secret(self, ns: str, body: dict[str, Any]) -> None:
        self.created.append((ns, body))


def test_each_namespace_gets_only_its_derived_key() -> None:
    secret = b"s" * 48
    core = _Core()
    for ns in ("team-a", "team-b"):
        request_key.write_secret(core, ns, secret)  # type: ignore[arg-type]
    keys = {}
    for ns, body in core.created:
        assert body["metadata"]["name"] == REQUEST_KEY_SECRET and body["metadata"]["namespace"] == ns
        keys[ns] = base64.b64decode(body["data"]["key"])
        assert secret not in keys[ns]
    assert keys["team-a"] == namespace_key(secret, "team-a") != keys["team-b"]
    signed = sign(secret, "team-b", "base", adapter=False, key_id="k")
    assert verify(signed, keys["team-b"], "team-b").namespace == "team-b"
    with pytest.raises(CredentialError) as refused:  # team-a's workers: not team-b's credential
        verify(signed, keys["team-a"], "team-a")
    assert refused.value.status == 401


def test_the_pool_pods_mount_their_namespace_s_key() -> None:
    pool = WarmPool.model_validate(
        {"apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
         "metadata": {"name": "tiny", "namespace": "team-a"}, "spec": {"model": "elastune/tiny-llama"}}
    )  # fmt: skip
    spec = worker_deployment(pool, 1, "redis://r:6379/0", None)["spec"]["template"]["spec"]
    request_key.add_to_pod(spec)
    (volume,) = [v for v in spec["volumes"] if v["name"] == request_key.VOLUME]
    assert volume["secret"]["secretName"] == REQUEST_KEY_SECRET and "optional" not in volume["secret"]
    worker = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    (mount,) = [m for m in worker["volumeMounts"] if m["name"] == request_key.VOLUME]
    assert env[KEY_FILE_ENV] == f"{mount['mountPath']}/key" and mount["readOnly"]
