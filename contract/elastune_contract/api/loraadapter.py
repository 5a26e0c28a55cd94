"""LoRAAdapter: a LoRA adapter or a tuned soft prompt of a base LLM, served from its WarmPool (CaraServe's
adapter registry; users know AIBrix ModelAdapter, KServe spec.model.lora, Dynamo DynamoModel)."""

from typing import Annotated, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from elastune_contract.api.common import (
    ApiModel,
    Conditions,
    DatasetUri,
    ModelName,
    NonNegativeDecimal,
    Resource,
    ResourceName,
    Timestamp,
)
from elastune_contract.api.constants import KIND_LORA_ADAPTER
from elastune_contract.api.retention import AdapterRetention

AdapterType = Literal["lora", "promptTuning"]
AdapterTier = Literal["device", "host"]
AMBIENT_RULE = "useAmbientCredentials applies to an s3:// artifactURL without an artifactSecret"


class LoRAAdapterSpec(ApiModel):
    """Desired state of a LoRAAdapter."""

    # A soft prompt has no rank: a rank given for one is a mistake the apiserver can catch.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.type != 'promptTuning' || !has(self.rank)",
                    "message": "rank applies to LoRA adapters only; a promptTuning artifact has none",
                    "fieldPath": ".rank",
                },
                {
                    "rule": "!has(self.artifactSecret) || self.artifactURL.startsWith('s3://')",
                    "message": "artifactSecret holds S3 credentials: it applies to an s3:// artifactURL only",
                    "fieldPath": ".artifactSecret",
                },
                {
                    "rule": "!has(self.useAmbientCredentials) || !self.useAmbientCredentials || "
                    "(self.artifactURL.startsWith('s3://') && !has(self.artifactSecret))",
                    "message": AMBIENT_RULE,
                    "fieldPath": ".useAmbientCredentials",
                },
            ]
        }
    )

    base_model: ModelName
    """The LLM the adapter was trained on: the model of a WarmPool, which serves it."""
    # Relative paths are resolved against the manifest's directory by `elastune serve` (like datasets).
    artifact_url: DatasetUri = Field(alias="artifactURL")
    """A PEFT save_pretrained directory: an absolute path in the worker pod, file:///, pvc://<claim>/<path>
    (a claim the WarmPool mounts) or s3://<bucket>/<prefix> (any S3-compatible endpoint; see artifactSecret).
    http(s):// is refused by the workers (not implemented)."""
    artifact_secret: ResourceName | None = None
    """For an s3:// artifactURL: a Secret in this namespace with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
    optionally AWS_ENDPOINT_URL, AWS_REGION, AWS_SESSION_TOKEN (KServe's and AIBrix's keys). It is mounted
    read-only into the WarmPool's worker pods, which download the artifact; the operator never reads it.
    Unset: no credentials, and the download is refused (StorageCredentialsUnset) unless
    useAmbientCredentials is set."""
    use_ambient_credentials: bool | None = None
    """For an s3:// artifactURL without an artifactSecret: use the worker pods' own identity (boto3's
    default chain: AWS_* environment, instance profile, IRSA). Only an adapter of the WarmPool's own
    namespace may; never implied by leaving artifactSecret out."""
    type: AdapterType = "lora"
    """lora: LoRA weights; promptTuning: a tuned soft prompt (virtual-token embeddings)."""
    rank: int | None = Field(default=None, ge=1, le=256)
    """LoRA rank r, checked against the artifact's adapter_config.json when given (read from it when not)."""
    alpha: int | None = Field(default=None, ge=1)
    """LoRA alpha, checked against the artifact when given."""
    target_modules: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    """Modules the adapter applies to, checked against the artifact when given."""
    replicas: int | None = Field(default=None, ge=1)
    """Worker pods that keep the adapter loaded; unset: placement decides from its popularity."""
    pinned: bool = False
    """Keep it on the device (never evicted to host memory) on each of its replicas."""
    retention: AdapterRetention = Field(default_factory=AdapterRetention, json_schema_extra={"default": {}})
    """What deleting the adapter removes: the artifact (default Retain); Delete only removes one a
    TuningJob of this namespace wrote and published as this adapter."""

    @model_validator(mode="after")
    def _ambient_for_s3_only(self) -> Self:
        # The CEL rule above, for manifests no apiserver checked (local mode).
        if self.use_ambient_credentials and (
            self.artifact_secret or not self.artifact_url.startswith("s3://")
        ):
            raise ValueError(AMBIENT_RULE)
        return self


class AdapterPlacement(ApiModel):
    """Where one copy of the adapter is loaded, as the worker reports it."""

    pod: str = Field(min_length=1)
    """Worker pod holding the adapter."""
    tier: AdapterTier
    """device: in a device slot, ready to serve; host: in host memory, served CPU-assisted while it loads."""
    since: Timestamp | None = None
    """When this pod was first seen holding it."""


class LoRAAdapterStatus(ApiModel):
    """Observed state of a LoRAAdapter."""

    conditions: Conditions = Field(default_factory=list)
    """Ready: validated and servable (False with the reason when it cannot be); Loaded: held by a pod."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The .metadata.generation this status describes."""
    rank: int | None = Field(default=None, ge=1)
    """Rank read from the artifact (LoRA only)."""
    loaded_on: list[AdapterPlacement] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["pod"]},
    )
    """Pods holding the adapter, one entry per pod, as the workers report it."""
    ready_replicas: int | None = Field(default=None, ge=0)
    """Pods holding it on the device."""
    load_seconds: NonNegativeDecimal | None = None
    """Measured seconds of the last load into a worker (storage to host memory and device)."""


class LoRAAdapter(Resource):
    """LoRAAdapter registers a LoRA adapter or a tuned soft prompt of a base LLM so its warm pool can serve
    it under the adapter's name (the OpenAI model field)."""

    kind: Literal["LoRAAdapter"] = KIND_LORA_ADAPTER
    """Kind of the object: LoRAAdapter."""
    spec: LoRAAdapterSpec
    """Desired state."""
    status: LoRAAdapterStatus | None = None
    """Observed state, written by the operator."""
