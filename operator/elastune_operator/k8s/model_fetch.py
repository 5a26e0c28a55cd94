"""A WarmPool's model fetched before its workers start: the ``<pool>-model-fetch`` Job and what it says.

For an ``hf://``, ``s3://`` or ``pvc://`` model (contract/model_source.py) the operator runs one Job
(batch/v1) in the pool's namespace: the worker image's ``python -m elastune_worker.model_fetch`` with
the cache claim (``spec.modelSource.cacheClaim``) mounted read-write, the token from the Secret the pool
names as ``HF_TOKEN`` (secretKeyRef, key ``token``; s3:// mounts the Secret as LoRAAdapters' are). Its
outcome becomes the WarmPool's ModelReady condition, the reason read from the pod's termination
message (``Reason: message``, model_fetch.py); only when it is True are the pool's workers created,
and they mount the cache read-only and load offline (``HF_HUB_OFFLINE=1``). KServe's storage
initializer and KAITO's presets fetch the same way (DESIGN.md §6).

Job semantics followed (kubernetes pkg/controller/job/job_controller.go and the batch/v1 API docs): a
Job is finished when its ``Complete`` or ``Failed`` condition is True; Failed with reason
``BackoffLimitExceeded`` after ``backoffLimit`` failed pods; pods carry the ``batch.kubernetes.io/job-name``
and ``job-name`` labels. ``terminationMessagePolicy: FallbackToLogsOnError`` makes the kubelet use the
log's tail when the file is empty (pkg/kubelet/kuberuntime, at most 80 lines / 2048 bytes), so the
fetcher's last stderr line reaches the pod status even where the file cannot be written.

The pod-template fragments for the workers (cache volume and mount, env, startupProbe) are functions
here; the workload backend puts them into the worker pod template.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Final

from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_contract.api.common import ConditionStatus
from elastune_contract.api.constants import (
    AMBIENT_CREDENTIALS,
    DEFAULT_PVC_ROOT,
    DEFAULT_S3_SECRETS_ROOT,
    GROUP,
)
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.model_source import DEFAULT_MODEL_CACHE_PATH, HF, MODEL_CACHE_ENV, PVC, S3
from elastune_contract.vocabulary import MODEL_FETCH_FAILURE_REASONS, Reason

log = logging.getLogger("elastune.model_fetch")

JOB_SUFFIX: Final = "-model-fetch"
SOURCE_ANNOTATION: Final = f"{GROUP}/model-source"
"""The canonical source a Job fetches: a Job for another source (spec.model changed) is replaced."""
FETCH_LABEL: Final = f"{GROUP}/model-fetch"
"""The fetch Job's and its pods' label: the pool's name."""
JOB_NAME_LABELS: Final = ("batch.kubernetes.io/job-name", "job-name")
BACKOFF_LIMIT: Final = 2
"""Fetch pods retried after a failure (a network blip); a wrong token fails three times the same way."""
TOKEN_KEY: Final = "token"
CACHE_VOLUME: Final = "model-cache"
PROBE_PERIOD_S: Final = 10


@dataclass(frozen=True)
class ModelState:
    """The ModelReady condition of a pool: status True, False or Unknown (still fetching)."""

    status: ConditionStatus
    reason: str
    message: str

    @property
    def ready(self) -> bool:
        return self.status == "True"


def job_name(pool: WarmPool) -> str:
    # A Job's name becomes its pods' label value: at most 63 characters.
    return f"{(pool.metadata.name or '')[: 63 - len(JOB_SUFFIX)]}{JOB_SUFFIX}"


