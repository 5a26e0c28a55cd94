"""Elastune API (elastune.dev/v1alpha1): the resource models, the CRDs generated from them, and checks.

The worker may import these models (they are the contract); nothing here imports torch.
"""

from elastune_operator.api.common import (
    Condition,
    ConditionType,
    ObjectMeta,
    Reason,
    get_condition,
    is_condition_true,
    set_condition,
)
from elastune_operator.api.loraadapter import LoRAAdapter, LoRAAdapterSpec, LoRAAdapterStatus
from elastune_operator.api.resources import AnyResource, InvalidResource, parse_resource
from elastune_operator.api.tuningjob import TuningJob, TuningJobSpec, TuningJobStatus
from elastune_operator.api.warmpool import WarmPool, WarmPoolSpec, WarmPoolStatus

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
