"""TuningJob: one prompt-tuning request with a deadline (PromptTuner Table 3)."""

from typing import Final, Literal, Self, get_args

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from elastune_contract.api import units
from elastune_contract.api.common import (
    ApiModel,
    Conditions,
    DatasetUri,
    DecimalString,
    Duration,
    ModelName,
    NonNegativeDecimal,
    PositiveDecimal,
    ReasonString,
    Resource,
    ResourceName,
    Timestamp,
    Uri,
)
from elastune_contract.api.constants import KIND_TUNING_JOB
from elastune_contract.api.retention import JobRetention

Method = Literal["promptTuning", "prefixTuning", "pTuning"]
Optimizer = Literal["adamw", "adam", "sgd"]
PromptBankMode = Literal["auto", "always", "never"]
TargetMetric = Literal["loss", "exactMatch", "accuracy", "bleu", "rougeL"]

#: Metrics whose values are fractions; loss is the only unbounded one (but never negative).
UNIT_INTERVAL_METRICS: Final[tuple[str, ...]] = tuple(m for m in get_args(TargetMetric) if m != "loss")


class Target(ApiModel):
    """Stop as soon as this metric reaches this value on the evaluation samples."""

    # The range of `value` depends on `metric`. A structural schema cannot say "if", so the CRD states it
    # as anyOf branches that only constrain (no types inside junctors); the field validator below is the
    # same rule for the models.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {
                    "properties": {
                        "metric": {"enum": ["loss"]},
                        "value": {"pattern": units.NON_NEGATIVE_DECIMAL_PATTERN},
                    }
                },
                {
                    "properties": {
                        "metric": {"enum": list(UNIT_INTERVAL_METRICS)},
                        "value": {"pattern": units.UNIT_INTERVAL_DECIMAL_PATTERN},
                    }
                },
            ]
        }
    )

    metric: TargetMetric
    """Metric to watch: loss (lower is better, >= 0), or exactMatch, accuracy, bleu or rougeL (higher is
    better, in [0, 1])."""
    value: DecimalString
    """Threshold as a decimal string, e.g. "0.8"."""

    @field_validator("value")
    @classmethod
    def _value_in_metric_range(cls, value: str, info: ValidationInfo) -> str:
        metric = info.data.get("metric")  # absent when the metric itself failed validation
        number = units.parse_decimal(value)
        if metric == "loss" and number < 0:
            raise ValueError(f"must be >= 0 for metric loss; got {value!r}")
        if metric in UNIT_INTERVAL_METRICS and not 0 <= number <= 1:
            raise ValueError(f"must be between 0 and 1 for metric {metric}; got {value!r}")
        return value


class Termination(ApiModel):
    """When tuning stops: after maxIterations, or earlier once the target is reached."""

    max_iterations: int = Field(ge=1, le=1_000_000)
    """Upper bound on optimizer steps (at most a million: prompt tuning converges in hundreds to
    thousands; a bound keeps one job from holding GPUs indefinitely)."""
    target: Target | None = None
    """Optional early-stopping target."""


class Hyperparameters(ApiModel):
    """Optimizer settings of the prompt-tuning loop."""

    batch_size: int = Field(default=8, ge=1, le=4096)
    """Global batch size, split across the job's GPUs (data parallel); at most 4,096 samples a step."""
    learning_rate: PositiveDecimal = "0.3"
    """Learning rate as a decimal string; prompt tuning uses far larger rates than full fine-tuning."""
    optimizer: Optimizer = "adamw"
    """Optimizer of the virtual-token embeddings."""
    virtual_tokens: int = Field(default=20, ge=1, le=512)
    """Number of trainable virtual tokens prepended to each input."""


class Output(ApiModel):
    """Where the tuned prompt's artifact is stored."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.secretName) || (has(self.uri) && self.uri.startsWith('s3://'))",
                    "message": "secretName holds S3 credentials: it applies to an s3:// uri only",
                    "fieldPath": ".secretName",
                },
                {
                    "rule": "!has(self.useAmbientCredentials) || !self.useAmbientCredentials || "
                    "(has(self.uri) && self.uri.startsWith('s3://') && !has(self.secretName))",
                    "message": "useAmbientCredentials applies to an s3:// uri without a secretName",
                    "fieldPath": ".useAmbientCredentials",
                },
            ]
        }
    )

    uri: Uri | None = None
    """Destination of the artifact; the operator picks one from its configuration when unset.
    s3://<bucket>/<prefix>: the worker uploads the PEFT directory there (any S3-compatible endpoint)."""
    secret_name: ResourceName | None = None
    """For an s3:// uri: a Secret in this namespace with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
    optionally AWS_ENDPOINT_URL, AWS_REGION, AWS_SESSION_TOKEN, mounted read-only into the WarmPool's worker
    pods (the operator never reads it); a published adapter names it too. Unset: no credentials, and the
    upload is refused (StorageCredentialsUnset) unless useAmbientCredentials is set."""
    use_ambient_credentials: bool | None = None
    """For an s3:// uri without a secretName: use the worker pods' own identity (boto3's default chain:
    AWS_* environment, instance profile, IRSA). Only a job of the WarmPool's own namespace may; never
    implied by leaving secretName out."""
    publish: ResourceName | None = None
    """Tune -> serve: on success the operator creates a LoRAAdapter of type promptTuning with this name,
    pointing at the artifact, and the pool's gateway serves the tuned prompt under it (the OpenAI model)."""

    @model_validator(mode="after")
    def _ambient_for_s3_only(self) -> Self:
        # The CEL rule above, for manifests no apiserver checked (local mode).
        if self.use_ambient_credentials and (self.secret_name or not (self.uri or "").startswith("s3://")):
            raise ValueError("useAmbientCredentials applies to an s3:// uri without a secretName")
        return self


