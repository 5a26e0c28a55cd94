"""The API emulator authenticates service-account tokens and authorizes with the chart's RBAC, as a cluster.

The Roles, ClusterRoles and bindings are the ones `helm template helm/elastune` renders, applied to the
emulator as the pod world applies them; each service account gets its token from a TokenRequest (what
the kubelet projects into a pod) and then talks plain HTTP to the emulator. Rules followed:
kubernetes/kubernetes plugin/pkg/auth/authorizer/rbac/rbac.go, pkg/apis/rbac/v1/evaluation_helpers.go,
staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go (see elastune_testing.apiserver.rbac).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastune_testing.apiserver import rbac
from elastune_testing.apiserver.authn import User
from elastune_testing.emulator import EmulatorHandle, start_emulator
from elastune_testing.podworld.helm import template
from rbac_client import OPERATOR, RELEASE_NS, TENANT, WP, Api, _forbidden, _install


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmulatorHandle]:
    with start_emulator(tmp_path, enforce_rbac=True) as handle:
        _install(handle)
        admin = Api(handle)
        for ns in (TENANT, "team-b"):
            warm_pool = {"apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool", "metadata": {"name": "p"}}
            warm_pool["spec"] = {"model": "tiny-gpt2", "minWarmGPUs": 0, "maxWarmGPUs": 1}
            assert admin.call("POST", f"{WP}/namespaces/{ns}/warmpools", warm_pool)[0] == 201
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w"}}
            pod["spec"] = {"containers": [{"name": "c", "image": "x"}]}
            assert admin.call("POST", f"/api/v1/namespaces/{ns}/pods", pod)[0] == 201
        yield handle


def test_operator_account_gets_what_the_chart_grants_and_403_for_the_rest(cluster: EmulatorHandle):
    admin = Api(cluster)
    operator = Api(cluster, admin.token_for(RELEASE_NS, "elastune"))
    # Granted by the chart's ClusterRole (bound cluster-wide by its ClusterRoleBinding).
    assert operator.call("GET", f"{WP}/warmpools")[0] == 200  # list across namespaces
    assert operator.call("GET", f"{WP}/warmpools?watch=true&timeoutSeconds=1")[0] == 200
    patch = {"metadata": {"annotations": {"a": "b"}}}
    assert (
        operator.call(
            "PATCH", f"{WP}/namespaces/{TENANT}/warmpools/p", patch, "application/merge-patch+json"
        )[0]
        == 200
    )
    status = {"status": {"warmGPUs": 0}}
    assert (
        operator.call(
            "PATCH", f"{WP}/namespaces/{TENANT}/warmpools/p/status", status, "application/merge-patch+json"
        )[0]
        == 200
    )
    assert (
        operator.call("PATCH", f"/api/v1/namespaces/{TENANT}/pods/w", patch, "application/merge-patch+json")[
            0
        ]
        == 200
    )
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "elastune-worker-control"}}
    assert operator.call("POST", f"/api/v1/namespaces/{TENANT}/secrets", secret)[0] == 201
    assert operator.call("GET", "/apis")[0] == 200  # discovery: every authenticated user

    # Not granted: the verbs, names and resources the chart leaves out.
    body = _forbidden(operator.call("DELETE", f"/api/v1/namespaces/{TENANT}/pods/w"))
    assert body["message"] == (
        f'pods "w" is forbidden: User "{OPERATOR}" cannot delete resource "pods" in API group "" '
        f'in the namespace "{TENANT}"'
    )
    assert body["details"] == {"name": "w", "kind": "pods"}  # an empty group is omitted (omitempty)
    body = _forbidden(operator.call("PUT", f"{WP}/namespaces/{TENANT}/warmpools/p", {}))  # patch only
    assert 'cannot update resource "warmpools" in API group "elastune.dev"' in body["message"]
    body = _forbidden(operator.call("GET", f"/api/v1/namespaces/{TENANT}/secrets/elastune-worker-control"))
    assert 'cannot get resource "secrets"' in body["message"]  # get only of the Redis Secret's name
    body = _forbidden(operator.call("DELETE", f"/api/v1/namespaces/{TENANT}/pods"))
    assert body["message"].startswith("pods is forbidden: ") and "cannot deletecollection" in body["message"]
    body = _forbidden(operator.call("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles"))
    assert body["message"].endswith('in API group "rbac.authorization.k8s.io" at the cluster scope')
    assert operator.call("GET", f"{WP}/namespaces/{TENANT}/warmpools/nothere")[0] == 404  # authorized, absent


@pytest.mark.parametrize(
    ("namespace", "account", "component"),
    [(RELEASE_NS, "default", "gateway"), (RELEASE_NS, "default", "redis"), (TENANT, "default", "worker")],
)
def test_accounts_without_a_role_get_only_discovery(cluster: EmulatorHandle, namespace, account, component):
    """The gateway, Redis and worker pods run as their namespace's `default` account (the chart and the
    operator turn the token mount off): no rule of the chart names it, so only the bootstrap policy's
    discovery reads pass."""
    docs = template("elastune", RELEASE_NS)
    if component != "worker":
        pod_specs = [
            d["spec"]["template"]["spec"]
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")
            and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert pod_specs and all(s.get("serviceAccountName", "default") == account for s in pod_specs)
    user = f"system:serviceaccount:{namespace}:{account}"
    api = Api(cluster, Api(cluster).token_for(namespace, account))
    assert api.call("GET", "/api")[0] == 200
    assert api.call("GET", "/apis/elastune.dev/v1alpha1")[0] == 200
    body = _forbidden(api.call("GET", f"/api/v1/namespaces/{namespace}/pods"))
    assert body["message"] == (
        f'pods is forbidden: User "{user}" cannot list resource "pods" in API group "" '
        f'in the namespace "{namespace}"'
    )
    _forbidden(api.call("GET", f"/api/v1/namespaces/{namespace}/secrets/anything"))
    _forbidden(api.call("GET", f"{WP}/warmpools?watch=1"))


def test_role_binding_grants_only_in_its_namespace(tmp_path: Path):
    """With operator.watchNamespaces the ClusterRole is bound by a RoleBinding per namespace."""
    with start_emulator(tmp_path, enforce_rbac=True) as handle:
        _install(handle, f"operator.watchNamespaces={{{TENANT}}}")
        admin = Api(handle)
        operator = Api(handle, admin.token_for(RELEASE_NS, "elastune"))
        assert operator.call("GET", f"{WP}/namespaces/{TENANT}/warmpools")[0] == 200
        _forbidden(operator.call("GET", f"{WP}/namespaces/team-b/warmpools"))
        _forbidden(operator.call("GET", f"{WP}/warmpools"))  # a cluster-wide list needs a ClusterRoleBinding
        assert operator.call("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")[0] == 200


def test_tokens_authenticate_only_while_their_account_lives(cluster: EmulatorHandle):
    admin = Api(cluster)
    assert admin.call("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles")[0] == 200  # no token: admin
    status, body = Api(cluster, "forged").call("GET", "/api/v1/namespaces")
    assert (status, body["reason"]) == (401, "Unauthorized")
    status, body = admin.call("POST", f"/api/v1/namespaces/{TENANT}/serviceaccounts/nobody/token", {})
    assert (status, body["reason"]) == (404, "NotFound")
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "temp"}}
    assert admin.call("POST", f"/api/v1/namespaces/{TENANT}/serviceaccounts", account)[0] == 201
    temp = Api(cluster, admin.token_for(TENANT, "temp"))
    _forbidden(temp.call("GET", f"/api/v1/namespaces/{TENANT}/pods"))
    assert admin.call("DELETE", f"/api/v1/namespaces/{TENANT}/serviceaccounts/temp")[0] == 200
    assert temp.call("GET", f"/api/v1/namespaces/{TENANT}/pods")[0] == 401


def test_enforcement_can_be_switched_off(tmp_path: Path):
    with start_emulator(tmp_path, enforce_rbac=False) as handle:
        api = Api(handle, Api(handle).token_for(TENANT, "default"))
        assert api.call("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles")[0] == 200
        assert handle.emulator is not None and handle.emulator.denials == []


# -- the rules themselves, without HTTP ------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/api/v1/namespaces/a/pods", {}, ("list", "", "a", "pods", "", "")),
        ("GET", "/api/v1/namespaces/a/pods", {"watch": "true"}, ("watch", "", "a", "pods", "", "")),
        ("GET", "/api/v1/namespaces/a/pods", {"watch": "false"}, ("list", "", "a", "pods", "", "")),
        ("GET", "/api/v1/watch/namespaces/a/pods/p", {}, ("watch", "", "a", "pods", "", "p")),
        ("GET", "/api/v1/namespaces/a/pods/p", {}, ("get", "", "a", "pods", "", "p")),
        (
            "POST",
            "/apis/apps/v1/namespaces/a/deployments",
            {},
            ("create", "apps", "a", "deployments", "", ""),
        ),
        ("PUT", "/apis/g/v1/namespaces/a/things/t/status", {}, ("update", "g", "a", "things", "status", "t")),
        ("PATCH", "/api/v1/namespaces/a/pods/p/status", {}, ("patch", "", "a", "pods", "status", "p")),
        ("DELETE", "/api/v1/namespaces/a/pods/p", {}, ("delete", "", "a", "pods", "", "p")),
        ("DELETE", "/api/v1/namespaces/a/pods", {}, ("deletecollection", "", "a", "pods", "", "")),
        ("GET", "/api/v1/namespaces/a", {}, ("get", "", "a", "namespaces", "", "a")),
        ("PUT", "/api/v1/namespaces/a/finalize", {}, ("update", "", "a", "namespaces", "finalize", "a")),
        ("GET", "/api/v1/nodes", {}, ("list", "", "", "nodes", "", "")),
    ],
)
def test_request_attributes_follow_requestinfo(method, path, query, expected):
    a = rbac.attributes(method, path, query)
    assert a.resource_request
    assert (a.verb, a.api_group, a.namespace, a.resource, a.subresource, a.name) == expected


def test_non_resource_requests_and_rule_matching():
    assert not rbac.attributes("GET", "/apis/g/v1", {}).resource_request  # discovery of a group version
    assert rbac.attributes("GET", "/healthz", {}).verb == "get"
    status = rbac.attributes("PATCH", "/apis/g/v1/namespaces/a/things/t/status", {})
    assert rbac.rule_allows({"verbs": ["patch"], "apiGroups": ["g"], "resources": ["*/status"]}, status)
    assert not rbac.rule_allows({"verbs": ["patch"], "apiGroups": ["g"], "resources": ["things"]}, status)
    assert rbac.rule_allows({"verbs": ["*"], "apiGroups": ["*"], "resources": ["things/status"]}, status)
    named = {"verbs": ["patch"], "apiGroups": ["g"], "resources": ["things/status"], "resourceNames": ["u"]}
    assert not rbac.rule_allows(named, status)
    assert rbac.rule_allows({**named, "resourceNames": ["t"]}, status)
    assert rbac.rule_allows(
        {"verbs": ["get"], "nonResourceURLs": ["/metrics*"]}, rbac.attributes("GET", "/metrics/x", {})
    )


def test_bindings_resolve_subjects_and_missing_roles_grant_nothing():
    sa = User(
        "system:serviceaccount:a:s",
        ("system:serviceaccounts", "system:serviceaccounts:a", "system:authenticated"),
    )
    store: dict[str, list[dict[str, Any]]] = {
        "clusterroles": [
            {
                "metadata": {"name": "reader"},
                "rules": [{"verbs": ["get"], "apiGroups": [""], "resources": ["pods"]}],
            },
            {
                "metadata": {"name": "agg"},
                "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {"x": "y"}}]},
            },
            {
                "metadata": {"name": "part", "labels": {"x": "y"}},
                "rules": [{"verbs": ["list"], "apiGroups": [""], "resources": ["secrets"]}],
            },
        ],
        "clusterrolebindings": [],
        "roles": [
            {
                "metadata": {"name": "r", "namespace": "a"},
                "rules": [{"verbs": ["delete"], "apiGroups": [""], "resources": ["pods"]}],
            }
        ],
        # A ServiceAccount subject without a namespace means the binding's own namespace.
        "rolebindings": [
            {
                "metadata": {"name": "b1", "namespace": "a"},
                "roleRef": {"kind": "Role", "name": "r"},
                "subjects": [{"kind": "ServiceAccount", "name": "s"}],
            },
            {
                "metadata": {"name": "b2", "namespace": "a"},
                "roleRef": {"kind": "ClusterRole", "name": "agg"},
                "subjects": [{"kind": "Group", "name": "system:serviceaccounts:a"}],
            },
            {
                "metadata": {"name": "b3", "namespace": "a"},
                "roleRef": {"kind": "Role", "name": "gone"},
                "subjects": [{"kind": "ServiceAccount", "name": "s"}],
            },
        ],
    }

    def lister(plural: str, namespace: str | None) -> list[dict[str, Any]]:
        return [o for o in store[plural] if namespace is None or o["metadata"].get("namespace") == namespace]

    def allowed(method: str, path: str) -> bool:
        return rbac.authorize(sa, rbac.attributes(method, path, {}), lister).allowed

    assert allowed("DELETE", "/api/v1/namespaces/a/pods/p")  # Role via RoleBinding
    assert not allowed("DELETE", "/api/v1/namespaces/b/pods/p")  # only in the binding's namespace
    assert allowed("GET", "/api/v1/namespaces/a/secrets")  # aggregated ClusterRole, by group subject
    assert not allowed("GET", "/api/v1/namespaces/a/pods/p")  # "reader" is bound to nobody
    decision = rbac.authorize(sa, rbac.attributes("GET", "/api/v1/namespaces/a/configmaps", {}), lister)
    assert not decision.allowed and "gone" not in decision.reason and "b3" in decision.reason


def test_enforcement_is_on_unless_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch):
    from elastune_testing.emulator import RBAC_ENV, ApiServerEmulator

    monkeypatch.delenv(RBAC_ENV, raising=False)
    assert ApiServerEmulator().enforce_rbac
    monkeypatch.setenv(RBAC_ENV, "off")
    assert not ApiServerEmulator().enforce_rbac
