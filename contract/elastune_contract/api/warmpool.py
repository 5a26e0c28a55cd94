"""WarmPool: GPUs kept loaded with one LLM so jobs start without a cold start (PromptTuner §4)."""

from collections.abc import Sequence
from functools import cached_property
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from elastune_contract.api import units
from elastune_contract.api.common import (
    PATTERN_DESCRIPTIONS,
    ApiModel,
    Conditions,
    Duration,
    EnvName,
    NonNegativeDecimal,
    PositiveDecimal,
    Quantity,
    Resource,
    ResourceName,
    Timestamp,
)
from elastune_contract.api.constants import DEFAULT_PVC_ROOT, KIND_WARM_POOL
from elastune_contract.model_source import (
    HF,
    MODEL_SOURCE_DESCRIPTION,
    MODEL_SOURCE_PATTERN,
    S3,
    ModelSource,
    parse_model_source,
)

# The gateway's routing policies by name (its routing/ package takes the type from here).
RoutingPolicyName = Literal[
    "roundRobin", "leastLoad", "preble", "rankAware", "mostIdle", "firstFit", "random", "combined"
]

DEFAULT_WORKER_IMAGE = "ghcr.io/elastune/worker:0.1.0"

#: GPUs one worker pod of Elastune's engine uses: one process on cuda:0, for serving (no tensor
#: parallelism) and for tuning (data parallel across pods, never across a pod's GPUs), and the scheduler
#: counts a pod as one GPU. More would be requested from Kubernetes and left idle, so they are refused.
ENGINE_GPUS_PER_POD: Final = 1
GPUS_PER_POD_REFUSAL: Final = (
    "Elastune's engine uses one GPU per worker pod, for serving and tuning alike (no tensor parallelism); "
    "a model that needs several GPUs per pod is for a vLLM pool (spec.serving.engine: vllm), which is "
    "not available yet"
)
#: The apiserver's message (the CRD's CEL rule), which `elastune validate` and local mode repeat.
GPUS_PER_POD_MESSAGE: Final = f"gpusPerPod must be {ENGINE_GPUS_PER_POD}: {GPUS_PER_POD_REFUSAL}"

#: spec.allowedNamespaces entry that admits jobs and adapters of every namespace.
ALL_NAMESPACES = "*"
#: A namespace name (an RFC 1123 label), or "*" for all.
AllowedNamespace = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^(\*|[a-z0-9]([-a-z0-9]*[a-z0-9])?)$")
]


def namespace_admitted(namespace: str, own: str, allowed: Sequence[str] | None) -> bool:
    """Whether a job or adapter of ``namespace`` may use a pool of namespace ``own`` whose
    spec.allowedNamespaces is ``allowed``."""
    return namespace == own or ALL_NAMESPACES in (allowed or ()) or namespace in (allowed or ())


def _check_model_source(value: str) -> str:
    parse_model_source(value)  # ValueError: a sentence naming the accepted forms
    return value


#: spec.model: a model source (model_source.py): hf://, s3://, pvc:// or a built-in name.
ModelSourceString = Annotated[
    str,
    AfterValidator(_check_model_source),
    WithJsonSchema({"type": "string", "pattern": MODEL_SOURCE_PATTERN}),
]
# Schema errors word the pattern as a sentence (crdcheck); registered here, not in common.py, because
# model_source imports storage, which imports the api package that common.py belongs to.
PATTERN_DESCRIPTIONS.setdefault(MODEL_SOURCE_PATTERN, MODEL_SOURCE_DESCRIPTION)
DEFAULT_MODEL_CACHE_CLAIM: Final = "elastune-models"
DEFAULT_LOAD_TIMEOUT: Final = "10m"


class ModelSourceSpec(ApiModel):
    """How the pool gets an hf://, s3:// or pvc:// model: fetched once by a Job into a cache claim that
    outlives pods, then loaded offline by every worker from there."""

    secret_name: ResourceName | None = None
    """A Secret of the pool's namespace with the credentials: key ``token`` (a Hub access token) for
    hf://; for s3:// the keys LoRAAdapter artifactSecret uses (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    optional AWS_ENDPOINT_URL, AWS_REGION, AWS_SESSION_TOKEN). Unset: anonymous for hf:// (public
    repositories); for s3:// the fetch is refused unless useAmbientCredentials is set."""
    use_ambient_credentials: bool | None = None
    """For an s3:// model without a secretName: fetch with the fetch pod's own identity (boto3's default
    chain: AWS_* environment, instance profile, IRSA); never implied by leaving secretName out."""
    cache_claim: ResourceName = DEFAULT_MODEL_CACHE_CLAIM
    """The PersistentVolumeClaim of the pool's namespace holding fetched models (one directory per
    source, so a second pool of the same model reuses it). The fetch Job mounts it read-write, workers
    read-only: ReadWriteMany, or ReadWriteOnce when all of them land on one node."""
    load_timeout: Duration = DEFAULT_LOAD_TIMEOUT
    """How long a worker may take to load the model before Kubernetes restarts it (its startupProbe:
    failureThreshold x periodSeconds). Large models on slow disks need more."""

    @property
    def load_timeout_seconds(self) -> int:
        return units.parse_duration(self.load_timeout)


