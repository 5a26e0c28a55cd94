"""Knative Serving's own rules for a ``serving.knative.dev/v1`` Service, for the Knative stand-ins.

Derived from knative/serving (read at 98e5ef90, Aug 2026; learned, not copied):

- Defaulting (pkg/apis/serving/v1/revision_defaults.go): an unset or zero ``timeoutSeconds`` becomes
  config-defaults ``revision-timeout-seconds`` (300; pkg/apis/config/defaults.go).
- Validation (pkg/apis/serving/v1/revision_validation.go ``validateTimeoutSeconds``): ``timeoutSeconds``
  must lie in ``[0, max-revision-timeout-seconds]`` (600 by default), else "expected 0 <= N <= 600".
- Pod spec fields (pkg/apis/serving/fieldmask.go ``PodSpecMask``, ``ContainerMask``, ``EnvVarSourceMask``):
  a few fields are always allowed; nodeSelector, affinity, tolerations, … only when their config-features
  flag is not ``Disabled`` (pkg/apis/config/features.go, all of them Disabled by default); anything else
  (terminationGracePeriodSeconds, nodeName, …) never. Env ``valueFrom.fieldRef`` needs
  ``kubernetes.podspec-fieldref``. PVC volumes need ``kubernetes.podspec-persistent-volume-claim``
  ``Enabled`` and, unless read-only, ``kubernetes.podspec-persistent-volume-write`` too
  (pkg/apis/serving/k8s_validation.go ``validatePersistentVolumeClaims``); mounts of volumes other than
  emptyDir / PVC / ephemeral must be readOnly (``validateVolumeMounts``); PORT, K_SERVICE,
  K_CONFIGURATION and K_REVISION are reserved env names (``validateEnvVar``).
- Scale annotations (pkg/apis/autoscaling/annotation_validation.go ``validateMinMaxScale``): integers
  >= 0, ``max-scale`` 0 means unbounded, else it may not be below ``min-scale``; the autoscaler reads
  them as bounds (pkg/apis/autoscaling/v1alpha1/pa_lifecycle.go ``ScaleBounds``).
- Revisions (pkg/reconciler/configuration/configuration.go): a Configuration stamps a new Revision for
  each new generation, i.e. any change to ``spec.template`` — labels and annotations included — while a
  change to the Service's own metadata is not a new generation of the template. The new Revision's
  pods replace the old one's once it is ready (the old Revision's Deployment scales to zero).

A denial has the shape the apiserver gives a validating webhook's refusal (k8s.io/apiserver
pkg/admission/plugin/webhook/errors ``ToStatusErr``; knative.dev/pkg webhook ``MakeErrorStatus``): a
``Status`` with code 400, ``Failure`` and the message ``admission webhook "<name>" denied the request:
validation failed: <field errors, one a line>``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.rest import ApiException

WEBHOOK = "validation.webhook.serving.knative.dev"
MIN_SCALE = "autoscaling.knative.dev/min-scale"
MAX_SCALE = "autoscaling.knative.dev/max-scale"
RESERVED_ENV = frozenset({"PORT", "K_SERVICE", "K_CONFIGURATION", "K_REVISION"})

ENABLED, DISABLED, ALLOWED = "Enabled", "Disabled", "Allowed"
FIELDREF = "kubernetes.podspec-fieldref"
PVC = "kubernetes.podspec-persistent-volume-claim"
PVC_WRITE = "kubernetes.podspec-persistent-volume-write"
EMPTYDIR = "kubernetes.podspec-volumes-emptydir"
POD_SPEC_FEATURES = {
    "affinity": "kubernetes.podspec-affinity",
    "topologySpreadConstraints": "kubernetes.podspec-topologyspreadconstraints",
    "hostAliases": "kubernetes.podspec-hostaliases",
    "nodeSelector": "kubernetes.podspec-nodeselector",
    "runtimeClassName": "kubernetes.podspec-runtimeclassname",
    "tolerations": "kubernetes.podspec-tolerations",
    "securityContext": "kubernetes.podspec-securitycontext",
    "shareProcessNamespace": "kubernetes.podspec-shareprocessnamespace",
    "priorityClassName": "kubernetes.podspec-priorityclassname",
    "schedulerName": "kubernetes.podspec-schedulername",
    "initContainers": "kubernetes.podspec-init-containers",
    "dnsPolicy": "kubernetes.podspec-dnspolicy",
    "dnsConfig": "kubernetes.podspec-dnsconfig",
    "hostIPC": "kubernetes.podspec-hostipc",
    "hostPID": "kubernetes.podspec-hostpid",
    "hostNetwork": "kubernetes.podspec-hostnetwork",
}
"""Pod spec field -> the config-features flag that lets it through (fieldmask.go PodSpecMask)."""
POD_SPEC_ALWAYS = frozenset(
    {"serviceAccountName", "containers", "volumes", "imagePullSecrets", "enableServiceLinks"}
)
REVISION_FIELDS = frozenset(
    {"containerConcurrency", "timeoutSeconds", "responseStartTimeoutSeconds", "idleTimeoutSeconds"}
)
CONTAINER_FIELDS = frozenset(
    {
        "name", "args", "command", "env", "workingDir", "envFrom", "image", "imagePullPolicy",
        "livenessProbe", "ports", "readinessProbe", "resources", "securityContext", "startupProbe",
        "terminationMessagePath", "terminationMessagePolicy", "volumeMounts",
    }
)  # fmt: skip
"""fieldmask.go ContainerMask: lifecycle, stdin, tty and volumeDevices are refused."""
DEFAULT_FEATURES: Mapping[str, str] = {
    **{flag: DISABLED for flag in POD_SPEC_FEATURES.values()},
    FIELDREF: DISABLED,
    PVC: DISABLED,
    PVC_WRITE: DISABLED,
    EMPTYDIR: ENABLED,
}
"""config-features as a stock install ships it (features.go defaultFeaturesConfig)."""


@dataclass(frozen=True)
class KnativeConfig:
    """The config-defaults and config-features a Knative install runs with (stock values by default)."""

    revision_timeout_seconds: int = 300
    max_revision_timeout_seconds: int = 600
    features: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_FEATURES))

    def flag(self, name: str) -> str:
        return self.features.get(name, DEFAULT_FEATURES.get(name, DISABLED))


class WebhookDenied(Exception):
    """A Service Knative's validating webhook refuses; ``status`` is the apiserver's Status body."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        message = f'admission webhook "{WEBHOOK}" denied the request: validation failed: ' + "\n".join(
            sorted(errors)
        )
        self.status: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "code": 400,
        }
        super().__init__(message)

    def as_api_exception(self) -> ApiException:
        """What the Kubernetes Python client raises on that response (the operator sees this)."""
        exc = ApiException(status=400, reason="Bad Request")
        exc.body = json.dumps(self.status)
        return exc


