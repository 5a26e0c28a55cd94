"""What the control core keeps: pool configs, its settings, and the bookkeeping of each TuningJob."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from elastune_contract.api.tuningjob import TuningJobSpec, TuningJobStatus
from elastune_contract.api.warmpool import ServingSpec, namespace_admitted
from elastune_contract.protocol import WORKER_TTL_SECONDS, WorkerRecord, pool_id, split_worker_id
from elastune_operator.scheduling.policy import ROUND_SECONDS, PolicyName


@dataclass
class PoolConfig:
    """What the core needs of a WarmPool."""

    name: str
    model: str
    min_warm: int = 0
    max_warm: int = 8
    idle_window_seconds: float = 60.0
    cold_start_seconds: float = 30.0
    seconds_per_iteration: float = 0.05
    serving: ServingSpec | None = None
    """The WarmPool's serving section (None: the engine's defaults, no serving replicas)."""
    namespace: str = "default"
    allowed_namespaces: tuple[str, ...] = ()
    """Namespaces besides its own whose jobs and adapters may use it ("*": all; WarmPool
    spec.allowedNamespaces)."""
    job_storage: str | None = None
    """The claim of the WarmPool's jobStorage volume (borrowers' artifacts lie in their folder of it)."""

    max_batch_size: int | None = None
    max_iterations: int | None = None
    """The WarmPool's spec.jobLimits (None: the TuningJob schema's bounds only)."""

    def admits(self, namespace: str) -> bool:
        return namespace_admitted(namespace, self.namespace, self.allowed_namespaces)

    def exceeded_by(self, spec: TuningJobSpec) -> str | None:
        """Why a job of ``spec`` asks for more than this pool's job limits allow; None when it does not."""
        over = [
            f"{field} {value} is above WarmPool {self.key}'s jobLimits.{limit} ({bound})"
            for field, value, limit, bound in (
                ("batchSize", spec.hyperparameters.batch_size, "maxBatchSize", self.max_batch_size),
                ("maxIterations", spec.termination.max_iterations, "maxIterations", self.max_iterations),
            )
            if bound is not None and value > bound
        ]
        return "; ".join(over) or None

    @property
    def key(self) -> str:
        """namespace/name (``protocol.pool_id``): how the core names the pool to its backend, since two
        namespaces may each have a WarmPool of one name."""
        return pool_id(self.namespace, self.name)


