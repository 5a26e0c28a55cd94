"""Cross-namespace sharing lends GPUs only (issue 39 item 3): what a borrower may not name.

A WarmPool's pods live in its namespace, so every Secret and claim they mount, every path in their
filesystem and their cloud identity are the owner's. A TuningJob or LoRAAdapter of another namespace
that the pool admits (spec.allowedNamespaces) runs in those pods: it may name none of them. The
operator refuses it (ForeignReference) before anything is mounted, placed or dispatched for it.

What a borrower can use:

- a dataset that is a relative path without '..' (a file of the worker image, e.g. its examples);
- the default artifact and checkpoint locations, which lie under its own namespace's folder of the
  pool's jobStorage claim (``elastune/artifacts/<ns>/<job>``, ``elastune/checkpoints/<ns>/<job>``);
- for an adapter, an artifact there of its own namespace (what ``output.publish`` creates).

Its own namespace's Secrets and claims cannot reach the owner's pods (a pod mounts only its own
namespace's), so s3:// or pvc:// storage of its own needs a WarmPool of its own namespace. Pure: no I/O.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from elastune_contract import storage
from elastune_contract.api.loraadapter import LoRAAdapterSpec
from elastune_contract.api.tuningjob import TuningJobSpec

OWNER_SECRETS = "a Secret, which the pods would read from the pool's namespace"
OWNER_IDENTITY = "the pool's pods' cloud identity (useAmbientCredentials)"


def _in_image(location: str) -> bool:
    """A relative path that stays in the pod's working directory (the worker image's files)."""
    loc = storage.parse(location)
    parts = PurePosixPath(loc.path).parts
    return loc.scheme == "" and not location.startswith(("/", "~")) and ".." not in parts


def own_artifacts(namespace: str, job_storage: str | None) -> str | None:
    """The pvc:// prefix of the artifacts a borrower's jobs write on the pool (None: no jobStorage)."""
    return storage.pvc_uri(job_storage, f"elastune/artifacts/{namespace}") + "/" if job_storage else None


def _location(field: str, location: str, namespace: str, job_storage: str | None) -> str | None:
    try:
        loc = storage.parse(location)
    except ValueError as exc:  # e.g. '..' in a pvc:// path: never a borrower's
        return f"{field}: {exc}"
    if _in_image(location):
        return None
    mine = own_artifacts(namespace, job_storage)
    if mine and loc.scheme == storage.PVC and str(loc).startswith(mine):
        return None
    if loc.scheme == storage.PVC:
        return f"{field} {location} is on the pool's claim {loc.authority}"
    if loc.scheme == "s3":
        return (
            f"{field} {location} needs S3 credentials, and a borrower may use neither {OWNER_SECRETS} "
            f"nor {OWNER_IDENTITY}"
        )
    return f"{field} {location} is a path in the pool's pods (their mounts are the pool namespace's)"


def job_references(spec: TuningJobSpec, namespace: str, pool_namespace: str) -> list[str]:
    """What a TuningJob of ``namespace`` names of the pool's namespace; [] for the pool's own jobs."""
    if namespace == pool_namespace:
        return []
    found = [p for p in [_location("spec.dataset", spec.dataset, namespace, None)] if p]
    out = spec.output
    if out is not None:
        if out.uri:
            found.append(f"spec.output.uri {out.uri}: a borrower writes to the default location only")
        if out.secret_name:
            found.append(f"spec.output.secretName {out.secret_name} names {OWNER_SECRETS}")
        if out.use_ambient_credentials:
            found.append(f"spec.output.useAmbientCredentials would use {OWNER_IDENTITY}")
    return found


def adapter_references(
    spec: LoRAAdapterSpec, namespace: str, pool_namespace: str, job_storage: str | None
) -> list[str]:
    """What a LoRAAdapter of ``namespace`` names of the pool's namespace; [] for the pool's own."""
    if namespace == pool_namespace:
        return []
    found = [p for p in [_location("spec.artifactURL", spec.artifact_url, namespace, job_storage)] if p]
    if spec.artifact_secret:
        found.append(f"spec.artifactSecret {spec.artifact_secret} names {OWNER_SECRETS}")
    if spec.use_ambient_credentials:
        found.append(f"spec.useAmbientCredentials would use {OWNER_IDENTITY}")
    return found


def refusal(kind: str, namespace: str, pool: str, found: list[str]) -> str:
    """The condition's message: what was refused, why, and what a borrower can use instead."""
    return (
        f"this {kind} of namespace {namespace} runs on WarmPool {pool}, which lends its GPUs only: "
        + "; ".join(found)
        + ". A borrower may use a dataset in the worker image (a relative path), the default output "
        "(its own namespace's folder of the pool's jobStorage claim) and, for adapters, artifacts there; "
        f"for claims or Secrets of its own, create a WarmPool in {namespace}"
    )