def default_service(svc: dict[str, Any], config: KnativeConfig | None = None) -> dict[str, Any]:
    """The Service after Knative's defaulting webhook (a copy)."""
    config = config or KnativeConfig()
    out = copy.deepcopy(svc)
    spec = out.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
    if not spec.get("timeoutSeconds"):
        spec["timeoutSeconds"] = config.revision_timeout_seconds
    return out


def validate_service(svc: dict[str, Any], config: KnativeConfig | None = None) -> list[str]:
    """Field errors as knative.dev/pkg apis.FieldError prints them (``message: path``); [] if admitted."""
    config = config or KnativeConfig()
    template = (svc.get("spec") or {}).get("template") or {}
    base = "spec.template"
    errors = _scale_errors((template.get("metadata") or {}).get("annotations") or {}, f"{base}.metadata")
    spec = template.get("spec") or {}
    errors += _pod_spec_errors(spec, config, f"{base}.spec")
    timeout = spec.get("timeoutSeconds")
    if timeout and not 0 <= int(timeout) <= config.max_revision_timeout_seconds:
        errors.append(
            f"expected 0 <= {timeout} <= {config.max_revision_timeout_seconds}: {base}.spec.timeoutSeconds"
        )
    return errors


def admit(svc: dict[str, Any], config: KnativeConfig | None = None) -> dict[str, Any]:
    """Defaulting then validation, as the two webhooks run on create and update; raises WebhookDenied."""
    out = default_service(svc, config)
    errors = validate_service(out, config)
    if errors:
        raise WebhookDenied(errors)
    return out


