"""Who can reach a worker pod, and with what (issue 25 item 4, docs/design.md §6 Tenancy): the WarmPool's
pods take no Service traffic, mount no ServiceAccount token and do mount the worker control
token (a Secret the operator writes per namespace, distinct from the Redis credential), and a
NetworkPolicy lets only the release's gateway and operator and Prometheus in:
rendered by the chart per watched namespace, or written by the operator into each WarmPool namespace when
it watches all of them. The pod world cannot enforce a NetworkPolicy: these check the rendered objects."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from chart_render import COMBINATIONS, NAMESPACE, RELEASE, named, of_kind, render
from elastune_contract.api.resources import parse_resource
from elastune_operator.k8s.settings import OperatorSettings, SettingsError
from elastune_operator.k8s.workload import (
    WORKER_CONTROL_DIR,
    WORKER_CONTROL_SECRET,
    WorkloadBackend,
    worker_deployment,
)

REPO = Path(__file__).resolve().parents[2]


def pool_doc(namespace: str = "team-a") -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    doc["metadata"].update(namespace=namespace, uid="u-1")
    return doc


def test_the_pool_pods_hold_no_api_token_and_take_no_service_traffic() -> None:
    doc = pool_doc()
    # A pool's author cannot point the worker at another token file through spec.worker.env.
    doc["spec"]["worker"]["env"] = [{"name": "ELASTUNE_CONTROL_TOKEN_FILE", "value": "/tmp/mine"}]
    svc = worker_deployment(parse_resource(doc), 1, "redis://r:6379/0", "elastune-redis")
    assert svc["kind"] == "Deployment"  # no Service fronts the workers: the gateway goes pod-direct
    template = svc["spec"]["template"]
    pod = template["spec"]
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    env = [e for e in container["env"] if e["name"] == "ELASTUNE_CONTROL_TOKEN_FILE"]
    assert env == [{"name": "ELASTUNE_CONTROL_TOKEN_FILE", "value": f"{WORKER_CONTROL_DIR}/token"}]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == WORKER_CONTROL_DIR]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == WORKER_CONTROL_SECRET
    # The Redis credential is a different Secret from the control token.
    redis = [e for e in container["env"] if e["name"] == "ELASTUNE_REDIS_PASSWORD"]
    assert redis[0]["valueFrom"]["secretKeyRef"]["name"] != WORKER_CONTROL_SECRET


def test_the_operator_writes_a_control_token_per_namespace_and_keeps_it(tmp_path: Path) -> None:
    pytest.importorskip("kmock")
    from kubernetes import client, config

    from elastune_testing.emulator import start_emulator

    emu = start_emulator(tmp_path / "emulator")
    try:
        api = config.new_client_from_config(config_file=str(emu.kubeconfig_path))
        core = client.CoreV1Api(api)

        def token(ns: str) -> str:
            return base64.b64decode(
                core.read_namespaced_secret(WORKER_CONTROL_SECRET, ns).data["token"]
            ).decode()

        WorkloadBackend(api, "redis://r:6379/0", "elastune-redis", redis_password="pw").register(
            parse_resource(pool_doc("team-a")), 0
        )
        first = token("team-a")
        assert len(first) >= 32 and first != "pw"
        # Another operator run (a restart) keeps the token the running pods have.
        WorkloadBackend(api, "redis://r:6379/0", "elastune-redis").register(
            parse_resource(pool_doc("team-a")), 0
        )
        assert token("team-a") == first
        # Another namespace, another token: one tenant's token opens no other tenant's workers.
        WorkloadBackend(api, "redis://r:6379/0", None).register(parse_resource(pool_doc("team-b")), 0)
        assert token("team-b") != first
    finally:
        emu.stop()


class _FakeNetworking:
    def __init__(self, exists: bool = False) -> None:
        self.exists = exists
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def create_namespaced_network_policy(self, ns: str, body: dict[str, Any]) -> None:
        from kubernetes.client.rest import ApiException

        self.calls.append(("create", ns, body))
        if self.exists:
            raise ApiException(status=409)

    def patch_namespaced_network_policy(self, name: str, ns: str, body: dict[str, Any]) -> None:
        self.calls.append(("patch", f"{ns}/{name}", body))


def _operator_policy(docs: tuple[dict[str, Any], ...]) -> dict[str, Any] | None:
    deploy = named(docs, "Deployment", f"{RELEASE}-operator")
    env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    raw = env.get("ELASTUNE_WORKER_NETWORK_POLICY")
    return None if raw is None else json.loads(raw["value"])


def _pod_labels(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, str]:
    return named(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] in ("In", "Exists"), e
        ok = ok and (e["key"] in labels if e["operator"] == "Exists" else labels.get(e["key"]) in e["values"])
    return ok


def _check_ingress(ingress: list[dict[str, Any]], docs: tuple[dict[str, Any], ...]) -> None:
    """Exactly: the release's gateway and operator pods to the serving port, Prometheus to the metrics
    port only (no Knative namespace: none needed)."""
    peers = [peer for rule in ingress for peer in rule["from"]]
    assert [rule["ports"] for rule in ingress] == [
        [{"port": "http", "protocol": "TCP"}], [{"port": "metrics", "protocol": "TCP"}]
    ]  # fmt: skip
    assert len(peers) == 2, peers
    release, prometheus = peers
    assert release["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    for pod in (f"{RELEASE}-gateway", f"{RELEASE}-operator"):
        assert _selects(release["podSelector"], _pod_labels(docs, pod)), pod
    redis = _pod_labels(docs, f"{RELEASE}-redis")
    assert not _selects(release["podSelector"], redis)  # Redis (or anything else in the namespace): no
    assert prometheus["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    assert "ipBlock" not in json.dumps(ingress)


def test_namespaced_chart_renders_a_worker_network_policy_per_watched_namespace() -> None:
    docs = render(*COMBINATIONS["namespaced"])
    policies = [p for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "elastune-workers"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    for policy in policies:
        spec = policy["spec"]
        assert spec["podSelector"] == {
            "matchExpressions": [{"key": "elastune.dev/warmpool", "operator": "Exists"}]
        }
        assert spec["policyTypes"] == ["Ingress"]
        _check_ingress(spec["ingress"], docs)
    assert _operator_policy(docs) is None  # the chart owns them here
    rules = named(docs, "ClusterRole", f"{RELEASE}-operator")["rules"]
    assert not [r for r in rules if "networkpolicies" in r["resources"]]


def test_cluster_wide_the_operator_writes_the_same_policy_into_each_pool_namespace() -> None:
    docs = render()
    # Only the gateway's own (its metrics port: tests/security/test_tenant_visibility_chart.py).
    assert [p["metadata"]["name"] for p in of_kind(docs, "NetworkPolicy")] == [f"{RELEASE}-gateway"]
    policy = _operator_policy(docs)
    assert policy is not None and policy["name"] == "elastune-workers"
    _check_ingress(policy["ingress"], docs)
    rules = named(docs, "ClusterRole", f"{RELEASE}-operator")["rules"]
    assert [r for r in rules if "networkpolicies" in r["resources"]] == [
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create"]},
        {
            "apiGroups": ["networking.k8s.io"],
            "resources": ["networkpolicies"],
            "resourceNames": ["elastune-workers"],
            "verbs": ["get", "patch"],
        },
    ]
    # The operator reads it from its settings and writes it on a pool's first registration.
    env = {e["name"]: e.get("value", "") for e in named(docs, "Deployment", f"{RELEASE}-operator")["spec"]
           ["template"]["spec"]["containers"][0]["env"]}  # fmt: skip
    settings = OperatorSettings.from_env({"ELASTUNE_REDIS_URL": "redis://r:6379/0", **env})
    assert settings.worker_network_policy is not None
    backend = WorkloadBackend.__new__(WorkloadBackend)
    backend.network_policy, backend._policy_in = json.loads(settings.worker_network_policy), set()
    backend.networking = fake = _FakeNetworking()  # type: ignore[assignment]
    backend.write_network_policy("team-a")
    backend.write_network_policy("team-a")  # once per namespace per run
    ((verb, ns, body),) = fake.calls
    assert (verb, ns, body["metadata"]["name"]) == ("create", "team-a", "elastune-workers")
    assert body["spec"]["ingress"] == policy["ingress"]
    assert body["spec"]["podSelector"]["matchExpressions"][0]["key"] == "elastune.dev/warmpool"
    backend.networking = fake = _FakeNetworking(exists=True)  # type: ignore[assignment]
    backend.write_network_policy("team-b")
    assert [c[0] for c in fake.calls] == ["create", "patch"]  # brought up to date


def test_network_policy_can_be_turned_off_and_bad_settings_are_refused() -> None:
    docs = render("networkPolicy.enabled=false", "operator.watchNamespaces={team-a}")
    assert not of_kind(docs, "NetworkPolicy")
    assert _operator_policy(render("networkPolicy.enabled=false")) is None
    with pytest.raises(SettingsError, match="ELASTUNE_WORKER_NETWORK_POLICY"):
        OperatorSettings.from_env({"ELASTUNE_REDIS_URL": "redis://r", "ELASTUNE_WORKER_NETWORK_POLICY": "[]"})