class TuningJobSpec(ApiModel):
    """Desired state of a TuningJob."""

    # A job's spec is fixed once accepted (its SLO clock, checkpoints and scheduling depend on it): the
    # apiserver refuses changes; delete and re-create the job instead.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self == oldSelf",
                    "message": "spec is immutable: delete and re-create the TuningJob",
                }
            ]
        }
    )

    model: ModelName
    """LLM to tune a prompt for; must be the model of a WarmPool."""
    dataset: DatasetUri
    """JSONL file of {"input", "target"} records: an absolute path, file://, pvc://<claim>/<path>, s3:// or
    http(s)://; or a relative path, resolved against the manifest's directory by `elastune run` and against
    the worker's working directory in a pod (where the worker image keeps the example datasets)."""
    initial_prompt: str | None = Field(default=None, max_length=65536)
    """Text the virtual tokens start from; the Prompt Bank may choose a better start."""
    method: Method = "promptTuning"
    """Parameter-efficient tuning method."""
    termination: Termination
    """Termination condition."""
    deadline: Duration
    """The SLO: how long after creation the optimized prompt must be ready, e.g. "10m"."""
    # default {} lets the apiserver fill in the nested defaults when the field is left out.
    hyperparameters: Hyperparameters = Field(
        default_factory=Hyperparameters, json_schema_extra={"default": {}}
    )
    """Optimizer settings."""
    prompt_bank: PromptBankMode = "auto"
    """Whether to look up a starting prompt in the Prompt Bank: auto runs it only when its predicted
    latency fits the budget (20 % of the deadline)."""
    output: Output | None = None
    """Where to store the result."""
    retention: JobRetention = Field(default_factory=JobRetention, json_schema_extra={"default": {}})
    """What deleting the job removes: checkpoints (default Delete) and the artifact (default Retain);
    only what Elastune wrote for this job, never another owner's files."""

    @property
    def deadline_seconds(self) -> int:
        """The deadline in seconds."""
        return units.parse_duration(self.deadline)


class PromptBankStatus(ApiModel):
    """Outcome of the Prompt Bank lookup."""

    used: bool
    """Whether the lookup ran."""
    prompt: str | None = None
    """The starting prompt it chose."""
    score: DecimalString | None = None
    """Score of the chosen prompt (mean target loss; lower is better)."""
    evaluations: int | None = Field(default=None, ge=0)
    """Number of candidate prompts scored."""
    latency_seconds: NonNegativeDecimal | None = None
    """How long the lookup took."""
    reason: ReasonString | None = None
    """Why it ran or was skipped, e.g. PromptBankSkipped."""
    message: str | None = Field(default=None, max_length=32768)
    """Human-readable details of the decision, e.g. why the job fell back to its own initial prompt."""


class TuningJobStatus(ApiModel):
    """Observed state of a TuningJob."""

    conditions: Conditions = Field(default_factory=list)
    """Accepted, Scheduled, Running and the summary Succeeded (or Failed)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The .metadata.generation this status describes."""
    allocated_gpus: int | None = Field(default=None, ge=0, alias="allocatedGPUs")
    """GPUs currently assigned to the job."""
    pods: list[str] = Field(default_factory=list)
    """Worker pods running the job."""
    iterations: int | None = Field(default=None, ge=0)
    """Optimizer steps completed."""
    current_metric: DecimalString | None = None
    """Latest value of the termination metric (loss when no target is set)."""
    initial_metric: DecimalString | None = None
    """The termination metric with the initial prompt, measured before the first step."""
    attempts: int | None = Field(default=None, ge=0)
    """Attempts started; more than one after a worker was lost (each resumes from the last checkpoint)."""
    predicted_completion_time: Timestamp | None = None
    """When the estimator expects the job to finish."""
    prompt_bank: PromptBankStatus | None = None
    """Prompt Bank decision and result."""
    optimized_prompt: str | None = None
    """Text projection of the tuned virtual tokens (nearest vocabulary tokens)."""
    artifact_uri: Uri | None = Field(default=None, alias="artifactURI")
    """Where the tuned prompt (virtual-token embeddings) was stored."""
    gpu_seconds: NonNegativeDecimal | None = Field(default=None, alias="gpuSeconds")
    """GPU time spent so far, in seconds."""
    slo_met: bool | None = None
    """Whether the job finished before its deadline; unset while running."""
    start_time: Timestamp | None = None
    """When the first worker started."""
    completion_time: Timestamp | None = None
    """When the job reached a terminal condition."""
    published_adapter: ResourceName | None = None
    """The LoRAAdapter created from spec.output.publish (set once it exists)."""
    co_served: bool | None = None
    """Whether the current (or last) attempt runs co-served: inside the serving engine of pods that
    serve inference (status.pods), in the token budget inference leaves each iteration."""
    co_serving_reason: str | None = None
    """Why the attempt runs on dedicated GPUs although its pod serves inference (unset otherwise)."""


class TuningJob(Resource):
    """TuningJob asks Elastune for an optimized prompt for an LLM within a deadline, at the lowest GPU
    cost."""

    kind: Literal["TuningJob"] = KIND_TUNING_JOB
    """Kind of the object: TuningJob."""
    spec: TuningJobSpec
    """Desired state."""
    status: TuningJobStatus | None = None
    """Observed state, written by the operator."""
