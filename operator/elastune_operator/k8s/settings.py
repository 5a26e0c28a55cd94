"""Operator settings: one typed object, read from ELASTUNE_* environment variables and validated at
start with errors that name the variable (docs/design.md §7)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from elastune_contract.api.constants import LABEL_POOL, POOL_COLD
from elastune_operator.scheduling.policy import POLICY_NAMES, PolicyName

WORKER_PASSWORD_ENV = "ELASTUNE_REDIS_WORKER_PASSWORD"
"""The workers' Redis ACL password, copied into WarmPool namespaces (from a Secret; not a setting field, so
it never appears in a settings dump)."""
DEFAULT_COLD_POOL_SELECTOR = f"{LABEL_POOL}={POOL_COLD}"
"""The label the cold pool's GPU nodes carry (docs/design.md §5; e2e/setup-kind.sh labels its node so)."""


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class OperatorSettings:
    redis_url: str
    """ELASTUNE_REDIS_URL: the control bus (worker registry, assignments, events). Required."""
    redis_secret: str | None = "elastune-redis"
    """ELASTUNE_REDIS_SECRET: set (any name) when Redis requires auth: then each WarmPool's workers get a
    Redis user of their own (k8s.redis_users, Secret ``<pool>-redis-user``), never this Secret's shared
    password; empty for a Redis without auth. The operator itself reads ELASTUNE_REDIS_PASSWORD."""
    redis_secret_key: str = "password"
    """ELASTUNE_REDIS_SECRET_KEY: the key of the password inside that Secret."""
    redis_worker_username: str | None = None
    """ELASTUNE_REDIS_WORKER_USERNAME: the workers' Redis ACL user (the chart's bundled Redis:
    elastune-worker); the operator then copies ELASTUNE_REDIS_WORKER_PASSWORD, not its own password, into
    the WarmPool namespaces (its own user is ELASTUNE_REDIS_USERNAME)."""
    redis_rotation_s: float = 604800.0
    """ELASTUNE_REDIS_ROTATION: seconds between new passwords of each WarmPool's Redis user (k8s.redis_users;
    a week: long enough that pods rarely hold the previous one, short enough to bound a leaked one); 0
    rotates only on request (the WarmPool annotation rotate.elastune.dev/redis-password)."""
    redis_pool_budget_bytes: int = 128 << 20
    """ELASTUNE_REDIS_POOL_BUDGET: bytes of Redis each WarmPool's workers may hold under their keys (their
    records, and the events and gradients of the jobs of the namespaces the pool admits), counted every
    15 s (k8s.redis_budget); over it, the pool's user loses its write rights. 128 MiB: a few steps of
    gradients of a large prompt; 0 turns the check off."""
    channel_url: str | None = None
    """ELASTUNE_CHANNEL_URL: gradient storage channel (redis:// or memcached://); default: the bus."""
    cold_pool_node_selector: str = DEFAULT_COLD_POOL_SELECTOR
    """ELASTUNE_COLD_POOL_NODE_SELECTOR: label selector (Kubernetes syntax) of the nodes whose
    allocatable nvidia.com/gpu make up the cold pool all WarmPools grow from, followed as nodes come
    and go (k8s.node_capacity); empty selects every node."""
    work_dir: Path = Path("/tmp/elastune")
    """ELASTUNE_WORK_DIR: checkpoint and default artifact root as the worker pods see it (the worker
    image runs non-root with a writable /tmp). For checkpoints and artifacts to outlive a pod, mount a
    ReadWriteMany volume at this path in every worker pod."""
    metrics_port: int = 9090
    """ELASTUNE_METRICS_PORT: Prometheus /metrics of the operator (0 disables)."""
    namespace: str = "elastune"
    """ELASTUNE_NAMESPACE: key prefix in Redis (several installations can share one Redis)."""
    collective_timeout_s: float = 120.0
    """ELASTUNE_COLLECTIVE_TIMEOUT: seconds a worker waits for its peers' gradients before failing."""
    scheduling_policy: PolicyName = "promptTuner"
    """ELASTUNE_SCHEDULING_POLICY: promptTuner (default), or one of the paper's baselines (infless,
    elasticflow) to compare them on a real cluster."""

    check_artifact_paths: bool = True
    """ELASTUNE_CHECK_ARTIFACT_PATHS: check file:// and path artifactURLs of LoRAAdapters on the
    operator's own filesystem. The chart sets false: those paths are the worker pods' (a published
    prompt lives under their work dir), so the workers' load checks them and reports failures."""
    pod_unschedulable_grace_s: float = 60.0
    """ELASTUNE_POD_UNSCHEDULABLE_GRACE: seconds a worker pod may stay Unschedulable before its
    attempt fails with that reason (the cluster autoscaler may add a node meanwhile)."""
    attempt_start_timeout_s: float = 120.0
    """ELASTUNE_ATTEMPT_START_DEADLINE (the variable's name kept for compatibility; an attempt timeout,
    not a TuningJob's deadline): seconds a dispatched attempt may take to start on its warm workers
    before it is cancelled and retried (AttemptNotStarted)."""
    attempt_stall_floor_s: float = 300.0
    """ELASTUNE_ATTEMPT_STALL_FLOOR: an attempt timeout; seconds a running attempt may go without
    progress at least (more when its measured step time says so) before it is cancelled and retried
    (AttemptStalled)."""
    worker_network_policy: str | None = None
    """ELASTUNE_WORKER_NETWORK_POLICY: JSON ``{"name", "ingress": [NetworkPolicy ingress rules]}`` the
    operator writes as a NetworkPolicy over the worker pods of each WarmPool namespace (the chart sets it
    when the operator watches all namespaces; with watched namespaces the chart renders the policies)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        env = dict(os.environ if env is None else env)
        names = {
            "redis_url": "ELASTUNE_REDIS_URL",
            "redis_secret": "ELASTUNE_REDIS_SECRET",
            "redis_secret_key": "ELASTUNE_REDIS_SECRET_KEY",
            "redis_worker_username": "ELASTUNE_REDIS_WORKER_USERNAME",
            "redis_rotation_s": "ELASTUNE_REDIS_ROTATION",
            "redis_pool_budget_bytes": "ELASTUNE_REDIS_POOL_BUDGET",
            "channel_url": "ELASTUNE_CHANNEL_URL",
            "cold_pool_node_selector": "ELASTUNE_COLD_POOL_NODE_SELECTOR",
            "work_dir": "ELASTUNE_WORK_DIR",
            "metrics_port": "ELASTUNE_METRICS_PORT",
            "namespace": "ELASTUNE_NAMESPACE",
            "collective_timeout_s": "ELASTUNE_COLLECTIVE_TIMEOUT",
            "scheduling_policy": "ELASTUNE_SCHEDULING_POLICY",
            "check_artifact_paths": "ELASTUNE_CHECK_ARTIFACT_PATHS",
            "pod_unschedulable_grace_s": "ELASTUNE_POD_UNSCHEDULABLE_GRACE",
            "attempt_start_timeout_s": "ELASTUNE_ATTEMPT_START_DEADLINE",
            "attempt_stall_floor_s": "ELASTUNE_ATTEMPT_STALL_FLOOR",
            "worker_network_policy": "ELASTUNE_WORKER_NETWORK_POLICY",
        }
        values: dict[str, object] = {}
        for f in fields(cls):
            var = names[f.name]
            raw = env.get(var)
            if raw is None:
                continue
            try:
                if f.name == "cold_pool_node_selector":
                    values[f.name] = raw.strip()  # empty is a valid selector: every node
                elif f.name in ("metrics_port", "redis_pool_budget_bytes"):
                    values[f.name] = int(raw)
                elif f.name.endswith("_s"):
                    values[f.name] = float(raw)
                elif f.name == "work_dir":
                    values[f.name] = Path(raw)
                elif f.name == "check_artifact_paths":
                    if raw.lower() not in ("true", "false"):
                        raise ValueError("must be true or false")
                    values[f.name] = raw.lower() == "true"
                elif f.name == "worker_network_policy":
                    policy = json.loads(raw) if raw else None
                    shaped = isinstance(policy, dict) and isinstance(policy.get("ingress"), list)
                    if policy is not None and not (shaped and policy.get("name")):
                        raise ValueError('must be JSON {"name": ..., "ingress": [...]}')
                    values[f.name] = raw or None
                elif f.name == "scheduling_policy":
                    if raw not in POLICY_NAMES:
                        raise ValueError(f"must be one of {', '.join(POLICY_NAMES)}")
                    values[f.name] = raw
                else:
                    values[f.name] = raw or None
            except ValueError as exc:
                raise SettingsError(f"{var}={raw!r}: {exc}") from exc
        if not values.get("redis_url"):
            raise SettingsError("ELASTUNE_REDIS_URL is required (redis://host:6379/0)")
        if not str(values["redis_url"]).startswith(("redis://", "rediss://")):
            raise SettingsError(
                f"ELASTUNE_REDIS_URL={values['redis_url']!r}: must start with redis:// or rediss://"
            )
        return cls(**values)  # type: ignore[arg-type]