def job_manifest(pool: WarmPool) -> dict[str, Any]:
    """The fetch Job of ``pool`` (whose model must be a fetched source)."""
    spec, src = pool.spec, pool.spec.source
    ns, secret = pool.metadata.namespace or "default", spec.fetch.secret_name
    args = ["--source", src.uri, "--cache", DEFAULT_MODEL_CACHE_PATH]
    ours = {"HF_HUB_OFFLINE": "0", MODEL_CACHE_ENV: DEFAULT_MODEL_CACHE_PATH, "HF_HUB_DISABLE_TELEMETRY": "1"}
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in ours.items()]
    # The pool's own env (HF_ENDPOINT of a mirror, proxies) applies to the fetch too, ours first.
    env += [
        e.model_dump(by_alias=True, exclude_none=True) for e in spec.worker.env or [] if e.name not in ours
    ]
    volumes: list[dict[str, Any]] = [
        {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": spec.fetch.cache_claim}}
    ]
    mounts: list[dict[str, Any]] = [{"name": CACHE_VOLUME, "mountPath": DEFAULT_MODEL_CACHE_PATH}]
    if src.kind == HF and secret:
        ref = {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}
        env = [e for e in env if e["name"] != "HF_TOKEN"] + [{"name": "HF_TOKEN", "valueFrom": ref}]
    elif src.kind == S3 and secret:
        volumes.append({"name": "s3-secret", "secret": {"secretName": secret}})
        mounts.append(
            {"name": "s3-secret", "mountPath": f"{DEFAULT_S3_SECRETS_ROOT}/{secret}", "readOnly": True}
        )
        args += ["--s3-secret", secret]
    elif src.kind == S3 and spec.fetch.use_ambient_credentials:  # the fetch pod's own identity, as asked
        args += ["--s3-secret", AMBIENT_CREDENTIALS]
    elif src.kind == PVC:
        volumes.append(
            {"name": "source", "persistentVolumeClaim": {"claimName": src.location, "readOnly": True}}
        )
        mounts.append({"name": "source", "mountPath": f"{DEFAULT_PVC_ROOT}/{src.location}", "readOnly": True})
    container = {
        "name": "fetch",
        "image": spec.worker.image,
        "command": ["python", "-m", "elastune_worker.model_fetch"],
        "args": args,
        "env": env,
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": volumes,
        "automountServiceAccountToken": False,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    # Not LABEL_WARM_POOL: that label marks worker pods, and a fetch pod is none.
    labels = {FETCH_LABEL: pool.metadata.name or ""}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(pool),
            "namespace": ns,
            "labels": {**labels, "app.kubernetes.io/managed-by": "elastune-operator"},
            "annotations": {SOURCE_ANNOTATION: src.uri},
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/v1alpha1",
                    "kind": "WarmPool",
                    "name": pool.metadata.name,
                    "uid": pool.metadata.uid or "",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


_MESSAGE = re.compile(r"^([A-Z][A-Za-z]+): (.+)$")


def termination_reason(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) from the newest failed fetch pod's termination message, the last line of the
    form ``Reason: message`` whose reason is a model fetch reason; None when no pod says one."""

    def finished(p: dict[str, Any]) -> str:
        return str(_terminated(p).get("finishedAt") or "")

    for pod in sorted(pods, key=finished, reverse=True):
        text = str(_terminated(pod).get("message") or "")
        for line in reversed(text.strip().splitlines()):
            m = _MESSAGE.match(line.strip())
            if m and m.group(1) in MODEL_FETCH_FAILURE_REASONS:
                return m.group(1), m.group(2)
    return None


def _terminated(pod: dict[str, Any]) -> dict[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        state = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get(
            "terminated"
        )
        if state:
            return dict(state)
    return {}


def job_outcome(job: dict[str, Any], pods: list[dict[str, Any]]) -> ModelState:
    """The ModelReady condition a fetch Job and its pods amount to."""
    source = ((job.get("metadata") or {}).get("annotations") or {}).get(SOURCE_ANNOTATION, "the model")
    name = (job.get("metadata") or {}).get("name", "")
    conditions = {c.get("type"): c for c in (job.get("status") or {}).get("conditions") or []}
    if (conditions.get("Complete") or {}).get("status") == "True":
        return ModelState("True", Reason.MODEL_FETCHED, f"{source} is in the model cache (Job {name})")
    failed = conditions.get("Failed") or {}
    if failed.get("status") == "True":
        said = termination_reason(pods)
        if said is not None:
            return ModelState("False", said[0], said[1])
        why = failed.get("message") or failed.get("reason") or "the fetch pods failed"
        return ModelState("False", Reason.MODEL_FETCH_FAILED, f"Job {name}: {why}")
    waiting = [
        f"{(s.get('state') or {}).get('waiting', {}).get('reason')}"
        for p in pods
        for s in (p.get("status") or {}).get("containerStatuses") or []
        if (s.get("state") or {}).get("waiting")
    ]
    detail = f" (pod waiting: {', '.join(waiting)})" if waiting else ""
    return ModelState("Unknown", Reason.MODEL_FETCHING, f"Job {name} is fetching {source}{detail}")


class ModelFetcher:
    """Runs and reads the pools' fetch Jobs (sync client; called from the control core's thread)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.batch = client.BatchV1Api(api_client)
        self.core = client.CoreV1Api(api_client)

    def state(self, pool: WarmPool) -> ModelState | None:
        """None when the pool has nothing to fetch (a built-in name); else the fetch's state, creating
        (or replacing, for a changed spec.model) the Job first."""
        if not pool.spec.source.fetched:
            return None
        ns, name = pool.metadata.namespace or "default", job_name(pool)
        try:
            job = self._read(ns, name)
            annotations = ((job or {}).get("metadata") or {}).get("annotations") or {}
            if job is not None and annotations.get(SOURCE_ANNOTATION) != pool.spec.source.uri:
                self.batch.delete_namespaced_job(name, ns, propagation_policy="Background")
                job = None
            if job is None:
                job = self.batch.api_client.sanitize_for_serialization(job_manifest(pool))
                self.batch.create_namespaced_job(ns, job)
                log.info("created Job %s/%s to fetch %s", ns, name, pool.spec.source.uri)
                return ModelState(
                    "Unknown", Reason.MODEL_FETCHING, f"Job {name} is fetching {pool.spec.source.uri}"
                )
            pods = self._pods(ns, name)
        except ApiException as exc:
            if exc.status == 409:  # the old Job is still being deleted: next round
                return ModelState("Unknown", Reason.MODEL_FETCHING, f"replacing Job {name}")
            return ModelState("Unknown", Reason.MODEL_FETCHING, f"cannot read Job {name}: {exc.reason}")
        return job_outcome(job, pods)

    def _read(self, ns: str, name: str) -> dict[str, Any] | None:
        import json

        try:
            resp: Any = self.batch.read_namespaced_job(name, ns, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        job: dict[str, Any] = json.loads(resp.data)
        return job

    def _pods(self, ns: str, name: str) -> list[dict[str, Any]]:
        import json

        resp: Any = self.core.list_namespaced_pod(
            ns, label_selector=f"job-name={name}", _preload_content=False
        )
        pods: list[dict[str, Any]] = json.loads(resp.data).get("items") or []
        return pods


# -- the worker pod template's part ------------------------------------------------------------------


def worker_volumes(pool: WarmPool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The cache claim, read-only, where the worker looks for fetched models; none for built-in names."""
    if not pool.spec.source.fetched:
        return [], []
    claim = {"claimName": pool.spec.fetch.cache_claim, "readOnly": True}
    return (
        [{"name": CACHE_VOLUME, "persistentVolumeClaim": claim}],
        [{"name": CACHE_VOLUME, "mountPath": DEFAULT_MODEL_CACHE_PATH, "readOnly": True}],
    )


def worker_env(pool: WarmPool) -> list[dict[str, Any]]:
    """Workers load offline: from the cache (fetched sources) or the image (built-in names)."""
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    if pool.spec.source.fetched:
        env.append({"name": MODEL_CACHE_ENV, "value": DEFAULT_MODEL_CACHE_PATH})
    return env


def startup_probe(pool: WarmPool, port: int = 8080) -> dict[str, Any]:
    """Liveness waits for the load: failureThreshold x periodSeconds covers spec.modelSource.loadTimeout
    (10 minutes by default), so a multi-minute weight load is not killed by a 1 s liveness probe."""
    threshold = max(1, math.ceil(pool.spec.fetch.load_timeout_seconds / PROBE_PERIOD_S))
    return {
        "httpGet": {"path": "/healthz", "port": port},
        "periodSeconds": PROBE_PERIOD_S,
        "failureThreshold": threshold,
    }


def add_to_worker(pod_spec: dict[str, Any], pool: WarmPool, port: int) -> None:
    """Put the model's part into a worker pod spec (its first container): the cache volume and its
    read-only mount, the offline env (ours win over worker.env: a worker never downloads), the
    startupProbe."""
    container = pod_spec["containers"][0]
    volumes, mounts = worker_volumes(pool)
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), *volumes]
    container["volumeMounts"] = [*container.get("volumeMounts", []), *mounts]
    ours = worker_env(pool)
    names = {e["name"] for e in ours}
    container["env"] = [*(e for e in container.get("env", []) if e["name"] not in names), *ours]
    container["startupProbe"] = startup_probe(pool, port)
