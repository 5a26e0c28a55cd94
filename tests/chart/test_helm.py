"""The Helm chart renders, lints and validates offline: built-in kinds against the Kubernetes OpenAPI
schemas (kubernetes-validate), custom resources against their CRDs, RBAC without wildcards and every
pod under the restricted Pod Security profile. Helm itself comes from tools/k8s_binaries.py."""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import json
import re
import tarfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from chart_render import (
    CHART,
    COMBINATIONS,
    CUSTOM_GROUPS,
    EXTERNAL_REDIS,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    REPO,
    RESYNC,
    combination,
    helm,
    k8s_binaries,
    named,
    of_kind,
    render,
    template_args,
    value_args,
)
from elastune_contract.api import crdcheck


def crd_file(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "crds" / name).read_text(encoding="utf-8"))


# -- the chart as a whole ------------------------------------------------------------------------


def test_chart_crds_are_exact_copies_of_the_generated_crds() -> None:
    top = {p.name: p.read_bytes() for p in sorted((REPO / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted((CHART / "crds").glob("*"))}
    assert top, "crds/ is empty"
    assert sorted(chart) == sorted(top), f"helm/elastune/crds/ holds other files than crds/; {RESYNC}"
    for name, data in top.items():
        assert chart[name] == data, f"helm/elastune/crds/{name} drifted from crds/{name}; {RESYNC}"


@combination
def test_helm_lint_is_clean(sets: tuple[str, ...]) -> None:
    args = ["lint", str(CHART), "--strict", "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    args += value_args(sets)
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("redis.bundled.enabled=false",), "redis.url is required when redis.bundled.enabled is false"),
        (("operator.bogus=1",), "additional properties 'bogus' not allowed"),
        (("operator.peering.name=Not_Valid",), "/operator/peering/name"),
        (('redis.auth.password=with"quote',), "/redis/auth/password"),
        (("metrics.serviceMonitor.enabled=true", "metrics.service.enabled=false"), "needs metrics.service"),
        (("serviceAccount.create=false",), "serviceAccount.name is required"),
        (("gateway.lengthPredictor.enabled=true",), "gateway.lengthPredictor.url is required"),
        (("gateway.routing.policy=fastest",), "/gateway/routing/policy"),
        (("gateway.routing.poolPolicies.tiny=fastest",), "/gateway/routing/poolPolicies/tiny"),
        (("gateway.holdTimeoutSeconds=-1",), "/gateway/holdTimeoutSeconds"),
    ],
    ids=[
        "external-redis-without-url",
        "unknown-value",
        "bad-peering-name",
        "bad-password",
        "servicemonitor-without-service",
        "no-serviceaccount-name",
        "length-predictor-without-url",
        "unknown-routing-policy",
        "unknown-pool-routing-policy",
        "negative-hold-timeout",
    ],
)
def test_invalid_values_are_refused_with_a_message(sets: tuple[str, ...], message: str) -> None:
    result = helm(*template_args(sets))
    assert result.returncode != 0, f"rendered although {sets} is invalid"
    assert message in result.stderr, result.stderr


# -- every rendering -----------------------------------------------------------------------------


@combination
def test_built_in_kinds_validate_against_the_kubernetes_schemas(sets: tuple[str, ...]) -> None:
    checked = 0
    for doc in render(*sets):
        if doc["apiVersion"].startswith(CUSTOM_GROUPS):
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.absolute_path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message}")
        checked += 1
    assert checked >= 6


@combination
def test_custom_resources_validate_against_their_crds(sets: tuple[str, ...]) -> None:
    docs = render(*sets)
    crds = {
        (crd["spec"]["group"], crd["spec"]["names"]["kind"]): crd
        for crd in of_kind(docs, "CustomResourceDefinition")
    }
    for doc in docs:
        group = doc["apiVersion"].split("/")[0]
        if group not in ("elastune.dev", "kopf.dev"):
            continue
        crd = crds.get((group, doc["kind"]))
        if crd is None:
            # The peering CRDs may come from another release (operator.peering.createCRDs=false).
            assert group == "kopf.dev", f"{doc['kind']} rendered without its CRD"
            continue
        assert crdcheck.validate_against_crd(doc, crd) == [], doc


def test_rendered_elastune_crds_are_the_chart_files() -> None:
    rendered = {crd["metadata"]["name"]: crd for crd in of_kind(render(), "CustomResourceDefinition")}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        crd = crd_file(path.name)
        assert rendered[crd["metadata"]["name"]] == crd


