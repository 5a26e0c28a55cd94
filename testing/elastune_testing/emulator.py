"""A Kubernetes API server emulator for the operator's integration tests and benchmarks (docs/design.md §6).

kmock's KubernetesEmulator serves discovery and stores objects verbatim; the real kopf operator needs more
of an apiserver than that. `ApiServerEmulator` keeps kmock's HTTP plumbing, discovery, DSL (reactions
added with `emulator[...] << ...` still take precedence over the emulated behaviour, e.g. to inject a
500) and `emulator.objects` history, and replaces the object semantics with an apiserver's:

- metadata stamping (uid, creationTimestamp, generation, one global resourceVersion bumped by every write),
  generateName, 409 AlreadyExists / Conflict, 404 NotFound, `Status` bodies for every error;
- the `status` subresource isolated both ways, generation bumped only by changes outside metadata/status;
- custom resources admitted as the apiextensions-apiserver admits them (`apiserver.admission`): pruned,
  defaulted, validated against their CRD's structural schema, then their `x-kubernetes-validations` CEL
  rules (`apiserver.cel`, transition rules with `oldSelf` included); 422 Invalid with `details.causes`
  naming the fields; a CRD whose CEL rule does not compile is refused;
- authentication and RBAC (`apiserver.authn`, `apiserver.rbac`): `POST .../serviceaccounts/<sa>/token`
  (TokenRequest) issues a service account's token; a request carrying one is authorized against the
  Roles, ClusterRoles and bindings stored here, 403 Forbidden as the apiserver words it, 401 for a token
  it did not issue. No token, or the kubeconfig's, is a cluster admin (the tests' own client).
  `ELASTUNE_EMULATOR_RBAC=off` (or `enforce_rbac=False`) turns authorization off; denials are kept in
  `denials` and appended to the file `ELASTUNE_EMULATOR_RBAC_LOG` names, if any;
- merge patch, JSON patch (kopf's finalizer patches carry a `test` of metadata.resourceVersion),
  PUT replace, resourceVersion preconditions, no-op writes that change nothing (no RV bump, no event);
- finalizers and deletionTimestamp, owner-reference garbage collection (background or orphan),
  namespace deletion cascading to its contents, CRD deletion to its custom resources;
- label and field selectors on list/watch/deletecollection, watch streams resumable from a
  resourceVersion (410 Gone once it has left the bounded event log), bookmarks, timeoutSeconds;
- `/api/v1/namespaces` (kmock 0.8 cannot parse that path): namespaces are created implicitly the first
  time an object is created in them, `default` exists from the start.

Not emulated: admission webhooks, CEL cost limits and the Kubernetes CEL libraries, schema (non-CEL)
ratcheting, the ServiceAccount admission plugin, server-side apply,
strategic-merge list semantics (a strategic merge patch of a built-in kind is applied as a JSON merge
patch), foreground deletion (treated as background), graceful pod termination (pods go at once), the
link between core/v1 and events.k8s.io/v1 events (two separate stores), any controller (Knative, kubelet).

Run it with `start_emulator()` (background thread or subprocess, free port, kubeconfig written), the
`k8s_emulator` pytest fixture (elastune_testing.fixtures), kmock's own async fixture with
`@pytest.mark.kmock(cls=ApiServerEmulator)` (kmock 0.8's `kmock_cls` ini option cannot name a class in a
nested module), or `python -m elastune_testing.emulator --port 0 --kubeconfig PATH`. Point kopf
at it with `kopf run --standalone --all-namespaces operator.py` and `env=handle.env()` (KUBECONFIG).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import copy
import dataclasses
import datetime
import itertools
import json
import logging
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

import aiohttp.web
import attrs
import yaml

try:
    import jsonpatch
    import jsonpointer
    import kmock

    # Private modules of kmock: the version is pinned (kmock==0.8) because we build on them.
    from kmock._internal import enums, parsing, rendering
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "elastune_testing needs the development extras (kmock): pip install 'elastune[dev]'"
    ) from exc

from elastune_contract.api.crds import build_crd
from elastune_contract.api.resources import RESOURCE_MODELS
from elastune_testing.apiserver import admission, authn, rbac

logger = logging.getLogger(__name__)

T = TypeVar("T")
JSON = dict[str, Any]
ObjectKey = tuple[kmock.resource, str | None, str]

ALL_VERBS: Final = frozenset(
    {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
)

CRD_RESOURCE: Final = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES: Final = kmock.resource("", "v1", "namespaces")
SERVICE_ACCOUNTS: Final = kmock.resource("", "v1", "serviceaccounts")
RBAC_ENV: Final = "ELASTUNE_EMULATOR_RBAC"
RBAC_LOG_ENV: Final = "ELASTUNE_EMULATOR_RBAC_LOG"

# Resources the operator talks to that kmock's bundled discovery data (builtins of a K3s cluster) lacks.
EXTRA_RESOURCES: Final[dict[kmock.resource, kmock.ResourceInfo]] = {
    kmock.resource("serving.knative.dev", "v1", plural): kmock.ResourceInfo(
        kind=kind,
        singular=kind.lower(),
        namespaced=True,
        verbs=ALL_VERBS,
        shortnames=shortnames,
        categories={"all", "knative", "serving"},
        subresources={"status"},
    )
    for plural, kind, shortnames in (
        ("services", "Service", {"kservice", "ksvc"}),
        ("configurations", "Configuration", {"config", "cfg"}),
        ("revisions", "Revision", {"rev"}),
        ("routes", "Route", {"rt"}),
    )
} | {
    # kopf's peering CRDs (docs.kopf.dev/en/stable/peering): status is free-form, no subresource.
    kmock.resource("kopf.dev", "v1", "kopfpeerings"): kmock.ResourceInfo(
        kind="KopfPeering", singular="kopfpeering", namespaced=True, verbs=ALL_VERBS
    ),
    kmock.resource("kopf.dev", "v1", "clusterkopfpeerings"): kmock.ResourceInfo(
        kind="ClusterKopfPeering", singular="clusterkopfpeering", namespaced=False, verbs=ALL_VERBS
    ),
}

# Field selectors the apiserver accepts besides metadata.name/namespace (the rest is a 400 there too).
_EXTRA_FIELD_LABELS: Final[dict[str, frozenset[str]]] = {
    "Pod": frozenset(
        {
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        }
    ),
    "Event": frozenset(
        {
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
        }
    ),
    "Namespace": frozenset({"status.phase"}),
}

# Set by the server; a client's value is ignored on create and on update the stored one is kept.
_SERVER_METADATA: Final = (
    "uid",
    "creationTimestamp",
    "generation",
    "resourceVersion",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
    "managedFields",
)
_DNS1123_SUBDOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1123_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# The apiserver's generateName alphabet (no vowels, no look-alike digits).
_NAME_ALPHABET: Final = "bcdfghjklmnpqrstvwxz2456789"
_NAMESPACE_PATH: Final = re.compile(
    r"/api/v1/namespaces(?:/(?P<name>[^/]+)(?:/(?P<sub>status|finalize))?)?/?"
)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _group_version(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)


# -- errors ----------------------------------------------------------------------------------------


class ApiError(Exception):
    """An answer of the apiserver other than success, rendered as a `Status` object."""

    def __init__(self, code: int, reason: str, message: str, details: JSON | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> JSON:
        body: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _details(resource: kmock.resource, name: str | None, **extra: Any) -> JSON:
    details: JSON = {"group": resource.group or "", "kind": resource.plural}
    if name:
        details["name"] = name
    return details | extra


def _qualified(resource: kmock.resource) -> str:
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def _not_found(resource: kmock.resource, name: str | None) -> ApiError:
    return ApiError(404, "NotFound", f'{_qualified(resource)} "{name}" not found', _details(resource, name))


def _conflict(resource: kmock.resource, name: str, why: str) -> ApiError:
    message = f'Operation cannot be fulfilled on {_qualified(resource)} "{name}": {why}'
    return ApiError(409, "Conflict", message, _details(resource, name))


def _bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _cause_reason(text: str) -> str:
    # The apiserver's own field error wording first (field.Error: "Invalid value: ...", "Forbidden: ...").
    for prefix, reason in (
        ("Invalid value", "FieldValueInvalid"),
        ("Forbidden", "FieldValueForbidden"),
        ("Required value", "FieldValueRequired"),
        ("Unsupported value", "FieldValueNotSupported"),
        ("Duplicate value", "FieldValueDuplicate"),
    ):
        if text.startswith(prefix):
            return reason
    if "required" in text:
        return "FieldValueRequired"
    if "unsupported value" in text:
        return "FieldValueNotSupported"
    if "duplicate" in text:
        return "FieldValueDuplicate"
    if "forbidden" in text.lower():
        return "FieldValueForbidden"
    return "FieldValueInvalid"


def _invalid(kind: str, resource: kmock.resource, name: str | None, errors: list[str]) -> ApiError:
    """422 Invalid, as the apiserver words it; crdcheck's "path: reason" lines become the causes."""
    causes = []
    for line in errors:
        field, sep, reason = line.partition(": ")
        field, reason = (field, reason) if sep else ("", line)
        causes.append({"reason": _cause_reason(reason), "message": line, "field": field})
    listed = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    title = f"{kind}.{resource.group}" if resource.group else kind
    message = f'{title} "{name or ""}" is invalid: {listed}'
    details = {"name": name or "", "group": resource.group or "", "kind": kind, "causes": causes}
    return ApiError(422, "Invalid", message, details)


