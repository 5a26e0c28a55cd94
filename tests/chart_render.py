"""Rendering the Helm chart offline for tests in several folders (tests/chart, tests/security): helm from
tools/k8s_binaries.py, `helm template` with value sets, and lookups in what it renders."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "elastune"
RELEASE, NAMESPACE = "elastune", "elastune-system"
# Oldest Kubernetes the chart targets that kubernetes-validate ships schemas for (Chart.yaml: >=1.29).
KUBE_VERSION = "1.33.0"
# Kinds no built-in schema covers: checked against CRDs or structurally below.
CUSTOM_GROUPS = ("elastune.dev/", "kopf.dev/", "monitoring.coreos.com/")
RESYNC = "regenerate both: elastune crds --write crds/ && elastune crds --write helm/elastune/crds/"


def _load_tool(name: str) -> ModuleType:
    # tools/ is not a package on sys.path: load the module from its file.
    spec = importlib.util.spec_from_file_location(f"elastune_tools_{name}", REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


k8s_binaries = _load_tool("k8s_binaries")


@functools.cache
def helm_binary() -> str:
    try:
        return str(k8s_binaries.find_binary("helm"))
    except k8s_binaries.BinaryNotFound as exc:
        pytest.fail(f"no helm binary: {exc}")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, check=False, cwd=REPO)


def value_args(sets: tuple[str, ...]) -> list[str]:
    args = []
    for item in sets:
        # "@path" is a values file (relative to the repository), anything else a --set.
        args += ["--values", str(REPO / item[1:])] if item.startswith("@") else ["--set", item]
    return args


def template_args(sets: tuple[str, ...]) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds"]
    return [*args, "--kube-version", KUBE_VERSION, *value_args(sets)]


@functools.cache
def render(*sets: str) -> tuple[dict[str, Any], ...]:
    result = helm(*template_args(sets))
    assert result.returncode == 0, result.stderr
    docs = tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)
    assert docs, "helm template rendered nothing"
    return docs


EXTERNAL_REDIS = (
    "redis.bundled.enabled=false",
    "redis.url=redis://redis.data.svc:6379/0",
    "redis.auth.existingSecret=managed-redis",
)
# Value combinations every check below runs on.
COMBINATIONS = {
    "defaults": (),
    "external-redis": EXTERNAL_REDIS,
    "external-redis-no-auth": (*EXTERNAL_REDIS[:2], "redis.auth.enabled=false"),
    "monitoring": ("metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true"),
    "example-warmpool": ("examples.warmPool.enabled=true",),
    "namespaced": ("operator.watchNamespaces={team-a,team-b}", "metrics.podMonitor.enabled=true"),
    "standalone": ("operator.peering.enabled=false", "dashboards.enabled=false", "gateway.enabled=false"),
    "kind-e2e": ("@e2e/values-kind.yaml",),
    "platform-uids": (
        "operator.runAsUser=null",
        "operator.runAsGroup=null",
        "redis.bundled.runAsUser=null",
        "gateway.runAsUser=null",
        "gateway.runAsGroup=null",
    ),
    "gateway-options": (
        "gateway.replicas=2",
        "gateway.routing.policy=rankAware",
        "gateway.routing.poolPolicies.tiny-gpt2=combined",
        "gateway.routing.poolPolicies.team-a/tiny-gpt2=leastLoad",
        "gateway.holdTimeoutSeconds=90",
        "gateway.maxWaiting=64",
        "gateway.lengthPredictor.enabled=true",
        "gateway.lengthPredictor.url=http://ssjf.elastune-system.svc:8080",
        "gateway.image.repository=registry.example/elastune-gateway",
        "gateway.service.port=80",
        "gateway.port=8080",
    ),
}
combination = pytest.mark.parametrize("sets", list(COMBINATIONS.values()), ids=list(COMBINATIONS))


def of_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc
