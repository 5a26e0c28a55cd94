"""Builds a routing policy from its typed name (docs/design.md §9: the factory beside the
implementations)."""

from __future__ import annotations

from .basic import (
    FirstFitRouter,
    LeastLoadRouter,
    MostIdleRouter,
    RandomConfig,
    RandomRouter,
    RoundRobinRouter,
)
from .combined import CombinedConfig, CombinedRouter
from .policy import ROUTING_POLICY_NAMES, Router, RoutingPolicyName
from .preble import PrebleConfig, PrebleRouter
from .rank_aware import RankAwareConfig, RankAwareRouter

RouterConfig = PrebleConfig | RankAwareConfig | CombinedConfig | RandomConfig


def make_router(name: RoutingPolicyName, config: RouterConfig | None = None) -> Router:
    """The policy called ``name``, with ``config`` (its own config class) or its defaults.

    A config of another policy's class is an error, not silently ignored; the policies without settings
    take none."""
    if name == "roundRobin":
        if config is None:
            return RoundRobinRouter()
    elif name == "leastLoad":
        if config is None:
            return LeastLoadRouter()
    elif name == "mostIdle":
        if config is None:
            return MostIdleRouter()
    elif name == "firstFit":
        if config is None:
            return FirstFitRouter()
    elif name == "random":
        if config is None or isinstance(config, RandomConfig):
            return RandomRouter(config)
    elif name == "preble":
        if config is None or isinstance(config, PrebleConfig):
            return PrebleRouter(config)
    elif name == "rankAware":
        if config is None or isinstance(config, RankAwareConfig):
            return RankAwareRouter(config)
    elif name == "combined":
        if config is None or isinstance(config, CombinedConfig):
            return CombinedRouter(config)
    else:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(ROUTING_POLICY_NAMES)}")
    raise TypeError(f"routing policy {name!r} takes {_expected(name)}, not {type(config).__name__}")


def _expected(name: str) -> str:
    return {
        "random": "RandomConfig",
        "preble": "PrebleConfig",
        "rankAware": "RankAwareConfig",
        "combined": "CombinedConfig",
    }.get(name, "no config")