# -- selectors -------------------------------------------------------------------------------------

_KEY: Final = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_SET_REQ: Final = re.compile(rf"\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s+\((?P<values>[^)]*)\)\s*")
_EQ_REQ: Final = re.compile(rf"\s*(?P<key>{_KEY})\s*(?P<op>==|!=|=)\s*(?P<value>[^,=!()\s]*)\s*")
_CMP_REQ: Final = re.compile(rf"\s*(?P<key>{_KEY})\s*(?P<op>[<>])\s*(?P<value>-?[0-9]+)\s*")
_EXISTS_REQ: Final = re.compile(rf"\s*(?P<neg>!?)\s*(?P<key>{_KEY})\s*")


@dataclasses.dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    op: str  # exists, !, =, !=, in, notin, <, >
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, Any]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        match self.op:
            case "exists":
                return present
            case "!":
                return not present
            case "=":
                return present and value == self.values[0]
            case "!=":
                return value != self.values[0]
            case "in":
                return present and value in self.values
            case "notin":
                return value not in self.values
            case _:  # < and >, integers only
                try:
                    number = int(value)  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    return False
                limit = int(self.values[0])
                return number < limit if self.op == "<" else number > limit


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b` is two requirements."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += {"(": 1, ")": -1}.get(char, 0)
        current.append(char)
    parts.append("".join(current))
    return [part for part in parts if part.strip()]


def parse_label_selector(text: str) -> list[Requirement]:
    """Equality-based and set-based label selectors (kubernetes.io/docs/concepts/overview/.../labels)."""
    requirements = []
    for part in _split_top_level(text):
        if match := _SET_REQ.fullmatch(part):
            values = tuple(v.strip() for v in match["values"].split(",") if v.strip())
            requirements.append(Requirement(match["key"], match["op"], values))
        elif match := _EQ_REQ.fullmatch(part):
            op = "!=" if match["op"] == "!=" else "="
            requirements.append(Requirement(match["key"], op, (match["value"],)))
        elif match := _CMP_REQ.fullmatch(part):
            requirements.append(Requirement(match["key"], match["op"], (match["value"],)))
        elif match := _EXISTS_REQ.fullmatch(part):
            requirements.append(Requirement(match["key"], "!" if match["neg"] else "exists"))
        else:
            raise _bad_request(f"unable to parse requirement: {part.strip()!r} in labelSelector {text!r}")
    return requirements


def parse_field_selector(text: str, kind: str) -> list[Requirement]:
    allowed = {"metadata.name", "metadata.namespace"} | _EXTRA_FIELD_LABELS.get(kind, frozenset())
    requirements = []
    for part in _split_top_level(text):
        match = _EQ_REQ.fullmatch(part)
        if match is None:
            raise _bad_request(f"invalid selector: {part.strip()!r}; can't understand fieldSelector {text!r}")
        if match["key"] not in allowed:
            raise _bad_request(f'field label not supported: "{match["key"]}"')
        op = "!=" if match["op"] == "!=" else "="
        requirements.append(Requirement(match["key"], op, (match["value"],)))
    return requirements


def _field_value(obj: Mapping[str, Any], path: str) -> str | None:
    value: Any = obj
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping) and path == "source":
        return value.get("component")
    return str(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    """Which objects a list, watch or deletecollection request is about."""

    namespace: str | None
    name: str | None = None
    labels: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()

    def matches(self, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        if self.name is not None and meta.get("name") != self.name:
            return False
        labels = meta.get("labels") or {}
        if not all(req.matches(labels) for req in self.labels):
            return False
        if self.fields:
            values = {req.key: _field_value(obj, req.key) for req in self.fields}
            # metadata.namespace of a cluster-scoped object is "" for field selectors.
            present = {key: ("" if value is None else value) for key, value in values.items()}
            return all(req.matches(present) for req in self.fields)
        return True


# -- patches ---------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _spec_part(obj: Mapping[str, Any]) -> JSON:
    """What generation tracks: everything but metadata and status."""
    return {key: value for key, value in obj.items() if key not in ("metadata", "status")}


# -- the emulator ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """One write, as watchers see it. `old` lets a selector-filtered watch turn it into ADDED/DELETED."""

    rv: int
    resource: kmock.resource
    type: str
    obj: JSON
    old: JSON | None


def _rbac_enabled() -> bool:
    return os.environ.get(RBAC_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def default_crds() -> list[JSON]:
    """Elastune's CRDs, built from the pydantic models: the same documents as crds/*.yaml."""
    return [build_crd(model) for model in RESOURCE_MODELS.values()]


@attrs.define(kw_only=True)
class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the apiserver semantics the operator relies on (module docstring).

    State lives in `_live` (the current objects) and is mirrored into kmock's `objects` (with history,
    for assertions). Every method that writes is synchronous, so a write is atomic on the event loop.
    """

    crds: list[JSON] = attrs.field(factory=default_crds)
    extra_resources: Mapping[kmock.resource, kmock.ResourceInfo] = attrs.field(factory=dict)
    # Bounded memory for long benchmarks: versions kept per object, changes kept for watch resumption,
    # requests kept for kmock's request assertions.
    max_history: int | None = 32
    max_event_log: int = 20_000
    # Small on purpose: kmock walks the whole request log on every request (its reactions count past
    # matches), which made each write O(requests so far) — 57 ms per patch after 200 objects at 2,000.
    max_request_log: int | None = 64
    # A watch with allowWatchBookmarks=true gets one when idle this long: kopf restarts an idle watch
    # after 70 s (settings.watching.inactivity_timeout) and bookmarks keep its resourceVersion fresh.
    bookmark_interval: float = 30.0
    # RBAC for the requests that carry a service account's token (module docstring).
    enforce_rbac: bool = attrs.field(factory=_rbac_enabled)
    denials: list[str] = attrs.field(factory=list, init=False)

    _live: dict[ObjectKey, JSON] = attrs.field(factory=dict, init=False)
    _uids: dict[str, ObjectKey] = attrs.field(factory=dict, init=False)
    _schemas: dict[kmock.resource, JSON] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _log: list[Change] = attrs.field(factory=list, init=False)
    _log_rvs: list[int] = attrs.field(factory=list, init=False)
    _log_floor: int = attrs.field(default=0, init=False)  # the newest rv that has left the log
    _changed: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _orphaning: set[str] = attrs.field(factory=set, init=False)  # uids deleted with Orphan policy
    _request_ids: Iterator[int] = attrs.field(factory=itertools.count, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _tokens: authn.Tokens = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # The base registers fallbacks bound to self._serve_*: the overrides below are what they call.
        super().__attrs_post_init__()
        self._tokens = authn.Tokens(self._account_uid)
        # kmock guesses no action for PUT (replace) and for DELETE on a collection.
        self.fallback[enums.method.PUT] << self._serve_replace
        self.fallback[enums.method.DELETE] << self._serve_delete_collection
        with warnings.catch_warnings():  # kmock 0.8 uses the deprecated importlib.resources.read_binary
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()
        for resource, info in (EXTRA_RESOURCES | dict(self.extra_resources)).items():
            self.resources[resource] = info
        self._ensure_namespace("default")
        for crd in self.crds:
            self.create_object(CRD_RESOURCE, None, crd)

    # -- HTTP entry ---------------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # Mirrors kmock's RawHandler.__call__, plus: our own path parsing (namespaces), Status bodies for
        # API errors (expected answers, so they are not collected into kmock's `errors`), bounded logs.
        await raw_request.read()
        raw_response: aiohttp.web.StreamResponse | None = None
        try:
            request_id = next(self._request_ids)
            if self.limit is not None and request_id >= self.limit:
                raise kmock.KMockError("Too many requests have been served so far.")
            # Authentication and authorization come before any handler, as the apiserver's filters do.
            attributes = self._authorize(raw_request)
            if _is_token_request(attributes):
                return await self._serve_token_request(raw_request, attributes)
            request = await self._parse_request(raw_request, request_id)
            self._requests.append(request)
            self._trim_request_logs()
            try:
                return await self._handle(request)
            except rendering.StreamingError as exc:
                raw_response = exc.args[0]
                raise exc.__cause__ or exc from None
        except (ApiError, kmock.KubernetesError) as exc:
            error = exc if isinstance(exc, ApiError) else _from_kmock_error(exc)
            if raw_response is not None and raw_response.prepared:
                await raw_response.write(
                    json.dumps({"type": "ERROR", "object": error.status()}).encode() + b"\n"
                )
                await raw_response.write_eof()
                return raw_response
            return aiohttp.web.json_response(error.status(), status=error.code)
        except Exception as exc:
            logger.exception("emulator failed on %s %s", raw_request.method, raw_request.path_qs)
            if not self._errors:
                raise
            self._errors[-1].append(exc)
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(exc)
            await self._stream_error(exc, raw_response)
            await raw_response.write_eof()
            return raw_response

    # -- authentication and authorization ---------------------------------------------------------------

    def _account_uid(self, namespace: str, name: str) -> str | None:
        account = self._live.get((SERVICE_ACCOUNTS, namespace, name))
        return None if account is None else account["metadata"]["uid"]

    def _rbac_objects(self, plural: str, namespace: str | None) -> list[JSON]:
        resource = kmock.resource(rbac.GROUP, "v1", plural)
        return [
            obj
            for (res, ns, _name), obj in self._live.items()
            if res == resource and (namespace is None or ns == namespace)
        ]

    def _authorize(self, raw: aiohttp.web.BaseRequest) -> rbac.Attributes:
        """401 for a token this emulator did not issue, 403 for what RBAC does not grant (when enforced)."""
        attributes = rbac.attributes(raw.method, raw.path, raw.query)
        if not self.enforce_rbac:
            return attributes
        user = self._tokens.authenticate(raw.headers.get("Authorization", ""))
        if user is None:
            self._record_denial(
                f"Unauthorized: {raw.method} {raw.path} with a token this emulator did not issue"
            )
            raise ApiError(401, "Unauthorized", "Unauthorized")
        decision = rbac.authorize(user, attributes, self._rbac_objects)
        if decision.allowed:
            return attributes
        message = rbac.forbidden_message(user, attributes, decision.reason)
        self._record_denial(message)
        details = {"name": attributes.name, "group": attributes.api_group, "kind": attributes.resource}
        raise ApiError(403, "Forbidden", message, {key: value for key, value in details.items() if value})

    def _record_denial(self, message: str) -> None:
        self.denials.append(message)
        del self.denials[:-1000]
        logger.warning("RBAC denied: %s", message)
        if path := os.environ.get(RBAC_LOG_ENV):
            with open(path, "a", encoding="utf-8") as log:
                log.write(message + "\n")

    async def _serve_token_request(
        self, raw: aiohttp.web.BaseRequest, attributes: rbac.Attributes
    ) -> aiohttp.web.StreamResponse:
        """TokenRequest: a token for the service account (what the kubelet projects into a pod)."""
        body = await raw.read()
        try:
            request = json.loads(body) if body else {}
        except ValueError as exc:
            raise _bad_request(f"the request body is not JSON: {exc}") from exc
        answer = self._tokens.issue(
            attributes.namespace, attributes.name, request if isinstance(request, dict) else {}
        )
        if answer is None:
            raise _not_found(SERVICE_ACCOUNTS, attributes.name)
        return aiohttp.web.json_response(answer, status=201)

    async def _parse_request(self, raw: aiohttp.web.BaseRequest, request_id: int) -> rendering.Request:
        match = _NAMESPACE_PATH.fullmatch(raw.path)
        if match is None:
            return await rendering.Request._parse(raw, id=request_id)
        # kmock 0.8 crashes on /api/v1/namespaces (it expects a plural after a namespace).
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        method = enums.method(raw.method)
        path = parsing.ParsedPath("", "v1", "namespaces", None, match["name"], match["sub"])
        return rendering.Request(
            id=request_id,
            raw_request=raw,
            url=raw.url,
            method=method,
            params=dict(raw.query),
            headers=dict(raw.headers),
            cookies=dict(raw.cookies),
            data=data,
            body=body,
            text=body.decode("utf-8", errors="replace"),
            action=parsing.guess_k8s(path, method, dict(raw.query)),
            resource=NAMESPACES,
            namespace=None,
            name=match["name"],
            subresource=match["sub"],
        )

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle (its verbatim storage): the reactions, ours as fallbacks, decide.
        return await super(kmock.KubernetesEmulator, self)._handle(request)

    def _trim_request_logs(self) -> None:
        limit = self.max_request_log
        if limit is None or len(self._requests) <= 2 * limit:
            return
        del self._requests[:-limit]
        for payload in self._payloads:
            del payload._requests[:-limit]

    def _get_resources(self) -> list[kmock.resource]:
        # Only registered resources are discoverable (kmock would also list those of deleted CRDs).
        return list(kmock.KubernetesScaffold._get_resources(self))

    # -- resource definitions -------------------------------------------------------------------------

    def _info(self, resource: kmock.resource | None) -> kmock.ResourceInfo:
        if resource is None or resource not in self.resources:
            name = _qualified(resource) if resource is not None else "?"
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({name})")
        return self.resources[resource]

    def _kind(self, resource: kmock.resource) -> str:
        info = self._info(resource)
        return info.kind or str(resource.plural).capitalize()

    def _has_status(self, resource: kmock.resource) -> bool:
        return "status" in self._info(resource).subresources

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[resource] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs=ALL_VERBS,
                shortnames=names.get("shortNames", []),
                categories=names.get("categories", []),
                subresources=set(version.get("subresources") or {}),
            )
            self._schemas[resource] = dict(crd)

    def _unregister_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            resource = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            self._schemas.pop(resource, None)
            if resource in self.resources:
                del self.resources[resource]
            # The apiserver deletes the custom resources of a deleted CRD, finalizers or not.
            for key in [key for key in self._live if key[0] == resource]:
                self._commit(key, None, "DELETED")

    # -- the event log and commits ---------------------------------------------------------------------

    def _commit(self, key: ObjectKey, obj: JSON | None, kind: str) -> JSON:
        """Store one write under a new resourceVersion, record it for watchers; returns what was stored."""
        self._rv += 1
        old = self._live.get(key)
        source = obj if obj is not None else old
        assert source is not None
        stored = {**source, "metadata": {**source["metadata"], "resourceVersion": str(self._rv)}}
        uid = stored["metadata"]["uid"]
        if obj is None:
            del self._live[key]
            self._uids.pop(uid, None)
            self.objects[key].delete()
        else:
            self._live[key] = stored
            self._uids[uid] = key
            if key in self.objects and not self.objects[key].empty:
                self.objects[key].history.append(stored)
            else:
                self.objects[key] = stored
        history = self.objects[key].history
        if self.max_history is not None and len(history) > self.max_history:
            del history[: -self.max_history]
        self._log.append(Change(self._rv, key[0], kind, stored, old))
        self._log_rvs.append(self._rv)
        if len(self._log) > self.max_event_log:
            cut = len(self._log) - self.max_event_log // 2
            self._log_floor = self._log_rvs[cut - 1]
            del self._log[:cut], self._log_rvs[:cut]
        # Wake every watcher; each holds the event that was current when it last looked at the log.
        self._changed.set()
        self._changed = asyncio.Event()
        return stored

    def shutdown(self) -> None:
        """End every open watch stream (so that stopping the HTTP server does not wait for them)."""
        self._closing = True
        self._changed.set()

    @property
    def resource_version(self) -> int:
        return self._rv

    def get_object(self, resource: kmock.resource, namespace: str | None, name: str) -> JSON:
        """The stored object (a deep copy), or ApiError 404."""
        obj = self._live.get((resource, namespace, name))
        if obj is None:
            raise _not_found(resource, name)
        return copy.deepcopy(obj)

    def _ensure_namespace(self, name: str) -> None:
        if (NAMESPACES, None, name) in self._live:
            return
        self._commit(
            (NAMESPACES, None, name),
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {
                    "name": name,
                    "uid": str(uuid.uuid4()),
                    "creationTimestamp": _now(),
                    "labels": {"kubernetes.io/metadata.name": name},
                },
                "spec": {"finalizers": ["kubernetes"]},
                "status": {"phase": "Active"},
            },
            "ADDED",
        )

    # -- admission -----------------------------------------------------------------------------------------

    def _check_type(self, resource: kmock.resource, obj: JSON) -> None:
        group_version, kind = _group_version(resource), self._kind(resource)
        obj.setdefault("apiVersion", group_version)
        obj.setdefault("kind", kind)
        if obj["apiVersion"] != group_version or obj["kind"] != kind:
            raise _bad_request(
                f"the object's {obj['apiVersion']}, Kind={obj['kind']} does not match the requested "
                f"resource {group_version}, Kind={kind}"
            )

    def _check_metadata(self, resource: kmock.resource, meta: JSON) -> list[str]:
        errors = []
        name = meta.get("name", "")
        pattern = _DNS1123_LABEL if resource == NAMESPACES else _DNS1123_SUBDOMAIN
        limit = 63 if resource == NAMESPACES else 253
        if not isinstance(name, str) or not pattern.fullmatch(name) or len(name) > limit:
            errors.append(
                f"metadata.name: Invalid value: {json.dumps(name)}: must be a lowercase RFC 1123 name"
            )
        for field in ("labels", "annotations"):
            value = meta.get(field)
            if value is not None and (
                not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values())
            ):
                errors.append(f"metadata.{field}: Invalid value: must be a map of strings")
        finalizers = meta.get("finalizers")
        if finalizers is not None and (
            not isinstance(finalizers, list) or not all(isinstance(f, str) and f for f in finalizers)
        ):
            errors.append("metadata.finalizers: Invalid value: must be a list of non-empty strings")
        owners = meta.get("ownerReferences")
        if owners is not None:
            if not isinstance(owners, list):
                errors.append("metadata.ownerReferences: Invalid value: must be a list")
            else:
                for index, ref in enumerate(owners):
                    for required in ("apiVersion", "kind", "name", "uid"):
                        if not isinstance(ref, dict) or not ref.get(required):
                            errors.append(f"metadata.ownerReferences[{index}].{required}: Required value")
        return errors

    def _admit(
        self, resource: kmock.resource, obj: JSON, params: Mapping[str, str], old: JSON | None = None
    ) -> JSON:
        """Metadata checks for everything; custom resources as the apiextensions-apiserver admits them
        (prune, default, schema, CEL: `apiserver.admission`); `old` is the stored object on update."""
        name = obj["metadata"].get("name")
        errors = self._check_metadata(resource, obj["metadata"])
        crd = self._schemas.get(resource)
        if crd is not None:
            admitted = admission.admit(obj, old, crd)
            if admitted.unknown_fields and params.get("fieldValidation") == "Strict":
                # Strict decoding fails before validation, with 400 (what kubectl's default shows).
                fields = ", ".join(f'unknown field "{path}"' for path in admitted.unknown_fields)
                raise _bad_request(
                    f"{self._kind(resource)} in version {resource.version!r} cannot be handled: "
                    f"strict decoding error: {fields}"
                )
            obj = admitted.obj
            errors += admitted.errors
        elif resource == CRD_RESOURCE:
            errors += admission.crd_errors(obj)
        if errors:
            raise _invalid(self._kind(resource), resource, name, errors)
        return obj

    # -- writes (synchronous, hence atomic on the loop) ---------------------------------------------------

    def create_object(
        self,
        resource: kmock.resource,
        namespace: str | None,
        body: Any,
        params: Mapping[str, str] | None = None,
    ) -> JSON:
        params = params or {}
        info = self._info(resource)
        if not isinstance(body, dict):
            raise _bad_request("the request body must be a JSON object")
        obj = copy.deepcopy(body)
        self._check_type(resource, obj)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise _bad_request("metadata must be an object")
        if info.namespaced:
            if namespace is None:
                raise ApiError(
                    405, "MethodNotAllowed", "create a namespaced object through its namespace's URL"
                )
            if meta.get("namespace", namespace) != namespace:
                raise _bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
        elif namespace is not None:
            raise _not_found(resource, meta.get("name"))
        else:
            meta.pop("namespace", None)
        for field in _SERVER_METADATA:
            meta.pop(field, None)
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise _invalid(
                    self._kind(resource),
                    resource,
                    None,
                    ["metadata.name: Required value: name or generateName is required"],
                )
            while True:
                meta["name"] = prefix + "".join(random.choices(_NAME_ALPHABET, k=5))
                if (resource, meta.get("namespace"), meta["name"]) not in self._live:
                    break
        if self._has_status(resource):
            obj.pop("status", None)  # the status subresource owns it; a create cannot set it
        obj = self._admit(resource, obj, params)
        key: ObjectKey = (resource, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in self._live:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{_qualified(resource)} "{key[2]}" already exists',
                _details(resource, key[2]),
            )
        obj["metadata"] |= {"uid": str(uuid.uuid4()), "creationTimestamp": _now(), "generation": 1}
        if params.get("dryRun") == "All":
            return obj
        if resource == CRD_RESOURCE:
            try:
                self._register_crd(obj)
            except (KeyError, TypeError) as exc:
                raise _invalid(
                    "CustomResourceDefinition", resource, key[2], [f"spec: Invalid value: {exc}"]
                ) from exc
        if key[1] is not None:
            self._ensure_namespace(key[1])
        return copy.deepcopy(self._commit(key, obj, "ADDED"))

    def update_object(
        self,
        resource: kmock.resource,
        namespace: str | None,
        name: str,
        subresource: str | None,
        change: Callable[[JSON], Any],
        params: Mapping[str, str] | None = None,
    ) -> JSON:
        """Apply `change` (a patch, or a replacement) to the stored object as the apiserver would."""
        params = params or {}
        if subresource not in (None, "status") or (
            subresource == "status" and not self._has_status(resource)
        ):
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource ({_qualified(resource)}/{subresource})",
            )
        key: ObjectKey = (resource, namespace, name)
        old = self._live.get(key)
        if old is None:
            raise _not_found(resource, name)
        # Stored objects are never mutated in place (watch events and kmock's history share them).
        base = copy.deepcopy(old)
        candidate = change(copy.deepcopy(old))
        if not isinstance(candidate, dict) or not isinstance(candidate.get("metadata", {}), dict):
            raise _bad_request("the patched object must be a JSON object with object metadata")
        # A resourceVersion or uid sent with an update is a precondition, as on the apiserver.
        wanted = candidate.get("metadata") or {}
        if wanted.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"]):
            raise _conflict(
                resource,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if wanted.get("uid") not in (None, "", old["metadata"]["uid"]):
            raise _conflict(
                resource,
                name,
                f"Precondition failed: UID in precondition: {wanted['uid']}, UID in object meta: "
                f"{old['metadata']['uid']}",
            )
        if subresource == "status":
            # /status changes status only: spec and metadata come from the stored object.
            new = {key_: value for key_, value in base.items() if key_ != "status"}
            if candidate.get("status") is not None:
                new["status"] = candidate["status"]
        else:
            new = candidate
            if self._has_status(resource):  # else status is an ordinary field (e.g. kopf's peerings)
                new.pop("status", None)
                if "status" in base:
                    new["status"] = base["status"]
        self._check_type(resource, new)
        if new["apiVersion"] != old["apiVersion"] or new["kind"] != old["kind"]:
            raise _bad_request("apiVersion and kind cannot be changed")
        meta = new.setdefault("metadata", {})
        if meta.get("name", name) != name or meta.get("namespace", namespace) != namespace:
            raise _bad_request("the name and namespace of the object cannot be changed")
        for field in (*_SERVER_METADATA, "name", "namespace"):
            meta.pop(field, None)
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
        deleting = "deletionTimestamp" in old["metadata"]
        added = set(meta.get("finalizers") or []) - set(old["metadata"].get("finalizers") or [])
        if deleting and added:
            raise _invalid(
                self._kind(resource),
                resource,
                name,
                [
                    f"metadata.finalizers: Forbidden: no new finalizers can be added if the object "
                    f"is being deleted, found new finalizers {sorted(added)}"
                ],
            )
        new = self._admit(resource, new, params, old)
        if new == old:
            return copy.deepcopy(old)  # a no-op write bumps nothing and tells no watcher
        if _spec_part(new) != _spec_part(old):
            meta = new["metadata"]
            meta["generation"] = int(meta.get("generation", 0)) + 1
        if params.get("dryRun") == "All":
            return new
        if deleting and not new["metadata"].get("finalizers"):
            # The last finalizer is gone: the object goes (watchers see DELETED, the caller the final state).
            self._live[key] = new
            return copy.deepcopy(self._remove(key))
        if resource == CRD_RESOURCE:
            self._register_crd(new)
        return copy.deepcopy(self._commit(key, new, "MODIFIED"))

    def delete_object(
        self,
        resource: kmock.resource,
        namespace: str | None,
        name: str,
        options: Mapping[str, Any] | None = None,
    ) -> JSON:
        """DELETE: mark for deletion while finalizers remain, else remove (then garbage-collect)."""
        options = options or {}
        key: ObjectKey = (resource, namespace, name)
        old = self._live.get(key)
        if old is None:
            raise _not_found(resource, name)
        preconditions = options.get("preconditions") or {}
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) not in (None, old["metadata"][field]):
                raise _conflict(
                    resource,
                    name,
                    f"Precondition failed: {field} in precondition: "
                    f"{preconditions[field]}, {field} in object meta: "
                    f"{old['metadata'][field]}",
                )
        policy = options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is True:
            policy = "Orphan"
        if policy == "Orphan":
            self._orphaning.add(old["metadata"]["uid"])
        if "deletionTimestamp" in old["metadata"]:
            return copy.deepcopy(old)
        if old["metadata"].get("finalizers"):
            meta = old["metadata"] | {"deletionTimestamp": _now(), "deletionGracePeriodSeconds": 0}
            # The apiserver bumps generation when it sets deletionTimestamp (rest.BeforeDelete).
            meta["generation"] = int(meta.get("generation", 0)) + 1
            return copy.deepcopy(self._commit(key, {**old, "metadata": meta}, "MODIFIED"))
        return copy.deepcopy(self._remove(key))

    def _remove(self, key: ObjectKey) -> JSON:
        """Remove the object for good and collect what depended on it (background propagation)."""
        final = self._commit(key, None, "DELETED")
        uid = final["metadata"]["uid"]
        orphan = uid in self._orphaning
        self._orphaning.discard(uid)
        if key[0] == NAMESPACES:
            for child in [k for k in self._live if k[1] == key[2]]:
                if child in self._live:
                    self.delete_object(*child)
        if key[0] == CRD_RESOURCE:
            self._unregister_crd(final)
        self._collect_dependents(uid, orphan=orphan)
        return final

    def _collect_dependents(self, owner_uid: str, *, orphan: bool) -> None:
        """The garbage collector's job, done at once: drop dangling owner references; delete the dependents
        left without any live owner (unless orphaned)."""
        dependents = [
            key
            for key, obj in self._live.items()
            if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or [])
        ]
        for key in dependents:
            obj = self._live.get(key)
            if obj is None:  # already collected through another owner
                continue
            refs = obj["metadata"].get("ownerReferences") or []
            remaining = [ref for ref in refs if ref.get("uid") != owner_uid]
            if orphan or any(ref.get("uid") in self._uids for ref in remaining):
                meta = {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}
                if remaining:
                    meta["ownerReferences"] = remaining
                self._commit(key, {**obj, "metadata": meta}, "MODIFIED")
            else:
                self.delete_object(*key)

    # -- reads ----------------------------------------------------------------------------------------

    def _selection(self, request: rendering.Request) -> Selection:
        params = request.params
        kind = self._kind(request.resource) if request.resource is not None else ""
        return Selection(
            namespace=request.namespace,
            name=request.name,
            labels=tuple(parse_label_selector(params.get("labelSelector", ""))),
            fields=tuple(parse_field_selector(params.get("fieldSelector", ""), kind)),
        )

    def list_objects(self, resource: kmock.resource, selection: Selection) -> list[JSON]:
        self._info(resource)
        keys = sorted((k for k in self._live if k[0] == resource), key=lambda k: (k[1] or "", k[2]))
        return [copy.deepcopy(self._live[k]) for k in keys if selection.matches(self._live[k])]

    def _list_body(self, resource: kmock.resource, items: list[JSON], cont: str = "") -> JSON:
        meta: JSON = {"resourceVersion": str(self._rv)}
        if cont:
            meta["continue"] = cont
        return {
            "apiVersion": _group_version(resource),
            "kind": f"{self._kind(resource)}List",
            "metadata": meta,
            "items": items,
        }

    # -- kmock fallbacks (called with the parsed request) --------------------------------------------

    @staticmethod
    def _ok(payload: JSON, status: int = 200) -> rendering.Response:
        # Always a Response with an explicit status: kmock copies it onto the shared fallback reaction.
        return rendering.Response(status=status, payload=payload)

    def _require_resource(self, request: rendering.Request) -> kmock.resource:
        self._info(request.resource)
        assert request.resource is not None
        return request.resource

    def _serve_fetch(self, request: rendering.Request) -> rendering.Response:  # type: ignore[override]
        resource = self._require_resource(request)
        if request.subresource not in (None, "status"):
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource "
                f"({_qualified(resource)}/{request.subresource})",
            )
        assert request.name is not None
        return self._ok(self.get_object(resource, request.namespace, request.name))

    def _serve_list(self, request: rendering.Request) -> rendering.Response:  # type: ignore[override]
        resource = self._require_resource(request)
        items = self.list_objects(resource, self._selection(request))
        # limit/continue: the continue token is the offset of the next item (lists are sorted by key).
        offset = _int_param(request.params, "continue")
        limit = _int_param(request.params, "limit")
        if limit > 0:
            chunk = items[offset : offset + limit]
            cont = str(offset + limit) if offset + limit < len(items) else ""
            return self._ok(self._list_body(resource, chunk, cont))
        return self._ok(self._list_body(resource, items[offset:]))

    def _serve_create(self, request: rendering.Request) -> rendering.Response:  # type: ignore[override]
        resource = self._require_resource(request)
        if request.name is not None or request.subresource is not None:
            raise ApiError(405, "MethodNotAllowed", "POST is only served on collections")
        return self._ok(self.create_object(resource, request.namespace, request.data, request.params), 201)

    def _serve_update(self, request: rendering.Request) -> rendering.Response:  # type: ignore[override]
        resource = self._require_resource(request)
        assert request.name is not None
        content_type = _header(request, "Content-Type").split(";")[0].strip().lower()
        custom = resource in self._schemas
        patch = request.data
        change: Callable[[JSON], Any]
        if content_type == "application/json-patch+json":
            if not isinstance(patch, list):
                raise _bad_request("a JSON patch must be a list of operations")
            change = _json_patcher(patch, resource, request.name)
        elif content_type == "application/merge-patch+json" or (
            content_type == "application/strategic-merge-patch+json" and not custom
        ):
            if not isinstance(patch, dict):
                raise _bad_request("a merge patch must be a JSON object")
            change = lambda obj: merge_patch(obj, patch)  # noqa: E731
        else:
            supported = "application/json-patch+json, application/merge-patch+json"
            supported += "" if custom else ", application/strategic-merge-patch+json"
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: "
                f"{supported}",
            )
        return self._ok(
            self.update_object(
                resource, request.namespace, request.name, request.subresource, change, request.params
            )
        )

    def _serve_replace(self, request: rendering.Request) -> rendering.Response:
        resource = self._require_resource(request)
        if request.name is None:
            raise ApiError(405, "MethodNotAllowed", "PUT is only served on objects")
        body = request.data
        if not isinstance(body, dict):
            raise _bad_request("the request body must be a JSON object")
        if (body.get("metadata") or {}).get("name", request.name) != request.name:
            raise _bad_request("the name of the object does not match the name on the URL")
        updated = self.update_object(
            resource,
            request.namespace,
            request.name,
            request.subresource,
            lambda _old: copy.deepcopy(body),
            request.params,
        )
        return self._ok(updated)

    def _serve_delete(self, request: rendering.Request) -> rendering.Response:  # type: ignore[override]
        resource = self._require_resource(request)
        assert request.name is not None
        options = dict(request.data) if isinstance(request.data, dict) else {}
        if "propagationPolicy" in request.params:
            options["propagationPolicy"] = request.params["propagationPolicy"]
        return self._ok(self.delete_object(resource, request.namespace, request.name, options))

    def _serve_delete_collection(self, request: rendering.Request) -> rendering.Response:
        resource = self._require_resource(request)
        options = dict(request.data) if isinstance(request.data, dict) else {}
        if "propagationPolicy" in request.params:
            options["propagationPolicy"] = request.params["propagationPolicy"]
        deleted = []
        for obj in self.list_objects(resource, self._selection(request)):
            meta = obj["metadata"]
            key: ObjectKey = (resource, meta.get("namespace"), meta["name"])
            if key in self._live:
                deleted.append(self.delete_object(*key, options=options))
        return self._ok(self._list_body(resource, deleted))

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:  # type: ignore[override]
        resource = self._require_resource(request)
        selection = self._selection(request)  # a bad selector fails here, before the stream starts
        params = request.params
        bookmarks = params.get("allowWatchBookmarks") == "true"
        timeout = _int_param(params, "timeoutSeconds") or None
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        since = params.get("resourceVersion") or "0"
        if not since.isdigit():
            raise _bad_request(f"invalid resourceVersion {since!r}")
        cursor = int(since)
        yield b""  # send the headers: the stream is open even if nothing happens
        if cursor == 0 or params.get("sendInitialEvents") == "true":
            # "Any"/initial events: the current state as ADDED, then everything after it.
            cursor = self._rv
            for obj in self.list_objects(resource, selection):
                yield {"type": "ADDED", "object": obj}
            if params.get("sendInitialEvents") == "true" and bookmarks:
                yield {"type": "BOOKMARK", "object": self._bookmark(resource, initial_end=True)}
        while not self._closing:
            if cursor < self._log_floor:
                gone = ApiError(410, "Expired", f"too old resource version: {cursor} ({self._log_floor + 1})")
                yield {"type": "ERROR", "object": gone.status()}
                return
            waiter = self._changed  # taken before reading the log, so no write can slip in between
            start = bisect.bisect_right(self._log_rvs, cursor)
            changes = self._log[start:]
            cursor = max(cursor, self._rv)
            for change in changes:
                if change.resource == resource and (event := _watch_event(change, selection)) is not None:
                    yield event
            loop_time = asyncio.get_running_loop().time()
            wait = self.bookmark_interval if bookmarks else None
            if deadline is not None:
                if loop_time >= deadline:
                    return
                wait = deadline - loop_time if wait is None else min(wait, deadline - loop_time)
            try:
                await asyncio.wait_for(waiter.wait(), wait)
            except TimeoutError:
                if bookmarks and (deadline is None or asyncio.get_running_loop().time() < deadline):
                    yield {"type": "BOOKMARK", "object": self._bookmark(resource)}

    def _bookmark(self, resource: kmock.resource, *, initial_end: bool = False) -> JSON:
        meta: JSON = {"resourceVersion": str(self._rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"apiVersion": _group_version(resource), "kind": self._kind(resource), "metadata": meta}


def _is_token_request(attributes: rbac.Attributes) -> bool:
    return (
        attributes.verb == "create"
        and attributes.api_group == ""
        and attributes.resource == "serviceaccounts"
        and attributes.subresource == "token"
        and bool(attributes.namespace and attributes.name)
    )


def _watch_event(change: Change, selection: Selection) -> JSON | None:
    """What a watch with this selection sees of a change (selectors turn MODIFIED into ADDED/DELETED)."""
    now = selection.matches(change.obj)
    if change.type != "MODIFIED":
        return {"type": change.type, "object": change.obj} if now else None
    before = change.old is not None and selection.matches(change.old)
    if now:
        return {"type": "MODIFIED" if before else "ADDED", "object": change.obj}
    return {"type": "DELETED", "object": change.obj} if before else None


def _int_param(params: Mapping[str, str], name: str) -> int:
    value = params.get(name) or "0"
    if not value.isdigit():
        raise _bad_request(f"invalid {name} {value!r}")
    return int(value)


def _header(request: rendering.Request, name: str) -> str:
    lowered = name.lower()
    return next((value for key, value in request.headers.items() if key.lower() == lowered), "")


def _json_patcher(ops: list[Any], resource: kmock.resource, name: str) -> Callable[[JSON], Any]:
    def apply(obj: JSON) -> Any:
        try:
            return jsonpatch.JsonPatch(ops).apply(obj)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, TypeError) as exc:
            # A failed `test` (kopf's resourceVersion guard) included: kopf expects 422 and retries.
            raise ApiError(
                422,
                "Invalid",
                f"the server rejected our request due to an error in our request: {exc}",
                _details(resource, name),
            ) from exc

    return apply


def _from_kmock_error(exc: kmock.KubernetesError) -> ApiError:
    reason = {404: "NotFound", 409: "AlreadyExists"}.get(exc.status, "InternalError")
    return ApiError(exc.status, reason, exc.message or repr(exc))


# -- running it -----------------------------------------------------------------------------------------


def write_kubeconfig(path: Path | str, url: str, *, namespace: str = "default") -> Path:
    """A kubeconfig with one context pointing at `url` (plain HTTP; a dummy token, ignored)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = "elastune-emulator"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": url}}],
        "users": [{"name": name, "user": {"token": "emulator"}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


async def serve(
    emulator: ApiServerEmulator, host: str = "127.0.0.1", port: int = 0
) -> tuple[aiohttp.web.BaseRunner, str]:
    """Serve an entered emulator over HTTP; returns the runner (cleanup() stops it) and the URL."""
    # Not kmock.Server: that one also patches aiohttp's resolver process-wide, which in-process kopf
    # runs and other kmock servers of the same process would then depend on.
    runner = aiohttp.web.ServerRunner(
        aiohttp.web.Server(emulator, handler_cancellation=True), shutdown_timeout=1.0
    )
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{bound_host}:{bound_port}"


@dataclasses.dataclass
class EmulatorHandle:
    """A running emulator: its URL, a kubeconfig pointing at it, and how to stop it.

    `emulator` is the in-process object when it runs in a thread (None for a subprocess); touch its state
    only through `call()`, which runs on the emulator's event loop.
    """

    url: str
    kubeconfig_path: Path
    emulator: ApiServerEmulator | None
    _stop: Callable[[], None]
    _loop: asyncio.AbstractEventLoop | None = None
    process: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        self._stop()

    def __enter__(self) -> EmulatorHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a kopf (or kubectl) subprocess: KUBECONFIG set, in-cluster settings removed
        (kopf tries the in-cluster service account before the kubeconfig)."""
        env = dict(os.environ if base is None else base)
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env.pop("KUBERNETES_SERVICE_PORT", None)
        env["KUBECONFIG"] = str(self.kubeconfig_path)
        return env

    def call(self, fn: Callable[[ApiServerEmulator], T], timeout: float = 10.0) -> T:
        """Run fn(emulator) on the emulator's loop (thread mode only) and return its result."""
        if self.emulator is None or self._loop is None:
            raise RuntimeError("call() needs an emulator running in a thread of this process")
        emulator = self.emulator

        async def run() -> T:
            return fn(emulator)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)


def start_emulator(
    workdir: Path | str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    namespace: str = "default",
    subprocess_mode: bool = False,
    startup_timeout: float = 30.0,
    **options: Any,
) -> EmulatorHandle:
    """Start the emulator on a free port (port=0) and write `<workdir>/kubeconfig` pointing at it.

    By default it runs on an event loop in a daemon thread of this process (`handle.emulator` is then
    available); subprocess_mode=True runs `python -m elastune_testing.emulator` instead, which keeps
    a benchmark's operator and emulator off one GIL. `options` go to ApiServerEmulator (thread mode only).
    """
    if workdir is None:
        import tempfile

        workdir = tempfile.mkdtemp(prefix="elastune-emulator-")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig = workdir / "kubeconfig"
    if subprocess_mode:
        if options:
            raise TypeError(f"emulator options are not passed to a subprocess: {sorted(options)}")
        return _start_subprocess(workdir, kubeconfig, host, port, namespace, startup_timeout)
    return _start_thread(kubeconfig, host, port, namespace, startup_timeout, options)


def _start_thread(
    kubeconfig: Path, host: str, port: int, namespace: str, startup_timeout: float, options: Mapping[str, Any]
) -> EmulatorHandle:
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        state["stop"] = stop
        state["loop"] = asyncio.get_running_loop()
        # Built on its own loop: the asyncio primitives inside belong to this loop.
        emulator = ApiServerEmulator(**options)
        async with emulator:
            runner, url = await serve(emulator, host, port)
            try:
                write_kubeconfig(kubeconfig, url, namespace=namespace)
                state["emulator"], state["url"] = emulator, url
                ready.set()
                await stop.wait()
            finally:
                emulator.shutdown()
                await runner.cleanup()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            state["error"] = exc
            ready.set()
            raise

    thread = threading.Thread(target=run, name="k8s-api-emulator", daemon=True)
    thread.start()
    if not ready.wait(startup_timeout):
        raise TimeoutError(f"the Kubernetes API emulator did not start within {startup_timeout} s")
    if "error" in state:
        raise RuntimeError("the Kubernetes API emulator failed to start") from state["error"]
    loop: asyncio.AbstractEventLoop = state["loop"]

    def stop() -> None:
        if thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                loop.call_soon_threadsafe(state["stop"].set)
            thread.join(10.0)

    return EmulatorHandle(state["url"], kubeconfig, state["emulator"], stop, loop)


def _start_subprocess(
    workdir: Path, kubeconfig: Path, host: str, port: int, namespace: str, startup_timeout: float
) -> EmulatorHandle:
    log_path = workdir / "emulator.log"
    command = [
        sys.executable,
        "-m",
        "elastune_testing.emulator",
        "--host",
        host,
        "--port",
        str(port),
        "--kubeconfig",
        str(kubeconfig),
        "--namespace",
        namespace,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log)
    assert process.stdout is not None
    deadline = time.monotonic() + startup_timeout
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        readable, _, _ = select.select([process.stdout], [], [], max(remaining, 0))
        chunk = process.stdout.read1(4096) if readable else b""  # type: ignore[attr-defined]
        if not chunk:
            process.kill()
            process.wait()
            raise RuntimeError(
                f"the Kubernetes API emulator did not start:\n{log_path.read_text(errors='replace')}"
            )
        line += chunk
    url = line.decode().split()[-1]

    def stop() -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()

    return EmulatorHandle(url, kubeconfig, None, stop, None, process)


async def _main_async(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    emulator = ApiServerEmulator(max_history=args.max_history)
    async with emulator:
        runner, url = await serve(emulator, args.host, args.port)
        try:
            if args.kubeconfig:
                write_kubeconfig(args.kubeconfig, url, namespace=args.namespace)
            # One line on stdout once serving: start_emulator(subprocess_mode=True) waits for it.
            print(f"READY {url}", flush=True)
            await stop.wait()
        finally:
            emulator.shutdown()
            await runner.cleanup()


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m elastune_testing.emulator",
        description="A Kubernetes API emulator with Elastune's CRDs (for tests and benchmarks).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed as 'READY <url>')")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig pointing at the emulator here")
    parser.add_argument("--namespace", default="default", help="the kubeconfig context's namespace")
    parser.add_argument(
        "--max-history", type=int, default=32, help="versions kept per object (kmock history)"
    )
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    asyncio.run(_main_async(args))


if __name__ == "__main__":
    main()