def _pod_spec_errors(spec: dict[str, Any], config: KnativeConfig, at: str) -> list[str]:
    errors: list[str] = []
    disallowed = []
    for key, value in spec.items():
        if key in POD_SPEC_ALWAYS or key in REVISION_FIELDS:
            continue
        if key == "automountServiceAccountToken" and value is False:
            continue  # only false may be set
        flag = POD_SPEC_FEATURES.get(key)
        if flag is not None and config.flag(flag) != DISABLED:
            continue
        disallowed.append(f"{at}.{key}")
    if disallowed:
        errors.append("must not set the field(s): " + ", ".join(sorted(disallowed)))
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    for i, vol in enumerate(spec.get("volumes") or []):
        claim = vol.get("persistentVolumeClaim")
        if claim is not None:
            name = claim.get("claimName", "")
            if config.flag(PVC) != ENABLED:
                errors.append(
                    "Persistent volume claim support is disabled, but found persistent volume claim "
                    f"{name}: {at}.volumes[{i}]"
                )
            if not claim.get("readOnly") and config.flag(PVC_WRITE) != ENABLED:
                errors.append(
                    "Persistent volume write support is disabled, but found persistent volume claim "
                    f"{name} that is not read-only: {at}.volumes[{i}]"
                )
        if "emptyDir" in vol and config.flag(EMPTYDIR) != ENABLED:
            errors.append(
                f"EmptyDir volume support is disabled, but found EmptyDir volume {vol.get('name')}: "
                f"{at}.volumes[{i}]"
            )
    for c, container in enumerate(spec.get("containers") or []):
        errors += _container_errors(container, volumes, config, f"{at}.containers[{c}]")
    return errors


def _container_errors(
    container: dict[str, Any], volumes: dict[str, Any], config: KnativeConfig, at: str
) -> list[str]:
    errors: list[str] = []
    extra = sorted(f"{at}.{k}" for k in container if k not in CONTAINER_FIELDS)
    if extra:
        errors.append("must not set the field(s): " + ", ".join(extra))
    allowed_sources = {"configMapKeyRef", "secretKeyRef"}
    if config.flag(FIELDREF) != DISABLED:
        allowed_sources |= {"fieldRef", "resourceFieldRef"}
    for i, env in enumerate(container.get("env") or []):
        if env.get("name") in RESERVED_ENV:
            errors.append(f'"{env["name"]}" is a reserved environment variable: {at}.env[{i}].name')
        bad = sorted(
            f"{at}.env[{i}].valueFrom.{k}" for k in env.get("valueFrom") or {} if k not in allowed_sources
        )
        if bad:
            errors.append("must not set the field(s): " + ", ".join(bad))
    for i, mount in enumerate(container.get("volumeMounts") or []):
        vol = volumes.get(mount.get("name"))
        if vol is None:
            errors.append(f"volumeMount has no matching volume: {at}.volumeMounts[{i}].name")
            continue
        writable_kind = any(k in vol for k in ("emptyDir", "persistentVolumeClaim", "ephemeral"))
        if not writable_kind and not mount.get("readOnly"):
            errors.append(
                f"volume mount should be readOnly for this type of volume: {at}.volumeMounts[{i}].readOnly"
            )
        claim = vol.get("persistentVolumeClaim")
        if claim is not None and claim.get("readOnly") and not mount.get("readOnly"):
            errors.append(f"volume is readOnly but volume mount is not: {at}.volumeMounts[{i}].readOnly")
    return errors


def _int_ge0(annotations: Mapping[str, str], key: str, at: str) -> tuple[int, list[str]]:
    raw = annotations.get(key)
    if raw is None:
        return 0, []
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        return 0, [f"invalid value: {raw}: {at}.annotations.{key}"]
    return value, []


def _scale_errors(annotations: Mapping[str, str], at: str) -> list[str]:
    low, errors = _int_ge0(annotations, MIN_SCALE, at)
    high, more = _int_ge0(annotations, MAX_SCALE, at)
    errors += more
    if high != 0 and high < low:
        errors.append(
            f"max-scale={high} is less than min-scale={low}: {at}.annotations.{MAX_SCALE}, "
            f"{at}.annotations.{MIN_SCALE}"
        )
    return errors


def scale_bounds(annotations: Mapping[str, str]) -> tuple[int, int | None]:
    """(min, max) pods as the autoscaler reads a Revision's annotations: min 0 when unset, max None
    (unbounded) when unset or 0; the webhook has refused anything else."""
    low = int(annotations.get(MIN_SCALE, "0") or 0)
    high = int(annotations.get(MAX_SCALE, "0") or 0)
    return low, (high or None)


def revision_hash(template: dict[str, Any]) -> str:
    """What names a Revision: the whole ``spec.template`` (metadata labels and annotations included);
    two templates with one hash are one Revision."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def makes_new_revision(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether updating Service ``old`` to ``new`` stamps a new Revision (whose pods replace the old)."""
    return revision_hash((old.get("spec") or {}).get("template") or {}) != revision_hash(
        (new.get("spec") or {}).get("template") or {}
    )
