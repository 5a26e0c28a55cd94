"""LoRAAdapter: a LoRA adapter of a base LLM, served from warm pools (CaraServe)."""

from typing import Annotated, Literal

from pydantic import Field

from elastune_contract.api.common import ApiModel, Conditions, ModelName, Resource, Timestamp, Uri
from elastune_contract.api.constants import KIND_LORA_ADAPTER


class LoRAAdapterSpec(ApiModel):
    """Desired state of a LoRAAdapter."""

    base_model: ModelName
    """LLM the adapter was trained on; it is served by the WarmPool of that model."""
    rank: int = Field(default=8, ge=1, le=256)
    """LoRA rank r; serving cost grows with it (CaraServe's rank-aware routing)."""
    alpha: int = Field(default=16, ge=1)
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    target_modules: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    """Modules the adapter applies to, e.g. c_attn; the base model's PEFT defaults when unset."""
    weights: Uri
    """Where the adapter weights are stored."""


class AdapterPlacement(ApiModel):
    """Where one copy of the adapter is loaded."""

    pod: str = Field(min_length=1)
    """Worker pod holding the adapter."""
    tier: Literal["gpu", "host"]
    """gpu: in GPU memory, ready to serve; host: in host memory, served CPU-assisted while it loads."""
    since: Timestamp | None = None
    """When it was loaded into this tier."""


class LoRAAdapterStatus(ApiModel):
    """Observed state of a LoRAAdapter."""

    conditions: Conditions = Field(default_factory=list)
    """Ready is True while at least one copy is loaded."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The .metadata.generation this status describes."""
    loaded_on: list[AdapterPlacement] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["pod"]},
    )
    """Pods holding the adapter, one entry per pod."""


class LoRAAdapter(Resource):
    """LoRAAdapter registers LoRA weights for a base LLM so warm pools can serve them."""

    kind: Literal["LoRAAdapter"] = KIND_LORA_ADAPTER
    """Kind of the object: LoRAAdapter."""
    spec: LoRAAdapterSpec
    """Desired state."""
    status: LoRAAdapterStatus | None = None
    """Observed state, written by the operator."""