class Toleration(ApiModel):
    """A core/v1 Toleration, so worker pods can land on tainted GPU nodes."""

    key: str | None = None
    """Taint key to tolerate; empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] | None = None
    """Exists or Equal (the Kubernetes default)."""
    value: str | None = None
    """Taint value to match when the operator is Equal."""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches every effect."""
    toleration_seconds: int | None = None
    """For NoExecute: how long the pod stays bound after the taint appears."""


class ResourceRequirements(ApiModel):
    """Compute resources of a worker container (core/v1 ResourceRequirements without claims)."""

    limits: dict[str, Quantity] | None = None
    """Maximum amount of each resource, e.g. nvidia.com/gpu: 1."""
    requests: dict[str, Quantity] | None = None
    """Amount of each resource the scheduler reserves."""


class EnvVar(ApiModel):
    """A core/v1 EnvVar of the worker container."""

    name: EnvName
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: dict[str, Any] | None = None
    """Source of the value (secretKeyRef, configMapKeyRef, fieldRef, …), passed through to the pod as is."""


class WorkerSpec(ApiModel):
    """The worker pods that hold the model on their GPU."""

    image: str = Field(default=DEFAULT_WORKER_IMAGE, min_length=1)
    """Worker container image."""
    resources: ResourceRequirements | None = None
    """Container resources; the operator adds nvidia.com/gpu for gpusPerPod when it is missing."""
    env: list[EnvVar] | None = None
    """Extra environment variables."""
    termination_grace_period_seconds: int = Field(
        default=120, ge=10, le=3600, alias="terminationGracePeriodSeconds"
    )
    """How long a worker pod told to stop (scale-down, rollout, node drain) may take to finish its
    requests in flight before it is killed: the pod's terminationGracePeriodSeconds. The worker drains
    for 5 s less (readiness false, out of the registry, streams finished), then exits."""


