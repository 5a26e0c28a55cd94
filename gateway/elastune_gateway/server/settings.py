"""The gateway's settings: one typed object, each field with its unit and why the default."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from elastune_contract.protocol import DEFAULT_NAMESPACE

from ..routing.policy import RoutingPolicyName


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str = "redis://127.0.0.1:6379/0"
    """The registry the workers publish to (and the control plane publishes serving pools to)."""
    namespace: str = DEFAULT_NAMESPACE
    default_policy: RoutingPolicyName = "preble"
    """Routing policy of a pool that names none (Preble's E2: prefix reuse with load balancing)."""
    pool_policies: dict[str, RoutingPolicyName] = Field(default_factory=dict)
    """Per-pool routing policy (pool name → policy); a pool's published record may also name one."""
    hold_timeout_s: float = Field(default=30.0, ge=0)
    """How long a request waits for a warm endpoint when its pool has none (scale from zero), unless
    the pool's record says otherwise; then 503 with Retry-After."""
    max_waiting: int = Field(default=1024, ge=0)
    """Requests held in the waiting room at most (all models); beyond it new ones get 429."""
    retry_after_s: int = Field(default=5, ge=1)
    """The Retry-After of a 503 (no warm endpoint) or 429 (waiting room full)."""
    refresh_s: float = Field(default=0.25, gt=0)
    """How often the endpoint directory re-reads the registry (workers publish every second)."""
    failure_cooldown_s: float = Field(default=10.0, ge=0)
    """An endpoint that failed a request gets no new requests for this long (the registry forgets a
    dead worker after its 10 s heartbeat TTL), or until it re-registers as a new process."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0)
    """Longest silence of a worker within a response: a hung pod ends the request with an error."""
    max_attempts: int = Field(default=3, ge=1)
    """Endpoints tried for one request when the first cannot take it (before any byte was sent)."""
    length_predictor_url: str | None = None
    """SSJF: the output-length predictor service (``python -m elastune_worker.ssjf``); None: FCFS."""
    length_predictor_timeout_s: float = Field(default=0.5, gt=0)
    """A prediction that takes longer is skipped (the request goes FCFS) rather than delayed."""

    def policy_for(self, pool: str, published: str | None) -> RoutingPolicyName:
        return self.pool_policies.get(pool) or _policy_name(published) or self.default_policy


def _policy_name(name: str | None) -> RoutingPolicyName | None:
    from ..routing.policy import ROUTING_POLICY_NAMES

    for known in ROUTING_POLICY_NAMES:
        if name == known:
            return known
    return None
