"""From API objects to what the control core works with; shared by `elastune run` and the operator."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from elastune_contract.api import units
from elastune_contract.api.tuningjob import TuningJob, TuningJobStatus
from elastune_contract.api.warmpool import ServingSpec, WarmPool
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


def artifact_dir(job: TuningJob, root: Path) -> Path:
    """Where the job's tuned prompt goes: spec.output.uri, or ``root/artifacts/<ns>/<name>``.
    ``pvc://claim/path`` is ``root/volumes/claim/path`` (the claim mounted there). ValueError for a
    scheme no worker can write yet."""
    ns = job.metadata.namespace or "default"
    uri = job.spec.output.uri if job.spec.output else None
    if not uri:
        return root / "artifacts" / ns / _name(job.metadata.name)
    parts = urlsplit(uri)
    if parts.scheme == "" and uri.startswith("/"):
        return Path(uri)
    if parts.scheme == "file":
        return Path(parts.path)
    if parts.scheme == "pvc":
        return root / "volumes" / parts.netloc / parts.path.lstrip("/")
    raise ValueError(
        f"spec.output.uri {uri!r}: {parts.scheme}:// outputs are not supported yet; "
        "leave output unset, or use a path, file:// or pvc:// URI"
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
    )


def job_record(job: TuningJob, *, created: float | None, dataset: str, artifact: Path) -> JobRecord:
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
    }
    for flag, value in optional.items():
        if value is not None:
            args += [flag, str(value)]
    return args