class VolumeMount(ApiModel):
    """A PersistentVolumeClaim mounted into every worker pod.

    The claim is always mounted at /mnt/pvc/<claimName>, where pvc://<claimName>/<path> resolves in the
    control plane, the tuner and the adapter loader alike; mountPath only adds a second mount of it.
    A ReadWriteMany claim marked jobStorage holds the pool's TuningJob checkpoints and default
    artifacts, so they outlive the pod that wrote them."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.jobStorage) && self.jobStorage "
                    "&& has(self.readOnly) && self.readOnly)",
                    "message": "a jobStorage volume must be writable (readOnly: false)",
                    "fieldPath": ".readOnly",
                }
            ]
        }
    )

    claim_name: ResourceName
    """Name of the PersistentVolumeClaim in the pool's namespace."""
    mount_path: str | None = Field(default=None, pattern=r"^/\S*$")
    """An extra path where the claim also appears in the pod (e.g. model weights at a fixed path); it is
    mounted at /mnt/pvc/<claimName> (what pvc:// URLs resolve to) either way."""
    read_only: bool = False
    """Mount it read-only (adapter stores); leave false for a checkpoint volume."""
    job_storage: bool = False
    """Put this pool's TuningJob checkpoints and default artifacts on this claim, under elastune/ (a
    ReadWriteMany claim: every pod of the pool mounts it). At most one volume; not readOnly. On
    Kubernetes a job without output.uri is refused (OutputNotDurable) when no volume has it, since its
    artifact could only land in a pod's ephemeral storage."""

    @field_validator("mount_path")
    @classmethod
    def _not_under_pvc_root(cls, value: str | None, info: ValidationInfo) -> str | None:
        # Under /mnt/pvc it would shadow what pvc://<some claim>/... resolves to.
        own = f"{DEFAULT_PVC_ROOT}/{info.data.get('claim_name')}"
        path = (value or "").rstrip("/")
        if value is not None and path != own and f"{path}/".startswith(f"{DEFAULT_PVC_ROOT}/"):
            raise ValueError(f"must not be under {DEFAULT_PVC_ROOT}/, where every claim is mounted")
        return value

    @field_validator("job_storage")
    @classmethod
    def _writable(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("read_only"):
            raise ValueError("a jobStorage volume must be writable (readOnly: false)")
        return value


class ServingSLO(ApiModel):
    """Latency objectives the gateway's routing and the co-serving scheduler hold requests to."""

    ttft_milliseconds: int | None = Field(default=None, ge=1)
    """Time to first token."""
    tpot_milliseconds: int | None = Field(default=None, ge=1)
    """Time per output token after the first."""


class ServingSpec(ApiModel):
    """How the pool's workers serve inference (base model, LoRA adapters, published prompts)."""

    min_replicas: int = Field(default=0, ge=0)
    """Pods kept warm for serving even without requests; 0 scales to zero, and the first request waits
    in the gateway while the pool scales up. The pool runs max(tuning need, serving need) pods."""
    hold_timeout: Duration = "60s"
    """How long a request waits in the gateway for a warm pod before a 503 with Retry-After."""
    max_loras: int = Field(default=4, ge=0)
    """Adapters in device memory at once per pod (0: serve no LoRA adapters)."""
    max_cpu_loras: int = Field(default=16, ge=0)
    """Adapters kept in host memory per pod (LRU); at least maxLoras."""
    max_lora_rank: int = Field(default=64, ge=1, le=256)
    """Largest LoRA rank the pool serves; adapters above it are refused (Ready=False)."""
    lora_kernel: Literal["padded", "unpadded"] | None = None
    """Multi-LoRA kernel: padded to the batch's max rank (Punica BGMV) or per-adapter segments (S-LoRA
    MBGMV); unset: the engine's default."""
    kv_cache_tokens: int | None = Field(default=None, ge=16)
    """KV-cache size in tokens; unset: the engine's default."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Token budget of one engine iteration."""
    chunked_prefill_tokens: int | None = Field(default=None, ge=1)
    """Largest prefill chunk a request adds to one iteration (unset: the iteration's budget)."""
    max_queued_requests: int | None = Field(default=None, ge=1, le=1_000_000)
    """Requests a pod accepts and has not started at most; past it, 503 with Retry-After (unset: the
    worker's default, 1024)."""
    queue_policy: Literal["fcfs", "priority", "sjf", "fair"] | None = None
    """Order of each pod's waiting queue: fcfs, priority (the request's priority field), sjf (predicted
    output length from the gateway, SSJF), fair (service shared across API keys by virtual token
    counters, VTC; the gateway names each request's key)."""
    routing_policy: RoutingPolicyName | None = None
    """The gateway's routing policy for this pool; unset: the gateway's default."""
    slo: ServingSLO | None = None
    """Latency objectives for routing (CaraServe's SLO penalty) and co-serving."""
    co_serving: bool = True
    """Let TuningJobs of this model run inside the serving pods' iterations (FlexLLM co-serving, under
    the TPOT SLO) when the scheduler predicts they still meet their deadline there; false keeps serving
    pods for inference only (jobs then get dedicated pods)."""

    @property
    def hold_timeout_seconds(self) -> int:
        return units.parse_duration(self.hold_timeout)


class JobLimits(ApiModel):
    """What a TuningJob run on this pool may ask for: the pool's capacity as its owner states it (a
    batch its GPUs' memory holds, the iterations its budget allows). A job over a limit fails when it
    is submitted to the pool (Succeeded=False, reason ExceedsPoolLimits, the field and the limit named)
    and nothing runs."""

    max_batch_size: int | None = Field(default=None, ge=1, le=4096)
    """Largest spec.hyperparameters.batchSize accepted."""
    max_iterations: int | None = Field(default=None, ge=1, le=1_000_000)
    """Largest spec.termination.maxIterations accepted."""


class Profile(ApiModel):
    """Starting point of the estimator before any run of this model has been measured."""

    cold_start_seconds: int | None = Field(default=None, ge=0)
    """Allocation overhead T_cold: seconds from an empty GPU to a warm worker."""
    seconds_per_iteration: PositiveDecimal | None = None
    """Seconds per tuning iteration on one GPU; more GPUs scale it down near-linearly."""


class WarmPoolSpec(ApiModel):
    """Desired state of a WarmPool."""

    # The apiserver cannot compare two fields structurally; CEL can. The has() guards keep the rule
    # valid even if a default were removed from the schema.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.minWarmGPUs) || !has(self.maxWarmGPUs) "
                    "|| self.minWarmGPUs <= self.maxWarmGPUs",
                    "message": "minWarmGPUs must not exceed maxWarmGPUs",
                    "fieldPath": ".maxWarmGPUs",
                },
                {
                    "rule": "!has(self.modelSource) || !has(self.modelSource.useAmbientCredentials) "
                    "|| !self.modelSource.useAmbientCredentials "
                    "|| (self.model.startsWith('s3://') && !has(self.modelSource.secretName))",
                    "message": "useAmbientCredentials applies to an s3:// model without a secretName",
                    "fieldPath": ".modelSource.useAmbientCredentials",
                },
                {
                    # A rule, not a maximum, so the apiserver's refusal says why and where to go; the
                    # model accepts more so the operator can read (and refuse) a pool stored under an
                    # older CRD (helm upgrade leaves crds/ alone).
                    "rule": f"!has(self.gpusPerPod) || self.gpusPerPod <= {ENGINE_GPUS_PER_POD}",
                    "message": GPUS_PER_POD_MESSAGE,
                    "fieldPath": ".gpusPerPod",
                },
            ]
        }
    )

    model: ModelSourceString
    """LLM the pool serves: hf://<org>/<name>[@<revision>] (a Hugging Face Hub repository, main when no
    revision), s3://<bucket>/<prefix> or pvc://<claim>/<path> (fetched once into modelSource.cacheClaim
    before the workers start), or a built-in name such as elastune/tiny-llama (loaded as is)."""
    model_source: ModelSourceSpec | None = None
    """Credentials, cache claim and load timeout of the model (unset: no Secret, the claim
    elastune-models, 10m)."""
    gpus_per_pod: int = Field(default=1, ge=1)
    """GPUs requested by each worker pod. Must be 1: Elastune's engine uses one GPU per pod, for serving
    and tuning alike; more is refused (GPUsPerPodUnsupported) rather than requested and left idle.
    Models that need several GPUs per pod are for vLLM pools, not available yet."""
    node_selector: dict[str, str] | None = None
    """Node labels of the GPU node pool, e.g. elastune.dev/pool: cold."""
    tolerations: list[Toleration] | None = None
    """Tolerations for the GPU nodes' taints, e.g. nvidia.com/gpu."""
    min_warm_gpus: int = Field(default=0, ge=0, alias="minWarmGPUs")
    """GPUs kept warm even when idle."""
    # validate_default so the min <= max check also runs when only minWarmGPUs is given.
    max_warm_gpus: int = Field(default=8, ge=1, alias="maxWarmGPUs", validate_default=True)
    """Upper bound of the pool (its Deployment's replicas never exceed it)."""
    idle_window: Duration = "60s"
    """How long a warm GPU may stay idle before it returns to the cold pool."""
    # default {} lets the apiserver fill in the nested defaults (the image) when the field is left out.
    worker: WorkerSpec = Field(default_factory=WorkerSpec, json_schema_extra={"default": {}})
    """Worker pod template."""
    profile: Profile | None = None
    """The estimator's starting profile of this model."""
    serving: ServingSpec | None = None
    """Inference serving settings; unset: the workers serve the base model with the engine's defaults and
    the pool never grows for requests alone (no serving replicas; requests are held up to 60 s)."""
    volumes: list[VolumeMount] | None = None
    """PersistentVolumeClaims mounted into every worker pod (adapter artifacts, shared checkpoints)."""
    job_limits: JobLimits | None = None
    """Bounds on the TuningJobs this pool runs, beyond the TuningJob schema's own (unset: those only)."""
    allowed_namespaces: list[AllowedNamespace] | None = Field(default=None, max_length=256)
    """Namespaces whose TuningJobs and LoRAAdapters may run on this pool, besides its own (Gateway API's
    allowedRoutes in spirit). Unset or empty: its own namespace only. "*" admits every namespace. It
    lends GPUs only: a job of another namespace runs in this pool's pods and writes its artifact and
    checkpoints under its own namespace's folder of this pool's jobStorage claim; it may name none of
    this namespace's claims or Secrets nor use the pods' cloud identity (refused: ForeignReference)."""

    @field_validator("model_source")
    @classmethod
    def _secret_for_remote_models(cls, value: ModelSourceSpec | None, info: ValidationInfo) -> Any:
        model = info.data.get("model")
        if (
            value is not None
            and value.secret_name
            and model
            and not model.startswith((f"{HF}://", f"{S3}://"))
        ):
            raise ValueError(
                f"secretName holds credentials for an hf:// or s3:// model only; {model!r} needs none"
            )
        if (
            value is not None
            and value.use_ambient_credentials
            and model
            and (value.secret_name or not model.startswith(f"{S3}://"))
        ):
            raise ValueError(
                f"useAmbientCredentials applies to an s3:// model without a secretName; got {model!r}"
            )
        return value

    @cached_property
    def source(self) -> ModelSource:
        """spec.model parsed (validated when the spec was)."""
        return parse_model_source(self.model)

    @property
    def fetch(self) -> ModelSourceSpec:
        """spec.modelSource with its defaults when unset."""
        return self.model_source or ModelSourceSpec()

    @field_validator("volumes")
    @classmethod
    def _one_job_storage(cls, value: list[VolumeMount] | None) -> list[VolumeMount] | None:
        marked = [v.claim_name for v in value or [] if v.job_storage]
        if len(marked) > 1:
            raise ValueError(f"at most one volume may set jobStorage; got {', '.join(marked)}")
        return value

    @property
    def job_storage(self) -> VolumeMount | None:
        """The volume holding the pool's checkpoints and default artifacts, if one is declared."""
        return next((v for v in self.volumes or [] if v.job_storage), None)

    @field_validator("max_warm_gpus")
    @classmethod
    def _max_not_below_min(cls, value: int, info: ValidationInfo) -> int:
        minimum = info.data.get("min_warm_gpus")
        if minimum is not None and value < minimum:
            raise ValueError(f"must be >= minWarmGPUs ({minimum}); got {value}")
        return value

    @property
    def idle_window_seconds(self) -> int:
        """The idle window in seconds."""
        return units.parse_duration(self.idle_window)

    def admits(self, namespace: str, own: str) -> bool:
        """Whether a job or adapter of ``namespace`` may use this pool, which lives in ``own``."""
        return namespace_admitted(namespace, own, self.allowed_namespaces)


