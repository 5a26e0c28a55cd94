"""A client of the RBAC-enforcing API emulator for tests in several folders (tests/testing, tests/security):
the chart's service accounts and roles applied as the pod world applies them, and calls as an account."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kubernetes import config

from elastune_testing.emulator import EmulatorHandle
from elastune_testing.podworld.helm import template
from elastune_testing.podworld.world import apply_object

RELEASE_NS = "elastune-system"
TENANT = "team-a"
OPERATOR = f"system:serviceaccount:{RELEASE_NS}:elastune"
WP = "/apis/elastune.dev/v1alpha1"


class Api:
    """Raw HTTP against the emulator, as one identity (a bearer token, or none: the admin)."""

    def __init__(self, handle: EmulatorHandle, token: str | None = None) -> None:
        self.url, self.token = handle.url, token

    def call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        headers = {"Content-Type": content_type}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                lines = response.read().splitlines() or [b"null"]
                return response.status, json.loads(lines[0])  # a watch: its first event
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def token_for(self, namespace: str, account: str) -> str:
        status, body = self.call(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", {}
        )
        assert status == 201, body
        assert body["kind"] == "TokenRequest" and body["spec"]["audiences"]
        return str(body["status"]["token"])


def _install(handle: EmulatorHandle, *sets: str) -> list[dict[str, Any]]:
    docs = template("elastune", RELEASE_NS, *sets)
    api = config.new_client_from_config(str(handle.kubeconfig_path))
    try:
        for doc in docs:
            if doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
                apply_object(api, doc, RELEASE_NS)
    finally:
        api.close()
    return docs


def _forbidden(answer: tuple[int, Any]) -> dict[str, Any]:
    status, body = answer
    assert status == 403, body
    assert (body["kind"], body["reason"], body["code"]) == ("Status", "Forbidden", 403)
    return body
