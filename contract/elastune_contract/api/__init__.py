"""Elastune API (elastune.dev/v1alpha1): the resource models, the CRDs generated from them, and checks.

The worker may import these models (they are the contract); nothing here imports torch.
"""

from elastune_contract.api.common import (
    Condition,
    ObjectMeta,
    get_condition,
    is_condition_true,
    set_condition,
)
from elastune_contract.api.loraadapter import LoRAAdapter, LoRAAdapterSpec, LoRAAdapterStatus
from elastune_contract.api.resources import AnyResource, InvalidResource, parse_resource
from elastune_contract.api.tuningjob import TuningJob, TuningJobSpec, TuningJobStatus
from elastune_contract.api.warmpool import WarmPool, WarmPoolSpec, WarmPoolStatus
from elastune_contract.vocabulary import ConditionType, Reason

__all__ = [
    "AnyResource",
    "Condition",
    "ConditionType",
    "InvalidResource",
    "LoRAAdapter",
    "LoRAAdapterSpec",
    "LoRAAdapterStatus",
    "ObjectMeta",
    "Reason",
    "TuningJob",
    "TuningJobSpec",
    "TuningJobStatus",
    "WarmPool",
    "WarmPoolSpec",
    "WarmPoolStatus",
    "get_condition",
    "is_condition_true",
    "parse_resource",
    "set_condition",
]