class _PoolLike(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def key(self) -> str: ...
    def admits(self, namespace: str) -> bool: ...


P = TypeVar("P", bound=_PoolLike)


class _Named(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str: ...


def record_pool(rec: WorkerRecord, pools: Mapping[str, _Named]) -> str | None:
    """The id of the pool (of ``pools``: pool id -> pool) a worker's registry record belongs to, None
    for none of them: its ``pool`` when that is a pool id already; else the pool of that name in the
    worker's namespace (a pod registers as ``<namespace>/<pod>`` with its WarmPool's name); else, for a
    worker of no namespace (a local process), the pool of that name serving its model (the lowest id,
    should two namespaces have one). A record whose pool serves another model than the record says
    belongs to none."""
    if rec.pool in pools:
        key: str | None = rec.pool
    elif ns := split_worker_id(rec.id)[0]:
        key = pool_id(ns, rec.pool)
    else:
        key = min((k for k, p in pools.items() if p.name == rec.pool and p.model == rec.model), default=None)
    return key if key is not None and key in pools and pools[key].model == rec.model else None


def resolve_pool(pools: Iterable[P], namespace: str, model: str) -> P | None:
    """The pool a TuningJob or LoRAAdapter of ``namespace`` uses for ``model``: the WarmPool of its own
    namespace that serves the model (a namespace has at most one per model), else, of the other
    namespaces' pools of the model that admit ``namespace`` (spec.allowedNamespaces), the one of the
    lowest pool id; None when no pool of the model admits it."""
    admitting: list[P] = []
    for p in pools:
        if p.model != model:
            continue
        if p.namespace == namespace:
            return p
        if p.admits(namespace):
            admitting.append(p)
    return min(admitting, key=lambda p: p.key, default=None)


def pool_not_shared(model: str, namespace: str, pool_ids: Iterable[str]) -> str:
    """Why a TuningJob of ``namespace`` runs nowhere: ``pool_ids`` serve its model, none admits it."""
    names = ", ".join(sorted(pool_ids))
    return (
        f"the WarmPools of model {model!r} ({names}) do not admit namespace {namespace}: create a "
        f"WarmPool in {namespace}, or have one of them list {namespace} in spec.allowedNamespaces"
    )


MISSING_GRACE_S = 60.0
"""A bound worker's record may be missing this long before the worker counts as lost, and is stopped.
A worker that died is reported at once by the backend (its process or pod exited); a missing record
alone means silence: a Redis restarted empty (the next heartbeat re-registers it), or a process paused
by a GC, a throttled CPU or a slow disk, which comes back. Three heartbeats (3 s, after the record's
10 s TTL) declared a worker paused ~20 s lost, and it was stopped when it resumed, cutting its streams
(issue 38 item 2). A job on a silent worker does not wait for this: its attempt's own timeouts
(control/attempt_timeouts.py) cancel and retry it."""


@dataclass
class CoreSettings:
    cold_capacity: int
    """GPUs in the shared cold pool (local mode: worker processes the machine can hold)."""
    channel_url: str
    """Storage channel for gradient all-reduce (redis:// or memcached://)."""
    work_dir: Path
    """Checkpoints (and default artifacts) go under here; on Kubernetes a shared volume."""
    collective_timeout_s: float = 60.0
    eval_every: int = 10
    checkpoint_every: int = 10
    progress_every: int = 10
    max_attempts: int = 3
    round_seconds: float = ROUND_SECONDS
    policy: PolicyName = "promptTuner"
    """The scheduling policy: PromptTuner's, or one of the paper's baselines (infless, elasticflow)
    for side-by-side runs on real workers."""
    check_artifact_paths: bool = True
    lend_gpus_only: bool = True
    """A LoRAAdapter of a namespace a pool admits may name nothing of the pool's namespace (its claims,
    Secrets, pod paths, cloud identity: control/borrowing.py). Off in local mode: one user's machine has
    no namespaces to keep apart, and its adapters are files of that user."""
    """Check file:// and path artifactURLs of LoRAAdapters on this process's filesystem (local mode; a
    Kubernetes operator sees the workers' files only when it mounts the same volume)."""
    recovery_grace_s: float = WORKER_TTL_SECONDS + 5.0
    """After a control-plane restart, how long a job's in-flight attempt may take to show up (its busy
    workers in the registry, or its result in the event stream) before it is re-run from its checkpoint."""
    proof_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    """The key of the attempts' proofs (``protocol.attempt_proof``). Random per process by default: a
    restarted control plane then re-runs an in-flight attempt from its checkpoint instead of adopting
    it; the operator reads a stable one from ``ELASTUNE_PROOF_KEY`` (a Secret of the chart)."""
    missing_grace_s: float = MISSING_GRACE_S
    """How long a bound worker's registry record may be missing (silence: a paused process, a Redis
    restarted empty) before the worker counts as lost and is stopped (control/fleet.py)."""


@dataclass(frozen=True, slots=True)
class JobDeadline:
    """A TuningJob's SLO as the control plane uses it: spec.deadline parsed once, when its record is
    built (``JobRecord``), so the scheduler, the Prompt Bank budget and status.sloMet read one value."""

    seconds: int
    """Relative: how long after creation the prompt must be ready (the scheduler's ``Job.slo``)."""
    at: float
    """Absolute Unix time, creation + seconds: status.sloMet compares the completion time with it."""

    @classmethod
    def of(cls, spec: TuningJobSpec, created: float) -> JobDeadline:
        seconds = spec.deadline_seconds  # the contract's parser, the one its validation runs
        return cls(seconds, created + seconds)


@dataclass
class JobRecord:
    """The control plane's bookkeeping of one TuningJob: where a TuningJob enters the control plane,
    so what the spec says is read here once (``deadline``) and carried on, never parsed again."""

    key: str
    """namespace/name."""
    spec: TuningJobSpec
    created: float
    """Unix time of creation: the SLO runs from here."""
    dataset: str
    """The dataset as workers must read it (local mode resolves relative paths)."""
    artifact_dir: str
    """Where the workers write the artifact: a path, or a pvc:// URI they resolve (Kubernetes)."""
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    generation: int | None = None
    status: TuningJobStatus = field(default_factory=TuningJobStatus)
    attempt: int = 0
    workers: list[str] = field(default_factory=list)
    last_event: str = "0-0"
    checkpointed: int = 0
    resumed_from: list[int] = field(default_factory=list)
    """Per attempt, the iteration its workers resumed from."""
    started: float | None = None
    gpu_seconds: float = 0.0
    terminal: bool = False
    pool: str = ""
    """The pool it runs on, by id (namespace/name: ``PoolConfig.key``), chosen once at submission
    (``ControlCore.resolve``); "" until then. The scheduler's per-pool state is keyed by it."""
    checkpoint_root: str | None = None
    """Where this job's checkpoints go, the attempt's uid appended: a pvc:// URI on the pool's durable
    claim (Kubernetes); None: ``CoreSettings.work_dir/checkpoints/<ns>/<name>``."""
    deadline: JobDeadline = field(init=False)
    """spec.deadline, parsed once here (ValueError naming it for a deadline that got past an apiserver
    without the CRD's schema)."""

    def __post_init__(self) -> None:
        self.deadline = JobDeadline.of(self.spec, self.created)

    @property
    def llm(self) -> str:
        return self.spec.model

    @property
    def namespace(self) -> str:
        return self.key.split("/", 1)[0]

    @property
    def pool_namespace(self) -> str:
        """The namespace of its pool ("" before one is chosen): the metrics' ``pool_namespace``."""
        return self.pool.rpartition("/")[0]
