"""RBAC as the apiserver authorizes a request: attributes from the request, rules from stored roles.

Followed, in kubernetes/kubernetes:
- staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go (NewRequestInfo): a path under /api
  or /apis/<group> is a resource request; the verb is create/get/update/patch/delete from POST/GET
  (HEAD)/PUT/PATCH/DELETE, `/watch/` in the path makes it watch, a GET without a name is list (watch with
  `?watch=` anything but false/0), a DELETE without a name deletecollection; `namespaces/<ns>` sets the
  namespace (also for the Namespace object itself), then resource/name/subresource;
- plugin/pkg/auth/authorizer/rbac/rbac.go (RuleAllows): a rule allows when verb, API group,
  resource (`resource/subresource` combined) and resourceName match;
- pkg/apis/rbac/v1/evaluation_helpers.go: `*` matches any verb, group or resource; `*/<subresource>`
  matches that subresource of any resource; empty resourceNames match any name; nonResourceURLs match
  exactly or by a trailing `*` prefix;
- pkg/registry/rbac/validation/rule.go (VisitRulesFor, appliesTo): every ClusterRoleBinding's rules apply
  in every namespace and cluster-wide; a RoleBinding's (to a Role of its namespace, or a ClusterRole) only
  in its namespace; a ServiceAccount subject without a namespace means the binding's namespace; a role that
  does not exist grants nothing; ClusterRoles with an aggregationRule take the rules of the ClusterRoles
  its selectors match (pkg/controller/clusterroleaggregation, matchLabels only here);
- plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go: every authenticated user may read discovery
  (system:discovery, system:public-info-viewer) and create self reviews (system:basic-user); here they
  are built in rather than stored as objects;
- staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go (forbiddenMessage) and
  staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go (NewForbidden): the 403 wording.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

from elastune_testing.apiserver.authn import User

GROUP: Final = "rbac.authorization.k8s.io"
Rule = Mapping[str, Any]
Lister = Callable[[str, str | None], list[dict[str, Any]]]
"""(plural, namespace or None for all/cluster-scoped) -> the stored RBAC objects of that plural."""

# Special verbs that come before the resource in a path (requestinfo.go specialVerbs).
_SPECIAL_VERBS: Final = frozenset({"proxy", "watch"})
_NAMESPACE_SUBRESOURCES: Final = frozenset({"status", "finalize"})

# bootstrappolicy/policy.go: what every authenticated user is bound to.
_AUTHENTICATED_RULES: Final[tuple[Rule, ...]] = (
    {
        "verbs": ["get"],
        "nonResourceURLs": [
            "/api",
            "/api/*",
            "/apis",
            "/apis/*",
            "/openapi",
            "/openapi/*",
            "/version",
            "/version/",
        ],
    },
    {"verbs": ["get"], "nonResourceURLs": ["/healthz", "/livez", "/readyz"]},
    {
        "verbs": ["create"],
        "apiGroups": ["authorization.k8s.io"],
        "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
    },
    {"verbs": ["create"], "apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"]},
)


@dataclasses.dataclass(frozen=True, slots=True)
class Attributes:
    verb: str
    path: str
    resource_request: bool = False
    api_group: str = ""
    api_version: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""


def attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes:
    """The request's authorization attributes (requestinfo.go)."""
    verb = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update", "PATCH": "patch"}.get(
        method.upper(), "delete" if method.upper() == "DELETE" else ""
    )
    parts = [part for part in path.strip("/").split("/") if part]
    non_resource = Attributes(verb=method.lower(), path=path)  # a non-resource verb is the method
    if not parts or parts[0] not in ("api", "apis"):
        return non_resource
    group = ""
    rest = parts[1:]
    if parts[0] == "apis":
        if len(rest) < 3:
            return non_resource
        group, rest = rest[0], rest[1:]
    elif len(rest) < 2:
        return non_resource
    version, rest = rest[0], rest[1:]
    if rest[0] in _SPECIAL_VERBS and len(rest) >= 2:
        verb, rest = rest[0], rest[1:]
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) >= 2 else ""
    subresource = rest[2] if len(rest) >= 3 and verb != "proxy" else ""
    if not name and verb == "get":
        watch = query.get("watch")
        verb = "list" if watch is None or watch.lower() in ("false", "0") else "watch"
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(verb, path, True, group, version, namespace, resource, subresource, name)


# -- rule matching (evaluation_helpers.go, rbac.go RuleAllows) ----------------------------------------


def _any(values: Iterable[str], wanted: str, wildcard: str = "*") -> bool:
    return any(value in (wildcard, wanted) for value in values)


def _resource_matches(rule: Rule, combined: str, subresource: str) -> bool:
    for resource in rule.get("resources") or []:
        if resource in ("*", combined):
            return True
        if subresource and resource == f"*/{subresource}":
            return True
    return False


