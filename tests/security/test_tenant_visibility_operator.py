"""The operator sees only API key Secrets, and only in the namespaces it serves (issue 39 item 5).

A real kopf operator runs the operator's own Secret handler (``handlers.secret_event``) with the
operator's own watch settings (``handlers.watch_only_api_key_secrets``), as the chart's ServiceAccount
(a token from a TokenRequest), against the API emulator enforcing the Roles `helm template` renders with
``operator.watchNamespaces``. kopf's ``labels=`` on a handler would filter in the operator after every
Secret had been sent to it; ``settings.watching.label_selectors`` puts ``labelSelector`` on the list and
watch requests themselves (kopf ``_cogs/clients/watching.py``), and the emulator filters server-side, a
label removed turning into DELETED as the apiserver's watch cache does.

Kubernetes RBAC cannot select by label (a rule matches verbs, API groups, resources and resourceNames:
plugin/pkg/auth/authorizer/rbac/rbac.go RuleAllows, followed by elastune_testing.apiserver.rbac), and a
list or watch has no name for resourceNames to match. What the chart narrows instead, and this test
shows: list/watch of Secrets only where a RoleBinding grants it (the watched namespaces), no get of any
Secret but the worker Redis Secret's name, no update or delete of Secrets.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest

from elastune_operator.k8s import handlers
from elastune_testing.emulator import EmulatorHandle, start_emulator
from rbac_client import RELEASE_NS, Api, _forbidden, _install

WATCHED, OTHER = "team-a", "team-b"


def _secret(name: str, labelled: bool) -> dict[str, Any]:
    labels = {"elastune.dev/api-key": "true"} if labelled else {"app": "db"}
    data = {"key": base64.b64encode(f"sk-{name}".encode()).decode()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "labels": labels}, "data": data}


class Keys:
    """What ``secret_event`` hands the ApiKeyPublisher: the Secrets it saw, those it was told are gone."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.deleted: list[str] = []

    def seen_doc(self, doc: dict[str, Any]) -> None:
        self.seen.append(f"{doc['metadata']['namespace']}/{doc['metadata']['name']}")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmulatorHandle]:
    with start_emulator(tmp_path, enforce_rbac=True, max_request_log=None) as handle:
        _install(handle, f"operator.watchNamespaces={{{WATCHED}}}")
        admin = Api(handle)
        for ns in (WATCHED, OTHER):
            for name, labelled in (("key", True), ("db-password", False)):
                assert (
                    admin.call("POST", f"/api/v1/namespaces/{ns}/secrets", _secret(name, labelled))[0] == 201
                )
        yield handle


def _run_operator(url: str, token: str, keys: Keys, stop: threading.Event) -> threading.Thread:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, token=token, scheme="Bearer")

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        handlers.watch_only_api_key_secrets(settings)
        settings.watching.server_timeout = 5  # a stopped operator is not held by a long watch

    kopf.on.event("v1", "secrets", registry=registry)(handlers.secret_event)
    publisher = type("Publisher", (), {"seen": staticmethod(keys.seen_doc),
                                       "deleted": staticmethod(keys.deleted.append)})()  # fmt: skip
    memo = kopf.Memo({handlers.MEMO_API_KEYS: publisher})

    def run() -> None:
        asyncio.run(kopf.operator(registry=registry, memo=memo, namespaces=[WATCHED], clusterwide=False,
                                  standalone=True, stop_flag=stop))  # fmt: skip

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until(check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert check()


def _asked(cluster: EmulatorHandle, token: str) -> list[Any]:
    """What the operator asked about Secrets (its token; the admin's writes carry none)."""
    assert cluster.emulator is not None
    return [
        r for r in cluster.emulator
        if r.resource is not None and r.resource.plural == "secrets"
        and r.headers.get("Authorization") == f"Bearer {token}"
    ]  # fmt: skip


def test_the_operator_lists_and_watches_only_labelled_secrets_of_its_namespaces(cluster: EmulatorHandle):
    admin = Api(cluster)
    token = admin.token_for(RELEASE_NS, "elastune")
    keys, stop = Keys(), threading.Event()
    thread = _run_operator(cluster.url, token, keys, stop)
    try:
        _until(lambda: keys.seen)
        asked = _asked(cluster, token)  # the list, then the watch: both with the selector
        assert [r.params.get("labelSelector") for r in asked] == ["elastune.dev/api-key=true"] * len(asked), [
            str(r.url) for r in asked
        ]
        # The label leaves the Secret: it leaves the selection, which the watch reports as DELETED.
        patch = {"metadata": {"labels": {"elastune.dev/api-key": None}}}
        path = f"/api/v1/namespaces/{WATCHED}/secrets/key"
        assert admin.call("PATCH", path, patch, "application/merge-patch+json")[0] == 200
        _until(lambda: keys.deleted)
        # A Secret of another namespace, labelled, after the start: never seen either.
        assert admin.call("POST", f"/api/v1/namespaces/{OTHER}/secrets", _secret("late", True))[0] == 201
        assert admin.call("POST", f"/api/v1/namespaces/{WATCHED}/secrets", _secret("late", True))[0] == 201
        _until(lambda: f"{WATCHED}/late" in keys.seen)
    finally:
        stop.set()
        thread.join(30)
    assert keys.seen == [f"{WATCHED}/key", f"{WATCHED}/late"] and keys.deleted == [f"{WATCHED}/key"]
    asked = _asked(cluster, token)
    assert any(r.params.get("watch") == "true" for r in asked) and all(r.namespace == WATCHED for r in asked)
    assert all(r.params.get("labelSelector") == "elastune.dev/api-key=true" for r in asked)
    assert cluster.emulator is not None
    assert not [d for d in cluster.emulator.denials if "secrets" in d], cluster.emulator.denials


def test_the_operator_account_cannot_read_secrets_beyond_what_it_needs(cluster: EmulatorHandle):
    admin = Api(cluster)
    operator = Api(cluster, admin.token_for(RELEASE_NS, "elastune"))
    selector = "?labelSelector=elastune.dev%2Fapi-key%3Dtrue"
    status, listed = operator.call("GET", f"/api/v1/namespaces/{WATCHED}/secrets{selector}")
    assert status == 200 and [s["metadata"]["name"] for s in listed["items"]] == ["key"]
    # Unlabelled Secrets of a watched namespace: RBAC cannot refuse a list without the selector (no rule
    # matches labels), but no Secret can be read by name, updated or deleted.
    _forbidden(operator.call("GET", f"/api/v1/namespaces/{WATCHED}/secrets/db-password"))
    _forbidden(operator.call("PUT", f"/api/v1/namespaces/{WATCHED}/secrets/db-password", {}))
    _forbidden(operator.call("DELETE", f"/api/v1/namespaces/{WATCHED}/secrets/db-password"))
    # Namespaces it does not watch: nothing, with or without the selector, nor across all namespaces.
    _forbidden(operator.call("GET", f"/api/v1/namespaces/{OTHER}/secrets{selector}"))
    _forbidden(operator.call("GET", f"/api/v1/namespaces/{OTHER}/secrets?watch=true"))
    _forbidden(operator.call("GET", f"/api/v1/secrets{selector}"))
    _forbidden(operator.call("POST", f"/api/v1/namespaces/{OTHER}/secrets", _secret("x", False)))
    # Its pods and WarmPools there too.
    _forbidden(operator.call("GET", f"/api/v1/namespaces/{OTHER}/pods"))