#: The SHA-256 of a password, as Redis keeps it (``ACL SETUSER ... #<hash>``): lowercase hex.
PasswordHash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class RedisUserStatus(ApiModel):
    """The pool's Redis user as the operator keeps it: hashes of its passwords, never a password. From it
    the operator re-creates the user when Redis lost it (a restart without persistence, a replaced
    Redis), so the pool's running pods keep the password their Secret gave them. Written by the operator
    before it hands a new password to Redis or the Secret."""

    password_hash: PasswordHash
    """SHA-256 of the password the Secret <pool>-redis-user holds (or is about to)."""
    previous_hashes: list[PasswordHash] = Field(default_factory=list, max_length=4)
    """Earlier passwords still valid until every pod of the pool was created after rotatedAt."""
    rotated_at: Timestamp
    """When passwordHash was issued (rounded up to the second, as pods' creationTimestamp is compared)."""
    rotation_request: str | None = None
    """The rotate.elastune.dev/redis-password annotation value last acted on."""
    secret_written: bool = False
    """Whether the Secret holds passwordHash's password; false after a crash between the two, and the
    operator then issues another."""
    suspended: bool = False
    """Write rights cut (over its Redis budget) until a new password is asked for."""


class WarmPoolStatus(ApiModel):
    """Observed state of a WarmPool."""

    conditions: Conditions = Field(default_factory=list)
    """Ready summarises whether the pool can take jobs."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The .metadata.generation this status describes."""
    warm_gpus: int | None = Field(default=None, ge=0, alias="warmGPUs")
    """GPUs with the model loaded (busy + idle)."""
    busy_gpus: int | None = Field(default=None, ge=0, alias="busyGPUs")
    """Warm GPUs running a job."""
    idle_gpus: int | None = Field(default=None, ge=0, alias="idleGPUs")
    """Warm GPUs waiting for a job."""
    starting_gpus: int | None = Field(default=None, ge=0, alias="startingGPUs")
    """GPUs being allocated from the cold pool."""
    cold_start_seconds: NonNegativeDecimal | None = None
    """Measured allocation overhead T_cold, in seconds."""
    iteration_seconds: dict[str, PositiveDecimal] | None = None
    """Measured seconds per tuning iteration, keyed by GPU count ("1", "2", …)."""
    redis_user: RedisUserStatus | None = None
    """The pool's Redis user (when Redis requires auth): hashes only, the operator's record."""

    @field_validator("iteration_seconds")
    @classmethod
    def _keys_are_gpu_counts(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # A structural schema cannot constrain map keys, so only the model checks them.
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or int(key) < 1:
                raise ValueError(f'keys must be GPU counts such as "1" or "4"; got {key!r}')
        return value


class WarmPool(Resource):
    """WarmPool keeps GPUs loaded with one LLM between jobs, growing from the cold pool on demand and
    shrinking after an idle window."""

    kind: Literal["WarmPool"] = KIND_WARM_POOL
    """Kind of the object: WarmPool."""
    spec: WarmPoolSpec
    """Desired state."""
    status: WarmPoolStatus | None = None
    """Observed state, written by the operator."""
