"""Builds a scheduling policy from its typed name (docs/design.md §9: the factory beside the
implementations)."""

from __future__ import annotations

from .baselines import ElasticFlowConfig, ElasticFlowPolicy, INFlessConfig, INFlessPolicy
from .estimator import Estimator
from .policy import POLICY_NAMES, Policy, PolicyName
from .prompttuner import PromptTunerConfig, PromptTunerPolicy

PolicyConfig = PromptTunerConfig | INFlessConfig | ElasticFlowConfig


def make_policy(name: PolicyName, estimator: Estimator, config: PolicyConfig | None = None) -> Policy:
    """The policy called ``name``, with ``config`` (its own config class) or its defaults.

    A config of another policy's class is an error, not silently ignored."""
    if name == "promptTuner":
        if config is None or isinstance(config, PromptTunerConfig):
            return PromptTunerPolicy(estimator, config)
    elif name == "infless":
        if config is None or isinstance(config, INFlessConfig):
            return INFlessPolicy(estimator, config)
    elif name == "elasticflow":
        if config is None or isinstance(config, ElasticFlowConfig):
            return ElasticFlowPolicy(estimator, config)
    else:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    raise TypeError(f"policy {name!r} takes its own config class, not {type(config).__name__}")
