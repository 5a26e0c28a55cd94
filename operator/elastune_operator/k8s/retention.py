"""What a TuningJob's or LoRAAdapter's deletion removes (spec.retention), and the Job that removes it.

The operator mounts no claim and never reads an S3 Secret (docs/design.md §6), so it does not delete
files itself: it runs one cleanup Job (batch/v1) in the resource's namespace, the worker image's
``python -m elastune_worker.storage.cleanup`` with the claims of the targets mounted as the workers mount
them and the resource's S3 Secret mounted read-only (as model_fetch.py runs the model fetch). A pod can
mount only claims and Secrets of its own namespace, and the cleanup deletes a location only where the
owner marker the worker wrote beside it names the resource's namespace and the owning TuningJob's uid.

Targets of a TuningJob (its WarmPool places them, control/resources.durable_storage):
- checkpoints: Delete → ``<checkpoint root>/<uid>`` on the pool's jobStorage claim, and the staging
  copy of an s3:// output there;
- artifact: Delete → the s3:// output, or the artifact's pvc:// location (status.artifactURI).
Targets of a LoRAAdapter: artifact: Delete → its artifactURL, owned by the TuningJob that published it
(its ownerReference); an adapter nobody published owns nothing. Paths in a pod's own filesystem went with
the pod and are no target.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from elastune_contract import storage
from elastune_contract.api.constants import (
    AMBIENT_CREDENTIALS,
    DEFAULT_PVC_ROOT,
    DEFAULT_S3_SECRETS_ROOT,
    GROUP,
    KIND_TUNING_JOB,
    VERSION,
    s3_credentials,
)
from elastune_contract.api.loraadapter import LoRAAdapter
from elastune_contract.api.tuningjob import TuningJob
from elastune_contract.api.warmpool import DEFAULT_WORKER_IMAGE, WarmPool
from elastune_operator.control.resources import durable_storage

PLAN_ANNOTATION: Final = f"{GROUP}/reclaim"
"""The intent, recorded on the resource before the Job is created: a restarted operator (or a pool
deleted meanwhile) finds the same targets."""
CLEANUP_LABEL: Final = f"{GROUP}/cleanup"
BACKOFF_LIMIT: Final = 2
"""Pods retried after a failure (a network blip); then the Job is Failed and the operator gives up."""
TTL_AFTER_FINISHED_S: Final = 3600


@dataclass(frozen=True)
class Plan:
    """What one deletion removes, and as whom."""

    job: str
    """Name of the cleanup Job."""
    owner_uid: str
    """The uid an owner marker must name (the TuningJob's: it wrote the files)."""
    targets: list[str] = field(default_factory=list)
    secret: str | None = None
    image: str = DEFAULT_WORKER_IMAGE

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def recorded(cls, annotations: dict[str, str] | None) -> Plan | None:
        text = (annotations or {}).get(PLAN_ANNOTATION)
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None  # not ours or damaged: computed again


def job_name(uid: str) -> str:
    return f"elastune-cleanup-{uid}"[:63]


def _reachable(uri: str) -> bool:
    """pvc:// and s3:// outlive pods; a path was in a pod's own filesystem."""
    try:
        return storage.parse(uri).scheme in (storage.PVC, "s3")
    except ValueError:
        return False


def tuning_job_plan(job: TuningJob, pool: WarmPool | None) -> Plan:
    """The targets ``job``'s deletion removes under its retention, ``pool`` the WarmPool of its model in
    its namespace (None: its claims are unknown, only s3:// and status.artifactURI are targets)."""
    uid = job.metadata.uid or ""
    retention, out = job.spec.retention, job.spec.output
    s3_out = out.uri if out and out.uri and storage.parse(out.uri).scheme == "s3" else None
    placed = None
    if pool is not None:
        try:
            placed = durable_storage(job, pool)
        except ValueError:
            placed = None  # never placed: the job was refused before it wrote anything there
    targets: list[str] = []
    if retention.checkpoints == "Delete" and placed is not None:
        targets.append(storage.join(placed.checkpoints, uid))
        if s3_out:
            targets.append(placed.artifact)  # the staging copy the worker uploaded from
    if retention.artifact == "Delete":
        status_uri = job.status.artifact_uri if job.status else None
        targets.append(s3_out or status_uri or (placed.artifact if placed else ""))
    return Plan(
        job=job_name(uid),
        owner_uid=uid,
        targets=sorted({t for t in targets if t and _reachable(t)}),
        secret=s3_credentials(out.secret_name, out.use_ambient_credentials) if s3_out and out else None,
        image=pool.spec.worker.image if pool else DEFAULT_WORKER_IMAGE,
    )


def adapter_plan(adapter: LoRAAdapter, pool: WarmPool | None) -> Plan:
    """The artifact an adapter's deletion removes: only under Delete, and only one a TuningJob published
    as this adapter (the owner marker must then name that job)."""
    owners = (adapter.metadata.model_extra or {}).get("ownerReferences") or []
    publisher = next((o.get("uid") for o in owners if o.get("kind") == KIND_TUNING_JOB), None)
    url = adapter.spec.artifact_url
    policy = adapter.spec.retention.artifact
    wanted = policy == "Delete" and publisher and _reachable(url)
    return Plan(
        job=job_name(adapter.metadata.uid or ""),
        owner_uid=str(publisher or ""),
        targets=[url] if wanted else [],
        secret=s3_credentials(adapter.spec.artifact_secret, adapter.spec.use_ambient_credentials)
        if wanted
        else None,
        image=pool.spec.worker.image if pool else DEFAULT_WORKER_IMAGE,
    )


def job_manifest(plan: Plan, kind: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The cleanup Job of ``plan`` for the resource ``kind``/``meta``, owned by it (the garbage collector
    removes the Job after the resource is gone)."""
    ns, name = meta.get("namespace") or "default", meta.get("name") or ""
    claims = sorted(
        {storage.parse(t).authority for t in plan.targets if storage.parse(t).scheme == storage.PVC}
    )
    volumes: list[dict[str, Any]] = [
        {"name": f"claim-{i}", "persistentVolumeClaim": {"claimName": c}} for i, c in enumerate(claims)
    ]
    mounts: list[dict[str, Any]] = [
        {"name": f"claim-{i}", "mountPath": f"{DEFAULT_PVC_ROOT}/{c}"} for i, c in enumerate(claims)
    ]
    args = ["--namespace", ns, "--owner-uid", plan.owner_uid]
    if plan.secret == AMBIENT_CREDENTIALS:  # the pod's own identity, as the resource asked: no volume
        args += ["--s3-secret", plan.secret]
    elif plan.secret:
        # optional: a missing Secret fails the cleanup with StorageSecretNotFound instead of leaving
        # its pod in ContainerCreating until the timeout
        volumes.append({"name": "s3-secret", "secret": {"secretName": plan.secret, "optional": True}})
        mounts.append(
            {"name": "s3-secret", "mountPath": f"{DEFAULT_S3_SECRETS_ROOT}/{plan.secret}", "readOnly": True}
        )
        args += ["--s3-secret", plan.secret]
    container = {
        "name": "cleanup",
        "image": plan.image,
        "command": ["python", "-m", "elastune_worker.storage.cleanup"],
        "args": [*args, *plan.targets],
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    labels = {CLEANUP_LABEL: name}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": plan.job,
            "namespace": ns,
            "labels": {**labels, "app.kubernetes.io/managed-by": "elastune-operator"},
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": kind,
                    "name": name,
                    "uid": meta.get("uid") or "",
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": volumes,
                    "automountServiceAccountToken": False,
                },
            },
        },
    }


def finished(job: dict[str, Any]) -> str | None:
    """Complete or Failed once the Job says so (batch/v1 conditions); None while it runs."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            return str(c["type"])
    return None