def _url_matches(rule: Rule, path: str) -> bool:
    for url in rule.get("nonResourceURLs") or []:
        if url in ("*", path) or (url.endswith("*") and path.startswith(url.rstrip("*"))):
            return True
    return False


def rule_allows(rule: Rule, attrs: Attributes) -> bool:
    if not _any(rule.get("verbs") or [], attrs.verb):
        return False
    if not attrs.resource_request:
        return _url_matches(rule, attrs.path)
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    names = rule.get("resourceNames") or []
    return (
        _any(rule.get("apiGroups") or [], attrs.api_group)
        and _resource_matches(rule, combined, attrs.subresource)
        and (not names or attrs.name in names)
    )


# -- rule resolution (rule.go VisitRulesFor) ---------------------------------------------------------


def _applies_to(user: User, subjects: Iterable[Mapping[str, Any]], binding_namespace: str) -> bool:
    for subject in subjects:
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "User" and name == user.name:
            return True
        if kind == "Group" and name in user.groups:
            return True
        if kind == "ServiceAccount":
            namespace = subject.get("namespace") or binding_namespace
            if namespace and user.name == f"system:serviceaccount:{namespace}:{name}":
                return True
    return False


def _cluster_role_rules(name: str, lister: Lister) -> list[Rule] | None:
    roles = {role["metadata"]["name"]: role for role in lister("clusterroles", None)}
    role = roles.get(name)
    if role is None:
        return None
    rules = list(role.get("rules") or [])
    for selector in (role.get("aggregationRule") or {}).get("clusterRoleSelectors") or []:
        wanted = selector.get("matchLabels") or {}
        for other in roles.values():
            labels = other["metadata"].get("labels") or {}
            if other is not role and wanted and all(labels.get(k) == v for k, v in wanted.items()):
                rules += other.get("rules") or []
    return rules


def _rules_for(user: User, namespace: str, lister: Lister) -> Iterator[tuple[str, list[Rule] | None]]:
    """(what granted them, rules or None when the role is missing), in VisitRulesFor's order."""
    yield "bootstrap policy for system:authenticated", list(_AUTHENTICATED_RULES)
    for binding in lister("clusterrolebindings", None):
        if _applies_to(user, binding.get("subjects") or [], ""):
            ref = binding.get("roleRef") or {}
            yield (
                f'ClusterRoleBinding "{binding["metadata"]["name"]}"',
                _cluster_role_rules(str(ref.get("name", "")), lister),
            )
    if not namespace:
        return
    for binding in lister("rolebindings", namespace):
        if not _applies_to(user, binding.get("subjects") or [], namespace):
            continue
        ref = binding.get("roleRef") or {}
        source = f'RoleBinding "{binding["metadata"]["name"]}" of namespace "{namespace}"'
        if ref.get("kind") == "ClusterRole":
            yield source, _cluster_role_rules(str(ref.get("name", "")), lister)
        else:
            roles = [r for r in lister("roles", namespace) if r["metadata"]["name"] == ref.get("name")]
            yield source, list(roles[0].get("rules") or []) if roles else None


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str


def authorize(user: User, attrs: Attributes, lister: Lister) -> Decision:
    """Allowed by the first rule that matches, else denied (RBAC never denies explicitly)."""
    if user.is_admin:
        return Decision(True, "system:masters")
    if "system:authenticated" not in user.groups:
        return Decision(False, "")
    missing = []
    for source, rules in _rules_for(user, attrs.namespace, lister):
        if rules is None:
            missing.append(source)
            continue
        if any(rule_allows(rule, attrs) for rule in rules):
            return Decision(True, f"RBAC: allowed by {source}")
    reason = f"RBAC: the role of {', '.join(missing)} was not found" if missing else ""
    return Decision(False, reason)


def forbidden_message(user: User, attrs: Attributes, reason: str = "") -> str:
    """The 403 Status message: NewForbidden(group resource, name, forbiddenMessage[: reason])."""
    if not attrs.resource_request:
        detail = f'User "{user.name}" cannot {attrs.verb} path "{attrs.path}"'
    else:
        resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
        scope = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
        detail = (
            f'User "{user.name}" cannot {attrs.verb} resource "{resource}" in API group '
            f'"{attrs.api_group}" {scope}'
        )
    if reason:
        detail = f"{detail}: {reason}"
    if not attrs.resource_request:
        return f"forbidden: {detail}"
    qualified = f"{attrs.resource}.{attrs.api_group}" if attrs.api_group else attrs.resource
    return (
        f'{qualified} "{attrs.name}" is forbidden: {detail}'
        if attrs.name
        else f"{qualified} is forbidden: {detail}"
    )
