"""Pods talk to the API as their service account, and the chart's RBAC decides (the API emulator enforces
it in the pod world): the operator pod's token is one the emulator issued for the chart's operator
account, good for what the chart grants and refused (403) for the rest; the gateway and Redis pods get no
token at all (the chart turns the mount off)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from conftest import RELEASE_NAMESPACE, TENANT
from elastune_testing.podworld import PodWorld


def _token_of(world: PodWorld, component: str) -> Path:
    pods = world.wait_ready(RELEASE_NAMESPACE, f"app.kubernetes.io/component={component}")
    return world.kubelet.root / "pods" / pods[0]["metadata"]["uid"] / "serviceaccount" / "token"


def _call(world: PodWorld, token: str, method: str, path: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        world.emulator.url + path, method=method, headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read().splitlines()[0])
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_operator_pod_acts_as_its_service_account_under_the_charts_rbac(world: PodWorld):
    assert world.emulator.emulator is not None and world.emulator.emulator.enforce_rbac
    token = _token_of(world, "operator").read_text()
    assert _call(world, token, "GET", f"/api/v1/namespaces/{TENANT}/pods")[0] == 200
    assert _call(world, token, "GET", "/apis/elastune.dev/v1alpha1/warmpools")[0] == 200
    status, body = _call(world, token, "DELETE", f"/api/v1/namespaces/{TENANT}/pods")
    assert (status, body["reason"]) == (403, "Forbidden")
    assert body["message"] == (
        f'pods is forbidden: User "system:serviceaccount:{RELEASE_NAMESPACE}:elastune" cannot '
        f'deletecollection resource "pods" in API group "" in the namespace "{TENANT}"'
    )
    # Whatever the operator did so far, the chart granted it.
    assert [
        d for d in world.emulator.emulator.denials if ':elastune"' in d and "deletecollection" not in d
    ] == []


def test_gateway_and_redis_pods_carry_no_token(world: PodWorld):
    for component in ("gateway", "redis"):
        assert not _token_of(world, component).exists()