@combination
def test_rbac_has_no_wildcards(sets: tuple[str, ...]) -> None:
    roles = [d for d in render(*sets) if d["kind"] in ("ClusterRole", "Role")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert not any("*" in value for value in rule.get(field, [])), (
                    role["metadata"]["name"],
                    rule,
                )


def grants(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in rules
    )


REQUIRED_PERMISSIONS = [
    *[
        ("elastune.dev", f"{plural}{sub}", verb)
        for plural in ("tuningjobs", "warmpools", "loraadapters")
        for sub, verbs in (
            ("", ("get", "list", "watch", "patch")),
            ("/status", ("patch",)),
            ("/finalizers", ("update",)),
        )
        for verb in verbs
    ],
    # Issue 15: the operator publishes tuned prompts as LoRAAdapters and manages them.
    *[("elastune.dev", "loraadapters", v) for v in ("update", "create", "delete")],
    ("elastune.dev", "loraadapters/status", "update"),
    *[("apps", "deployments", v) for v in ("get", "create", "patch")],
    *[("", "pods", v) for v in ("get", "list", "watch", "patch")],
    ("", "events", "create"),
]


def test_cluster_wide_rbac_covers_what_the_operator_does() -> None:
    docs = render()
    rules = named(docs, "ClusterRole", f"{RELEASE}-operator")["rules"]
    for permission in [*REQUIRED_PERMISSIONS, ("kopf.dev", "clusterkopfpeerings", "patch")]:
        assert grants(rules, *permission), permission
    # Least privilege: nothing on other workloads; Secrets only as below.
    assert not any(grants(rules, "", "pods", verb) for verb in ("create", "delete", "update"))
    assert secret_rules(rules) == REDIS_SECRET_RULES
    binding = named(docs, "ClusterRoleBinding", f"{RELEASE}-operator")
    assert binding["roleRef"]["name"] == f"{RELEASE}-operator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]
    assert named(docs, "ServiceAccount", RELEASE)


# The operator writes each WarmPool's own Redis user into a Secret of the pool's namespace: create and
# patch (RBAC cannot restrict either by a name not known yet), nothing else on Secrets but API keys.
API_KEY_SECRET_RULE = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list", "watch"]}
"""API keys (gateway.auth.enabled, the default): the operator reads labelled Secrets to publish their
digests; RBAC cannot narrow list/watch by label."""
REDIS_SECRET_RULES = [
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    API_KEY_SECRET_RULE,
    # A rotation patches a WarmPool's <pool>-redis-user (issue 39 item 2): names RBAC cannot know.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["patch"]},
]


def secret_rules(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for rule in rules if "secrets" in rule["resources"]]


def test_operator_may_manage_lora_adapters_and_copy_only_the_redis_secret() -> None:
    rules = named(render(), "ClusterRole", f"{RELEASE}-operator")["rules"]
    adapters = [r for r in rules if r["resources"] == ["loraadapters"]]
    assert adapters == [
        {
            "apiGroups": ["elastune.dev"],
            "resources": ["loraadapters"],
            "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
        }
    ]
    for resource, verbs in (
        ("loraadapters/status", ("get", "patch", "update")),
        ("loraadapters/finalizers", ("update",)),
    ):
        for verb in verbs:
            assert grants(rules, "elastune.dev", resource, verb), (resource, verb)
    # Secrets: no update or delete anywhere; list/watch only for API keys (gateway.auth.enabled).
    for verb in ("update", "delete", "deletecollection"):
        assert not grants(rules, "", "secrets", verb), verb
    assert secret_rules(rules) == REDIS_SECRET_RULES
    no_keys = named(render("gateway.auth.enabled=false"), "ClusterRole", f"{RELEASE}-operator")["rules"]
    for verb in ("list", "watch"):  # which would read every Secret
        assert not grants(no_keys, "", "secrets", verb), verb
    # The name follows an existing Secret; without Redis auth there is nothing to copy, but the worker
    # control token is still written (create only: the operator never reads it back).
    existing = named(render(*EXTERNAL_REDIS), "ClusterRole", f"{RELEASE}-operator")["rules"]
    assert secret_rules(existing) == REDIS_SECRET_RULES
    no_auth = named(render(*COMBINATIONS["external-redis-no-auth"]), "ClusterRole", f"{RELEASE}-operator")
    assert secret_rules(no_auth["rules"]) == REDIS_SECRET_RULES[:2]


def test_gateway_authenticates_api_keys_by_default_and_the_operator_publishes_them() -> None:
    docs = render()
    (container,) = gateway_pod(docs)["containers"]
    _, settings = gateway_settings(container)
    assert settings.auth == "required"
    operator_env = {e["name"]: e.get("value") for e in operator_container(docs)["env"]}
    assert operator_env["ELASTUNE_API_KEYS"] == "true"
    off = render("gateway.auth.enabled=false")
    assert gateway_settings(gateway_pod(off)["containers"][0])[1].auth == "off"
    assert {e["name"]: e.get("value") for e in operator_container(off)["env"]}["ELASTUNE_API_KEYS"] == "false"
    # Namespaced installs: the Secret list/watch is bound in the watched namespaces only.
    namespaced = render(*COMBINATIONS["namespaced"])
    rules = named(namespaced, "ClusterRole", f"{RELEASE}-operator")["rules"]
    assert API_KEY_SECRET_RULE in rules
    cluster_rules = named(namespaced, "ClusterRole", f"{RELEASE}-operator-cluster")["rules"]
    assert not any("secrets" in r["resources"] for r in cluster_rules)


def test_gateway_forwards_only_to_vouched_workers_by_default() -> None:
    """The chart's gateway fails closed: a model no pool record vouches for gets no endpoint."""
    (container,) = gateway_pod(render())["containers"]
    assert gateway_settings(container)[1].vouched_only is True
    off = gateway_pod(render("gateway.vouchedOnly=false"))["containers"][0]
    assert gateway_settings(off)[1].vouched_only is False


def test_namespaced_rbac_binds_only_the_watched_namespaces() -> None:
    docs = render(*COMBINATIONS["namespaced"])
    rules = named(docs, "ClusterRole", f"{RELEASE}-operator")["rules"]
    for permission in [*REQUIRED_PERMISSIONS, ("kopf.dev", "kopfpeerings", "patch")]:
        assert grants(rules, *permission), permission
    # The resource permissions are bound per namespace, never cluster-wide.
    cluster_bindings = {b["roleRef"]["name"] for b in of_kind(docs, "ClusterRoleBinding")}
    assert cluster_bindings == {f"{RELEASE}-operator-cluster"}
    cluster_rules = named(docs, "ClusterRole", f"{RELEASE}-operator-cluster")["rules"]
    assert {r for rule in cluster_rules for r in rule["resources"]} == {
        "customresourcedefinitions",
        "namespaces",
        "nodes",  # the cold pool's capacity (docs/concepts/capacity.md): cluster-scoped, read only
    }
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in cluster_rules)
    bindings = of_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert {b["roleRef"]["name"] for b in bindings} == {f"{RELEASE}-operator"}
    peerings = of_kind(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not of_kind(docs, "ClusterKopfPeering")
    args = named(docs, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


# -- pods: restricted Pod Security profile -------------------------------------------------------

POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "Pod")
ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def pod_specs(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for doc in docs:
        if doc["kind"] == "Pod":
            found.append((doc["metadata"]["name"], doc["spec"]))
        elif doc["kind"] in POD_KINDS:
            found.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"]))
    return found


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Violations of the restricted Pod Security Standard, plus our read-only-root rule."""
    problems = []
    pod = spec.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            problems.append(f"{flag} is set")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            problems.append(f"volume {volume['name']} is {kinds - ALLOWED_VOLUMES}")
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    if not containers:
        problems.append("no containers")
    for container in containers:
        name = container["name"]
        ctx = container.get("securityContext") or {}
        if ctx.get("privileged"):
            problems.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {caps['add']}")
        non_root = ctx.get("runAsNonRoot", pod.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if ctx.get("runAsUser", pod.get("runAsUser")) == 0:
            problems.append(f"{name}: runs as UID 0")
        seccomp = (ctx.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile is {seccomp!r}")
        if ctx.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: root filesystem is writable")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"{name}: hostPort {port['hostPort']}")
    return problems


def test_restricted_check_catches_each_violation() -> None:
    """The checker is only worth something if it fails on bad pods."""
    good = pod_specs(render())[0][1]
    assert restricted_violations(good) == []
    edits = {
        "hostNetwork": lambda s: s.update(hostNetwork=True),
        "privileged": lambda s: s["containers"][0]["securityContext"].update(privileged=True),
        "allowPrivilegeEscalation": lambda s: s["containers"][0]["securityContext"].pop(
            "allowPrivilegeEscalation"
        ),
        "drop ALL": lambda s: s["containers"][0]["securityContext"].update(
            capabilities={"drop": ["NET_RAW"]}
        ),
        "runAsNonRoot": lambda s: (
            s["securityContext"].pop("runAsNonRoot"),
            s["containers"][0]["securityContext"].pop("runAsNonRoot"),
        ),
        "UID 0": lambda s: s["securityContext"].update(runAsUser=0),
        "seccompProfile": lambda s: (
            s["securityContext"].pop("seccompProfile"),
            s["containers"][0]["securityContext"].pop("seccompProfile"),
        ),
        "root filesystem": lambda s: s["containers"][0]["securityContext"].update(
            readOnlyRootFilesystem=False
        ),
        "hostPath": lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    }
    for what, edit in edits.items():
        bad = copy.deepcopy(good)
        edit(bad)
        assert restricted_violations(bad), f"a pod with {what} passed"


@combination
def test_every_pod_meets_the_restricted_profile(sets: tuple[str, ...]) -> None:
    pods = pod_specs(render(*sets))
    assert pods
    for name, spec in pods:
        assert restricted_violations(spec) == [], name
        # A read-only root needs a writable scratch directory.
        for container in spec["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{name}/{container['name']} has no /tmp"
            volume = next(v for v in spec["volumes"] if v["name"] == mounts["/tmp"])
            assert "emptyDir" in volume


# -- the operator --------------------------------------------------------------------------------


def operator_container(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    pod = named(docs, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container


def test_operator_runs_elastune_operator_with_kopf_health_and_metrics() -> None:
    docs = render()
    deployment = named(docs, "Deployment", f"{RELEASE}-operator")
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == RELEASE
    container = operator_container(docs)
    assert container["image"] == "ghcr.io/elastune/operator:0.1.0"
    assert container["command"] == ["elastune", "operator"]
    args = container["args"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in args
    assert "--all-namespaces" in args and "--peering=elastune" in args
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 9090, "health": 8080}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    env = {e["name"]: e for e in container["env"]}
    assert env["ELASTUNE_METRICS_PORT"]["value"] == "9090"
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_metrics_service_selects_the_operator_pod() -> None:
    docs = render()
    service = named(docs, "Service", f"{RELEASE}-metrics")
    labels = named(docs, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert not of_kind(docs, "ServiceMonitor") and not of_kind(docs, "PodMonitor")


def test_service_monitor_scrapes_the_metrics_service() -> None:
    docs = render(*COMBINATIONS["monitoring"])
    monitor = named(docs, "ServiceMonitor", f"{RELEASE}-operator")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = named(docs, "Service", f"{RELEASE}-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    gateway_monitor = named(docs, "ServiceMonitor", f"{RELEASE}-gateway")
    gateway_service = named(docs, "Service", f"{RELEASE}-gateway-metrics")  # /metrics off the client port
    selector = gateway_monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= gateway_service["metadata"]["labels"].items()
    assert not selector.items() <= service["metadata"]["labels"].items()
    assert gateway_monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "honorLabels": True, "interval": "30s",
         "scrapeTimeout": "10s"}
    ]  # fmt: skip
    pod_monitor = named(docs, "PodMonitor", f"{RELEASE}-workers")
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert pod_monitor["spec"]["selector"]["matchExpressions"] == [
        {"key": "elastune.dev/warmpool", "operator": "Exists"}
    ]


def test_peering_crds_are_kopfs_and_the_peering_object_is_a_hook() -> None:
    docs = render()
    crds = {c["metadata"]["name"]: c for c in of_kind(docs, "CustomResourceDefinition")}
    for name, scope, kind in (
        ("clusterkopfpeerings.kopf.dev", "Cluster", "ClusterKopfPeering"),
        ("kopfpeerings.kopf.dev", "Namespaced", "KopfPeering"),
    ):
        crd = crds[name]
        assert crd["spec"]["scope"] == scope and crd["spec"]["names"]["kind"] == kind
        status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        # Shared with every kopf operator in the cluster: never deleted with this release.
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert not any(n.endswith(".kopf.dev") for n in (p.name for p in (CHART / "crds").glob("*")))
    peering = named(docs, "ClusterKopfPeering", "elastune")
    assert peering["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    standalone = render(*COMBINATIONS["standalone"])
    assert not of_kind(standalone, "ClusterKopfPeering")
    assert not any(
        c["metadata"]["name"].endswith(".kopf.dev") for c in of_kind(standalone, "CustomResourceDefinition")
    )
    assert "--standalone" in operator_container(standalone)["args"]
    no_crds = render("operator.peering.createCRDs=false")
    assert named(no_crds, "ClusterKopfPeering", "elastune")
    assert len(of_kind(no_crds, "CustomResourceDefinition")) == 3


def test_every_templated_resource_carries_the_recommended_labels() -> None:
    for sets in COMBINATIONS.values():
        for doc in render(*sets):
            if doc["kind"] == "CustomResourceDefinition" and doc["spec"]["group"] == "elastune.dev":
                continue  # crds/ is not templated
            labels = doc["metadata"].get("labels", {})
            for key in (
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/version",
                "app.kubernetes.io/part-of",
                "app.kubernetes.io/managed-by",
                "helm.sh/chart",
            ):
                assert key in labels, f"{doc['kind']}/{doc['metadata']['name']} lacks {key}"


# -- the gateway ---------------------------------------------------------------------------------


def gateway_pod(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    pod: dict[str, Any] = named(docs, "Deployment", f"{RELEASE}-gateway")["spec"]["template"]["spec"]
    return pod


def gateway_settings(container: dict[str, Any]) -> Any:
    """The settings the gateway builds from the rendered command line, through its own parser."""
    from elastune_gateway.server.__main__ import build_parser, settings_from

    assert container["command"] == ["elastune", "gateway"]
    args = build_parser().parse_args(container["args"])
    return args, settings_from(args)


def test_gateway_serves_the_openai_api_on_a_cluster_ip_service() -> None:
    docs = render()
    deployment = named(docs, "Deployment", f"{RELEASE}-gateway")
    assert deployment["spec"]["replicas"] == 1
    pod = gateway_pod(docs)
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    # The operator's image (docker/operator.Dockerfile installs the gateway extra).
    assert container["image"] == operator_container(docs)["image"] == "ghcr.io/elastune/operator:0.1.0"
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9091, "protocol": "TCP"},  # /metrics apart (issue 39 item 5)
    ]
    service = named(docs, "Service", f"{RELEASE}-gateway")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    # Only the gateway's pods: the operator's and Redis' differ in their component label.
    for other in ("operator", "redis"):
        labels = named(docs, "Deployment", f"{RELEASE}-{other}")["spec"]["template"]["metadata"]["labels"]
        assert not service["spec"]["selector"].items() <= labels.items()
    args, settings = gateway_settings(container)
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert settings.redis_url == f"redis://{RELEASE}-redis.{NAMESPACE}.svc:6379/0"
    assert settings.default_policy == "preble" and settings.pool_policies == {}
    assert settings.hold_timeout_s == 30 and settings.max_waiting == 1024
    assert settings.length_predictor_url is None
    assert not [d for d in render("gateway.enabled=false") if d["metadata"]["name"] == f"{RELEASE}-gateway"]


def test_gateway_values_reach_its_command_line() -> None:
    docs = render(*COMBINATIONS["gateway-options"])
    assert named(docs, "Deployment", f"{RELEASE}-gateway")["spec"]["replicas"] == 2
    (container,) = gateway_pod(docs)["containers"]
    assert container["image"] == "registry.example/elastune-gateway:0.1.0"
    args, settings = gateway_settings(container)
    assert args.port == 8080 and container["ports"][0]["containerPort"] == 8080
    assert settings.default_policy == "rankAware"
    assert settings.pool_policies == {"tiny-gpt2": "combined", "team-a/tiny-gpt2": "leastLoad"}
    assert settings.policy_for("tiny-gpt2", None) == "combined"
    assert settings.policy_for("tiny-gpt2", None, "team-a/tiny-gpt2") == "leastLoad"
    assert settings.hold_timeout_s == 90 and settings.max_waiting == 64
    assert settings.length_predictor_url == "http://ssjf.elastune-system.svc:8080"
    assert named(docs, "Service", f"{RELEASE}-gateway")["spec"]["ports"][0]["port"] == 80
    # An unset repository follows the operator's image, tag included.
    tagged = render("operator.image.tag=1.2.3", "operator.image.pullPolicy=Always")
    (container,) = gateway_pod(tagged)["containers"]
    assert (container["image"], container["imagePullPolicy"]) == ("ghcr.io/elastune/operator:1.2.3", "Always")


def test_gateway_probes_hit_routes_the_gateway_serves() -> None:
    from fastapi.testclient import TestClient

    from elastune_gateway.server.app import create_app
    from elastune_gateway.server.service import Gateway

    (container,) = gateway_pod(render())["containers"]
    probes = {
        name: container[name]["httpGet"] for name in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert {p["port"] for p in probes.values()} == {"http"}
    _, settings = gateway_settings(container)
    # Without its lifespan the app never reads the registry: alive, not ready.
    client = TestClient(create_app(Gateway(settings)))
    expected = {"startupProbe": 200, "livenessProbe": 200, "readinessProbe": 503}
    for name, probe in probes.items():
        assert client.get(probe["path"]).status_code == expected[name], (name, probe["path"])
    assert probes["readinessProbe"]["path"] == "/readyz"


def test_gateway_reads_the_redis_password_from_the_secret() -> None:
    from elastune_contract.protocol import PASSWORD_ENV

    docs = render()
    (container,) = gateway_pod(docs)["containers"]
    # Its own Redis user (tests/security/test_redis_acl_chart.py), not the operator's password.
    assert env_of(container)[PASSWORD_ENV]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-redis-gateway"
    assert env_of(container)["ELASTUNE_REDIS_USERNAME"]["value"] == "elastune-gateway"
    assert all("password" not in arg.lower() for arg in container["args"])
    no_acl = render("redis.bundled.acl.enabled=false")
    (container,) = gateway_pod(no_acl)["containers"]
    assert (
        env_of(container)[PASSWORD_ENV]["valueFrom"]
        == env_of(operator_container(no_acl))[PASSWORD_ENV]["valueFrom"]
    )
    (container,) = gateway_pod(render(*EXTERNAL_REDIS))["containers"]
    assert env_of(container)[PASSWORD_ENV]["valueFrom"]["secretKeyRef"]["name"] == "managed-redis"
    (container,) = gateway_pod(render(*COMBINATIONS["external-redis-no-auth"]))["containers"]
    assert PASSWORD_ENV not in env_of(container)
    _, settings = gateway_settings(container)
    assert settings.redis_url == "redis://redis.data.svc:6379/0"


# -- Redis ---------------------------------------------------------------------------------------


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_bundled_redis_password_comes_from_a_secret() -> None:
    docs = render()
    secret = named(docs, "Secret", f"{RELEASE}-redis")
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) == 32 and password.isalnum()
    env = env_of(operator_container(docs))
    assert env["ELASTUNE_REDIS_URL"]["value"] == f"redis://{RELEASE}-redis.{NAMESPACE}.svc:6379/0"
    assert env["ELASTUNE_REDIS_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": f"{RELEASE}-redis", "key": "password"}
    }
    redis = named(docs, "Deployment", f"{RELEASE}-redis")["spec"]["template"]["spec"]
    (container,) = redis["containers"]
    assert env_of(container)["OPERATOR_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-redis"
    # The password is never a literal in a pod spec or on a command line.
    assert password not in json.dumps([d for d in docs if d["kind"] != "Secret"])
    assert redis["automountServiceAccountToken"] is False
    service = named(docs, "Service", f"{RELEASE}-redis")
    assert (
        service["spec"]["selector"].items()
        <= named(docs, "Deployment", f"{RELEASE}-redis")["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["spec"]["ports"][0]["port"] == 6379


def test_bundled_redis_keeps_an_append_only_file_on_a_claim_unless_told_not_to() -> None:
    docs = render()
    redis = named(docs, "Deployment", f"{RELEASE}-redis")["spec"]["template"]["spec"]
    script = redis["containers"][0]["args"][0]
    assert "--appendonly yes" in script and "--dir /data" in script
    data = next(v for v in redis["volumes"] if v["name"] == "data")
    assert data == {"name": "data", "persistentVolumeClaim": {"claimName": f"{RELEASE}-redis"}}
    claim = named(docs, "PersistentVolumeClaim", f"{RELEASE}-redis")
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # An existing claim is used as is; without persistence an emptyDir (container restarts only).
    existing = named(render("redis.bundled.persistence.existingClaim=mine"), "Deployment", f"{RELEASE}-redis")
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "mine"}} in existing["spec"]["template"][
        "spec"
    ]["volumes"]
    off = render("redis.bundled.persistence.enabled=false")
    assert not [d for d in off if d["kind"] == "PersistentVolumeClaim"]
    volumes = named(off, "Deployment", f"{RELEASE}-redis")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "data", "emptyDir": {}} in volumes


def test_explicit_password_is_used() -> None:
    secret = named(render("redis.auth.password=s3cret-pass"), "Secret", f"{RELEASE}-redis")
    assert base64.b64decode(secret["data"]["password"]) == b"s3cret-pass"


def test_external_redis_uses_the_url_and_the_existing_secret() -> None:
    docs = render(*EXTERNAL_REDIS)
    assert not [d for d in docs if d["metadata"]["name"].endswith("-redis")], "bundled Redis rendered"
    env = env_of(operator_container(docs))
    assert env["ELASTUNE_REDIS_URL"]["value"] == "redis://redis.data.svc:6379/0"
    assert env["ELASTUNE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "managed-redis",
        "key": "password",
    }
    no_auth = render(*COMBINATIONS["external-redis-no-auth"])
    assert "ELASTUNE_REDIS_PASSWORD" not in env_of(operator_container(no_auth))
    # no Redis Secret; only the operator's own keys (the attempts' proofs)
    assert [s["metadata"]["name"] for s in of_kind(no_auth, "Secret")] == [f"{RELEASE}-operator-keys"]


# -- example WarmPool and dashboards -------------------------------------------------------------


def test_example_warm_pool_matches_the_manifest() -> None:
    docs = render(*COMBINATIONS["example-warmpool"])
    pool = named(docs, "WarmPool", "tiny-gpt2")
    assert pool["metadata"]["namespace"] == NAMESPACE
    assert pool["metadata"]["labels"]["elastune.dev/model"] == "tiny-gpt2"
    manifest = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text(encoding="utf-8"))
    rendered_env = pool["spec"]["worker"].pop("env")
    manifest_env = manifest["spec"]["worker"].pop("env")
    assert pool["spec"] == manifest["spec"], (
        "values.yaml examples.warmPool.spec drifted from manifests/warmpool.yaml"
    )
    env = {e["name"]: e for e in rendered_env}
    assert env["HF_HUB_OFFLINE"] == next(e for e in manifest_env if e["name"] == "HF_HUB_OFFLINE")
    assert env["ELASTUNE_REDIS_URL"]["value"] == f"redis://{RELEASE}-redis.{NAMESPACE}.svc:6379/0"
    assert env["ELASTUNE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{RELEASE}-redis-worker",
        "key": "password",
    }
    assert env["ELASTUNE_REDIS_USERNAME"]["value"] == "elastune-worker"
    assert not of_kind(render(), "WarmPool")


def test_dashboards_ship_as_sidecar_configmaps() -> None:
    files = {p.name: p.read_text(encoding="utf-8") for p in sorted((CHART / "dashboards").glob("*.json"))}
    assert sorted(files) == ["jobs-and-slos.json", "pools-and-cost.json", "serving.json", "workers.json"]
    maps = of_kind(render(), "ConfigMap")
    shipped = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((key, text),) = config_map["data"].items()
        shipped[key.removeprefix("elastune-")] = text
    assert {k: json.loads(v) for k, v in shipped.items()} == {k: json.loads(v) for k, v in files.items()}
    assert not of_kind(render(*COMBINATIONS["standalone"]), "ConfigMap")


def test_chart_packages_with_its_crds_and_dashboards(tmp_path: Path) -> None:
    result = helm("package", str(CHART), "--destination", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("elastune-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for path in [*(CHART / "crds").glob("*.yaml"), *(CHART / "dashboards").glob("*.json")]:
        assert f"elastune/{path.parent.name}/{path.name}" in names
    assert "elastune/values.schema.json" in names


def test_helm_binary_is_found_and_runs() -> None:
    result = helm("version", "--short")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(("v3.", "v4.")), result.stdout
    assert k8s_binaries.main(["helm"]) == 0
    assert k8s_binaries.main(["oc"]) == 2


# -- a first install: NOTES, claims, Secrets under GitOps, CRD upgrades, probes (issue 37 item 5) ----


@functools.cache
def notes(*sets: str) -> str:
    """NOTES.txt as `helm install` prints it (a client-side dry run: no cluster, lookup finds nothing)."""
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *value_args(sets)]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\nNOTES:\n", 1)[1]


def test_notes_show_a_request_that_works_with_api_keys_on() -> None:
    text = notes()
    # Auth is on by default: the request carries a key from a labelled Secret the notes create.
    assert "unused" not in text
    create = "kubectl -n default create secret generic my-key --from-literal=key=$OPENAI_API_KEY"
    label = "kubectl -n default label secret my-key elastune.dev/api-key=true"
    curl = 'curl $OPENAI_BASE_URL/completions -H "Authorization: Bearer $OPENAI_API_KEY"'
    assert create in text and label in text and curl in text, text
    assert text.index(create) < text.index(label) < text.index(curl)
    assert "export OPENAI_API_KEY=sk-$(openssl rand -hex 16)" in text
    off = notes("gateway.auth.enabled=false")
    assert "Authorization" not in off and "API keys are off" in off


def test_notes_say_whether_redis_persists_as_the_chart_renders_it() -> None:
    assert "append-only file on the claim\nelastune-redis" in notes(), notes()
    assert "without persistence" not in notes()
    assert "on the claim\nmine" in notes("redis.bundled.persistence.existingClaim=mine")
    off = notes("redis.bundled.persistence.enabled=false")
    assert "without persistence" in off and "starts empty" in off


def test_notes_warn_when_the_example_warm_pool_lands_where_the_operator_does_not_watch() -> None:
    example = "examples.warmPool.enabled=true"
    unwatched = notes(example, "operator.watchNamespaces={team-a}")
    assert (
        f"WARNING: the example WarmPool tiny-gpt2 is in {NAMESPACE}, which the operator does not" in unwatched
    )
    watched = notes(example, f"operator.watchNamespaces={{team-a,{NAMESPACE}}}")
    assert "WARNING: the example WarmPool tiny-gpt2 is in" not in watched
    assert "WARNING: the example WarmPool tiny-gpt2 is in" not in notes(example)  # cluster-wide
    # manifests/ use namespace default: the notes say so when it is not watched.
    assert "manifests/*.yaml use namespace default" in unwatched
    assert "manifests/*.yaml use namespace default" not in notes()


def test_the_claims_pools_mount_are_created_where_asked_and_kept() -> None:
    from elastune_contract.api.warmpool import DEFAULT_MODEL_CACHE_CLAIM

    assert [c["metadata"]["name"] for c in of_kind(render(), "PersistentVolumeClaim")] == [f"{RELEASE}-redis"]
    assert "The chart created no claim" in notes()
    sets = ("storage.namespaces={default,team-a}", "storage.storageClass=nfs-client")
    claims = [
        c
        for c in of_kind(render(*sets), "PersistentVolumeClaim")
        if c["metadata"]["name"] != "elastune-redis"
    ]
    assert {(c["metadata"]["namespace"], c["metadata"]["name"]) for c in claims} == {
        ("default", "elastune-artifacts"),
        ("team-a", "elastune-artifacts"),
    }
    for claim in claims:
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert claim["spec"]["storageClassName"] == "nfs-client"
        assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # The names the pools mount: manifests/warmpool.yaml's jobStorage claim, the contract's cache claim.
    manifest = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text(encoding="utf-8"))
    (job_storage,) = [v["claimName"] for v in manifest["spec"]["volumes"] if v.get("jobStorage")]
    assert job_storage == claims[0]["metadata"]["name"]
    cache = render("storage.namespaces={default}", "storage.modelCache.create=true")
    names = {c["metadata"]["name"] for c in of_kind(cache, "PersistentVolumeClaim")}
    assert DEFAULT_MODEL_CACHE_CLAIM in names and "elastune-artifacts" in names
    assert "created elastune-artifacts and elastune-models in: default" in notes(
        "storage.namespaces={default}", "storage.modelCache.create=true"
    )


PINNED = (
    "redis.bundled.acl.existingSecrets.gateway=my-redis-gateway",
    "redis.bundled.acl.existingSecrets.worker=my-redis-worker",
    "operator.proofKey.existingSecret=my-operator-keys",
)


def pod_template(docs: tuple[dict[str, Any], ...], component: str) -> dict[str, Any]:
    return named(docs, "Deployment", f"{RELEASE}-{component}")["spec"]["template"]


def secrets_read(template: dict[str, Any]) -> set[str]:
    containers = template["spec"]["containers"]
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for c in containers
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    return refs | {v["secret"]["secretName"] for v in template["spec"].get("volumes", []) if "secret" in v}


def expected_checksum(docs: tuple[dict[str, Any], ...], names: set[str]) -> str:
    """templates/_secrets.tpl's rule: per name, its rendered data as compact sorted JSON, or external."""
    rendered = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
    lines = []
    for name in sorted(names):
        secret = rendered.get(name)
        data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} if secret else None
        lines.append(
            f"{name}:{json.dumps(data, sort_keys=True, separators=(',', ':')) if data else 'external'}"
        )
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


@pytest.mark.parametrize("sets", [(), ("redis.bundled.acl.enabled=false",), EXTERNAL_REDIS, PINNED],
                         ids=["defaults", "one-password", "external-redis", "pinned"])  # fmt: skip
def test_pods_carry_the_checksum_of_the_secrets_they_read(sets: tuple[str, ...]) -> None:
    # One render: the generated values in the Secrets are the ones the checksums cover (computed once).
    docs = render(*sets)
    for component in ("operator", "gateway", "redis"):
        if component == "redis" and "redis.bundled.enabled=false" in sets:
            continue
        template = pod_template(docs, component)
        names = secrets_read(template)
        assert names or component == "gateway", component
        assert template["metadata"]["annotations"]["checksum/secrets"] == expected_checksum(docs, names), (
            component
        )


def test_a_changed_secret_rolls_exactly_the_pods_that_read_it_and_pinned_secrets_render_the_same() -> None:
    first = render(*PINNED, "redis.auth.password=first-password")
    again = helm(*template_args((*PINNED, "redis.auth.password=first-password")))
    # Everything pinned: `helm template` renders the same bytes every time (GitOps sees no diff).
    assert again.stdout == helm(*template_args((*PINNED, "redis.auth.password=first-password"))).stdout
    second = render(*PINNED, "redis.auth.password=second-password")

    def checksum(docs: tuple[dict[str, Any], ...], component: str) -> str:
        return str(pod_template(docs, component)["metadata"]["annotations"]["checksum/secrets"])

    # The operator's password: the operator and Redis roll; the gateway has its own Redis user.
    assert checksum(first, "operator") != checksum(second, "operator")
    assert checksum(first, "redis") != checksum(second, "redis")
    assert checksum(first, "gateway") == checksum(second, "gateway")
    assert not [s for s in of_kind(first, "Secret") if s["metadata"]["name"] != f"{RELEASE}-redis"]
    # An existing Secret is the user's: named in the pod, never rendered.
    env = env_of(operator_container(first))
    assert env["ELASTUNE_PROOF_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "my-operator-keys"
    assert env["ELASTUNE_REDIS_WORKER_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "my-redis-worker"
    assert env["ELASTUNE_REDIS_SECRET"]["value"] == "my-redis-worker"  # what the operator copies to pools
    (gateway,) = gateway_pod(first)["containers"]
    assert (
        env_of(gateway)["ELASTUNE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "my-redis-gateway"
    )


def test_generated_secrets_differ_per_render_without_pins_as_the_docs_warn() -> None:
    """Why the pins exist: `helm template` has no lookup, so unpinned values are new each render."""
    a, b = (helm(*template_args(())).stdout for _ in range(2))
    assert a != b
    install = (REPO / "docs" / "operations" / "install.md").read_text(encoding="utf-8")
    for value in (
        "redis.auth.existingSecret",
        "redis.bundled.acl.existingSecrets",
        "operator.proofKey.existingSecret",
    ):
        assert value in install, f"docs/operations/install.md does not tell GitOps users about {value}"


def test_the_upgrade_page_applies_the_crds_before_helm_upgrade() -> None:
    page = (REPO / "docs" / "operations" / "upgrades.md").read_text(encoding="utf-8")
    lines = [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", page, flags=re.S)
        for line in block.splitlines()
    ]
    crds = "kubectl apply --server-side --force-conflicts -f helm/elastune/crds/"
    upgrade = next(i for i, line in enumerate(lines) if line.startswith("helm upgrade "))
    assert crds in lines[:upgrade], "upgrades.md must apply the CRDs before helm upgrade, in its commands"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(
        p.name for p in (REPO / "crds").glob("*.yaml")
    )
    assert crds in notes()


def test_probes_wait_out_a_multi_minute_weight_load() -> None:
    from elastune_contract.api.warmpool import WarmPool
    from elastune_operator.k8s.workload import worker_pod_template

    # The chart's example pool as the operator writes its workers.
    pool = WarmPool.model_validate(named(render(*COMBINATIONS["example-warmpool"]), "WarmPool", "tiny-gpt2"))
    (worker,) = worker_pod_template(pool, "redis://r:6379/0", "elastune-redis-worker")["spec"]["containers"]
    startup, liveness = worker["startupProbe"], worker["livenessProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= pool.spec.fetch.load_timeout_seconds >= 300, startup  # minutes, not liveness' seconds
    assert startup["httpGet"]["path"] == liveness["httpGet"]["path"] == "/healthz"
    assert worker["readinessProbe"]["httpGet"]["path"] == "/readyz"  # warm only once loaded
    # The operator and gateway load no weights, but their probes still give a slow start a minute.
    docs = render()
    for container in (operator_container(docs), gateway_pod(docs)["containers"][0]):
        start = container["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 60, container["name"]
        assert container["livenessProbe"].get("timeoutSeconds", 1) >= 3, container["name"]
