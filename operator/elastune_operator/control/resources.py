"""From API objects to what the control core works with; shared by `elastune run` and the operator."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from elastune_contract import storage
from elastune_contract.api import units
from elastune_contract.api.constants import DEFAULT_PVC_ROOT
from elastune_contract.api.tuningjob import TuningJob, TuningJobStatus
from elastune_contract.api.warmpool import ServingSpec, VolumeMount, WarmPool
from elastune_operator.control.records import JobRecord, PoolConfig

#: Estimator defaults before a pool has a measured profile (the tiny model warms up in seconds once
#: built; real LLMs need their WarmPool's profile.coldStartSeconds).
DEFAULT_COLD_START_SECONDS = 15
DEFAULT_SECONDS_PER_ITERATION = 0.1


def _name(name: str | None) -> str:
    """metadata.name of a stored object (always set once the apiserver or a manifest named it)."""
    if not name:
        raise ValueError("the resource has no metadata.name")
    return name


def artifact_location(job: TuningJob, default_root: str) -> str:
    """Where the job's tuned prompt goes, as the workers are told: spec.output.uri, or
    ``<default_root>/artifacts/<ns>/<name>`` (a path or pvc:// URI). ValueError for a malformed URI
    (path traversal, a bad claim name) or a scheme no worker can write yet."""
    ns = job.metadata.namespace or "default"
    uri = job.spec.output.uri if job.spec.output else None
    if not uri:
        return storage.join(default_root, "artifacts", ns, _name(job.metadata.name))
    loc = storage.parse(uri)
    if loc.scheme == "s3":  # staged at the default location; the worker uploads it to the URI itself
        return storage.join(default_root, "artifacts", ns, _name(job.metadata.name))
    if not loc.is_local or (loc.scheme == "" and not uri.startswith("/")):
        raise ValueError(
            f"spec.output.uri {uri!r}: {loc.scheme or 'relative'} outputs are not supported yet; "
            "leave output unset, or use an absolute path, file:// or pvc:// URI"
        )
    return str(loc)


def artifact_dir(job: TuningJob, root: Path) -> Path:
    """Local mode: the job's artifact directory on this machine, ``root`` the state dir, which also
    stands in for the claims (``pvc://claim/path`` is ``root/volumes/claim/path``)."""
    return storage.local_path(artifact_location(job, str(root)), root=root / "volumes")


#: Where a worker pod stages an s3:// output when its pool has no jobStorage claim (its work dir).
S3_STAGING_ROOT = "/tmp/elastune"


class OutputNotDurable(ValueError):
    """On Kubernetes the job's artifact could only land in a pod's ephemeral storage."""


@dataclass(frozen=True)
class DurableStorage:
    artifact: str
    """pvc:// URI the workers write the artifact to (and the status publishes)."""
    checkpoints: str
    """pvc:// URI of the job's checkpoint root (the core appends the job's uid)."""


def durable_storage(job: TuningJob, pool: WarmPool) -> DurableStorage:
    """Kubernetes: the job's artifact and checkpoints on claims every pod of ``pool`` mounts — its
    jobStorage volume (under elastune/), else the claim of spec.output.uri. A file:// or plain output
    path is accepted only on one of the pool's mounts and is published as the pvc:// URI it is.
    OutputNotDurable when the artifact could only land in a pod's ephemeral storage; ValueError for
    other unusable outputs."""
    ns, name = job.metadata.namespace or "default", _name(job.metadata.name)
    volumes = {v.claim_name: v for v in pool.spec.volumes or []}
    jobs_volume = pool.spec.job_storage
    pool_name = _name(pool.metadata.name)
    default = storage.pvc_uri(jobs_volume.claim_name, "elastune") if jobs_volume else None
    uri = job.spec.output.uri if job.spec.output else None
    if uri and storage.parse(uri).scheme == "s3":
        # Durable in its bucket (the worker uploads it before it reports success). Staging and
        # checkpoints go on the jobStorage claim when the pool has one, so a lost pod's job resumes;
        # without one they stay in the pod (a retry then starts over), the artifact is still safe.
        root = default or S3_STAGING_ROOT
        return DurableStorage(artifact_location(job, root), storage.join(root, "checkpoints", ns, name))
    if not uri and default is None:
        raise OutputNotDurable(
            f"no spec.output.uri and WarmPool {pool_name} declares no jobStorage volume: the artifact "
            "would only be written to a worker pod's ephemeral storage; set spec.output.uri to "
            "pvc://<claim>/<path> on a claim the pool mounts, or mark one of its volumes jobStorage: true"
        )
    loc = storage.parse(artifact_location(job, default or "/"))
    if loc.scheme in ("", storage.FILE):
        loc = storage.parse(_on_a_claim(loc.path, volumes, pool_name))
    if loc.scheme != storage.PVC:
        raise ValueError(f"spec.output.uri {uri!r}: {loc.scheme}:// outputs are not supported yet")
    volume = volumes.get(loc.authority)
    if volume is None:
        raise OutputNotDurable(
            f"spec.output.uri {uri}: claim {loc.authority} is not among the volumes of {pool_name}, "
            "so its pods would write into their own ephemeral storage; add it to spec.volumes"
        )
    if volume.read_only:
        raise ValueError(f"spec.output.uri {uri}: claim {loc.authority} is mounted readOnly")
    claim = jobs_volume.claim_name if jobs_volume else loc.authority
    return DurableStorage(str(loc), storage.pvc_uri(claim, f"elastune/checkpoints/{ns}/{name}"))


def _on_a_claim(path: str, volumes: dict[str, VolumeMount], pool_name: str) -> str:
    """A pod path on one of the pool's mounts as its pvc:// URI; OutputNotDurable elsewhere."""
    target = os.path.normpath(path)
    for claim, v in volumes.items():
        for mount in (f"{DEFAULT_PVC_ROOT}/{claim}", v.mount_path):
            if not mount:
                continue
            rel = os.path.relpath(target, os.path.normpath(mount))
            if rel != ".." and not rel.startswith("../"):
                return storage.pvc_uri(claim, "" if rel == "." else rel)
    raise OutputNotDurable(
        f"spec.output.uri {path} is on no volume of WarmPool {pool_name} (claims mount at "
        f"{DEFAULT_PVC_ROOT}/<claim>): it would be lost with the pod; use pvc://<claim>/<path>"
    )


def pool_config(wp: WarmPool, cap: int | None = None) -> PoolConfig:
    """A WarmPool as the core sees it; ``cap`` bounds min/max warm GPUs (local mode: worker count)."""
    spec = wp.spec
    profile = spec.profile
    cold = profile.cold_start_seconds if profile and profile.cold_start_seconds is not None else None
    spi = profile.seconds_per_iteration if profile and profile.seconds_per_iteration else None
    limit = cap if cap is not None else spec.max_warm_gpus
    return PoolConfig(
        name=_name(wp.metadata.name),
        model=spec.model,
        min_warm=min(spec.min_warm_gpus, limit),
        max_warm=min(spec.max_warm_gpus, limit),
        idle_window_seconds=spec.idle_window_seconds,
        cold_start_seconds=float(cold if cold is not None else DEFAULT_COLD_START_SECONDS),
        seconds_per_iteration=float(units.parse_decimal(spi)) if spi else DEFAULT_SECONDS_PER_ITERATION,
        serving=spec.serving,
        namespace=wp.metadata.namespace or "default",
        allowed_namespaces=tuple(spec.allowed_namespaces or ()),
        job_storage=spec.job_storage.claim_name if spec.job_storage else None,
        max_batch_size=spec.job_limits.max_batch_size if spec.job_limits else None,
        max_iterations=spec.job_limits.max_iterations if spec.job_limits else None,
    )


def job_record(job: TuningJob, *, created: float | None, dataset: str, artifact: Path | str) -> JobRecord:
    """A JobRecord carrying the resource's identity and persisted status (so a restart resumes)."""
    meta = job.metadata
    if created is None:
        stamp = meta.creation_timestamp
        created = units.parse_timestamp(stamp).timestamp() if stamp else datetime.now(UTC).timestamp()
    rec = JobRecord(
        key=f"{meta.namespace or 'default'}/{meta.name}",
        spec=job.spec,
        created=created,
        dataset=dataset,
        artifact_dir=str(artifact),
        generation=meta.generation,
    )
    if meta.uid:
        rec.uid = meta.uid
    if job.status is not None:
        rec.status = TuningJobStatus.model_validate(job.status.model_dump(by_alias=True))
        rec.attempt = job.status.attempts or 0
    return rec


def worker_serving_args(serving: ServingSpec | None) -> list[str]:
    """The worker's engine flags (vLLM's names) for a WarmPool's serving section; [] for the defaults."""
    if serving is None:
        return []
    s = serving
    args = []
    if s.max_loras > 0:
        args += ["--enable-lora", "--max-loras", str(s.max_loras)]
        args += [
            "--max-cpu-loras",
            str(max(s.max_cpu_loras, s.max_loras)),
            "--max-lora-rank",
            str(s.max_lora_rank),
        ]
        if s.lora_kernel:
            args += ["--lora-kernel", s.lora_kernel]
    optional = {
        "--kv-cache-tokens": s.kv_cache_tokens,
        "--max-num-batched-tokens": s.max_num_batched_tokens,
        "--long-prefill-token-threshold": s.chunked_prefill_tokens,
        "--queue-policy": s.queue_policy,
        "--max-queued-requests": s.max_queued_requests,
    }
    for flag, value in optional.items():
        if value is not None:
            args += [flag, str(value)]
    return args
