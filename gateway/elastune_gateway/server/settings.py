"""The gateway's settings: one typed object, each field with its unit and why the default."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from elastune_contract.openai_api.limits import (
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_STOP_CHARS,
    DEFAULT_MAX_STOP_TOKEN_IDS,
    RequestLimits,
)
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
    """Per-pool routing policy: ``namespace/name`` → policy for one WarmPool, or ``name`` → policy for the
    pools of that name in every namespace (the namespaced entry wins); a pool's published record may also
    name one."""
    hold_timeout_s: float = Field(default=30.0, ge=0)
    """How long a request waits for a warm endpoint when its pool has none (scale from zero), unless
    the pool's record says otherwise; then 503 with Retry-After."""
    max_waiting: int = Field(default=1024, ge=0)
    """Requests held in the waiting room at most (all models); beyond it new ones get 429."""
    retry_after_s: int = Field(default=5, ge=1)
    """The Retry-After of a 503 (no warm endpoint) or 429 (waiting room full)."""
    refresh_s: float = Field(default=0.25, gt=0)
    """How often the endpoint directory re-reads the registry (workers publish every second)."""
    registry_stale_s: float = Field(default=60.0, gt=0)
    """/readyz fails when the last good read of the registry is older than this AND it named no endpoint:
    with endpoints known the gateway serves from its last view however old (a Redis outage must not turn
    every replica NotReady at once); without any, a fresh view still lets it hold requests while a pool
    scales up, an old one does not."""
    failure_cooldown_s: float = Field(default=10.0, ge=0)
    """An endpoint that failed a request gets no new requests for this long (the registry forgets a
    dead worker after its 10 s heartbeat TTL), or until it re-registers as a new process."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for a worker's status line (a whole non-streamed answer is computed before it):
    then 504, not retried (the worker may still be computing). A worker that goes silent meanwhile (its
    registry record expires) is left sooner and the request retried elsewhere."""
    stream_idle_timeout_s: float = Field(default=30.0, gt=0)
    """Longest silence between two chunks of a streamed answer: then the stream ends with an error
    event. Above a decode step's worst case and a GC pause or a throttled CPU (a worker paused 20 s
    keeps its streams), far below the ten minutes a hung pod held a client before."""
    upstream_total_timeout_s: float = Field(default=1800.0, gt=0)
    """Longest a forwarded request may take from sending it to the last byte of its answer, however
    steadily the worker sends (a stream trickling one byte under the idle timeout would otherwise hold a
    client and a slot for ever): then 504, or an error event once streaming. Above the longest answer a
    worker is configured for (32k tokens at 20 tokens/s is 27 minutes)."""
    upstream_idle_s: float = Field(default=4.0, gt=0)
    """A kept-alive connection to a worker idle longer than this is closed, never reused: below the
    workers' keep-alive (uvicorn's 5 s), so the gateway never writes a request onto a socket the worker
    is closing; idle connections are also pruned on a timer."""
    upstream_max_header_bytes: int = Field(default=64 << 10, ge=1024)
    """Largest head (status line and headers) of a worker's answer; more: the request fails (502) and
    the connection is dropped. A worker sends a handful of short headers."""
    upstream_max_headers: int = Field(default=100, ge=1)
    """Most headers in a worker's answer; more: as above."""
    upstream_max_event_bytes: int = Field(default=1 << 20, ge=1024)
    """Largest SSE event (bytes between two blank lines) of a streamed answer: the gateway gathers
    events to read usage; more: the stream ends with an error event and the connection is dropped."""
    upstream_max_body_bytes: int = Field(default=64 << 20, ge=1024)
    """Largest non-streamed answer of a worker (read whole before it is relayed); more: 502."""
    max_request_head_bytes: int = Field(default=32 << 10, ge=1024)
    """Largest request head (request line and headers) a client may send; more: 431 and the connection
    closed, before the app or authentication runs (uvicorn sets none: server/http_guard.py). nginx's
    default allows 4 buffers of 8 KiB."""
    request_head_timeout_s: float = Field(default=10.0, gt=0)
    """Longest a client may take to send a request's head (from connecting, or from the request's first
    byte on a kept-alive connection); then 408 and closed: a slowloris client holds a connection this
    long at most (nginx's client_header_timeout is 60 s; a real client sends its head in one write)."""
    request_body_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a client may take to send a request's body after its head; then the connection is
    closed (a body is at most ``max_request_bytes``)."""
    max_attempts: int = Field(default=3, ge=1)
    """Endpoints tried for one request when the first cannot take it (before any byte was sent)."""
    length_predictor_url: str | None = None
    """SSJF: the output-length predictor service (``python -m elastune_ssjf``); None: FCFS."""
    length_predictor_timeout_s: float = Field(default=0.5, gt=0)
    """A prediction that takes longer is skipped (the request goes FCFS) rather than delayed."""
    max_request_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BYTES, ge=1)
    """Largest request body (bytes); a bigger one gets 413 before it is parsed (as on the workers)."""
    max_prompt_chars: int = Field(default=DEFAULT_MAX_PROMPT_CHARS, ge=1)
    """Characters of prompt text (a prompt, or all messages' contents); more: 400 naming the field."""
    max_stop_chars: int = Field(default=DEFAULT_MAX_STOP_CHARS, ge=1)
    """Characters of one stop string; more: 400 (``stop``)."""
    max_stop_token_ids: int = Field(default=DEFAULT_MAX_STOP_TOKEN_IDS, ge=1)
    """stop_token_ids one request may name; more: 400 (``stop_token_ids``)."""

    auth: Literal["required", "off"] = "off"
    """``required``: every /v1 request needs ``Authorization: Bearer <key>`` of a key in the map the
    operator publishes (API key Secrets; 401/403/429). The chart turns it on (gateway.auth.enabled);
    ``elastune serve`` turns it on when its -f files hold key Secrets, else serves on loopback only."""
    vouched_only: bool = False
    """Forward only to workers a pool record vouches for (id and address, from the pods the operator
    lists): a model no pool record vouches for gets no endpoint. Off: such a model follows the registry
    (a gateway without an operator, or an operator older than the list). The chart turns it on."""
    fair_share: bool = True
    """Per-key fair sharing of busy endpoints: each endpoint gets at most ``endpoint_max_inflight``
    requests at once, and the requests beyond wait in the gateway in per-key queues served by virtual
    token counters (``fair_line.py``). Off: every request is forwarded at once and the engine queues
    them first-come-first-served (a key that floods delays the others)."""
    endpoint_max_inflight: int = Field(default=0, ge=0)
    """Requests one endpoint gets at once with ``fair_share``; 0: the batch size it publishes
    (``max_num_seqs``), so the requests beyond it wait in the fair line rather than in its queue."""
    max_queued_per_key: int = Field(default=256, ge=1)
    """Requests of one key waiting in the fair line at most; more: 429 + Retry-After to that key."""
    max_queued: int = Field(default=4096, ge=1)
    """Requests waiting in the fair line at most (all keys and models); more: 503 + Retry-After."""
    queue_timeout_s: float = Field(default=60.0, gt=0)
    """Longest wait in the fair line for a free slot; then 503 + Retry-After."""
    auth_refresh_s: float = Field(default=1.0, gt=0)
    """How often the key map is re-read: a revoked key stops working within this (plus the operator's
    reaction to the Secret event)."""
    default_max_tokens: int = Field(default=512, ge=1)
    """Completion tokens a request that names no max_tokens reserves against its key's tokens/min at
    admission (settled with what it used when its answer ends)."""
    auth_stale_s: float = Field(default=30.0, gt=0)
    """How long the last confirmed key map stays in force when it cannot be confirmed (Redis down, or
    no map published): past it every request gets 503 + Retry-After (fail closed). Six of the operator's
    re-publish periods (5 s), so a FLUSHALL never reaches it."""

    request_credential_ttl_s: float = Field(default=30.0, gt=0, le=300)
    """Lifetime of the credential signed onto each request forwarded to a worker (the key comes from
    ``$ELASTUNE_REQUEST_KEY_FILE`` or ``$ELASTUNE_REQUEST_KEY``): the worker checks it once, on arrival,
    so it needs to cover transit and retries only; workers allow 5 s of clock skew on either side."""

    limits_on_redis_outage: Literal["closed", "open"] = "closed"
    """What a key with requests/min or tokens/min gets when Redis cannot count them. ``closed``: 503 +
    Retry-After: a tenant's quota is a contract with the other tenants, and a gateway that stops
    counting lets one key take the whole fleet for as long as Redis is away. ``open``: let the request
    through uncounted (availability first; for a single-tenant gateway). Counted and logged either way."""
    worker_ca_file: str | None = None
    """PEM bundle of the CA that signs the workers' serving certificates: set, workers are reached over
    HTTPS only, verified against it (server/tls.py); a worker registered at http:// is refused. None:
    plain HTTP inside the cluster. The chart sets it (gateway.workerTLS)."""
    worker_tls_server_name: str = "elastune-worker"
    """The DNS name every worker certificate carries and the gateway checks (it dials pod IPs, which no
    certificate names ahead of time)."""
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of a second listener that serves only /metrics (per-key, per-model and per-endpoint series:
    every tenant's names), so it can be scraped where clients cannot reach it. None: with ``auth`` off
    (one tenant) /metrics stays on the client port; with ``auth`` required it is served nowhere and the
    client port answers 404 for it. The chart sets it (gateway.metricsPort)."""

    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_request_bytes=self.max_request_bytes,
            max_prompt_chars=self.max_prompt_chars,
            max_stop_chars=self.max_stop_chars,
            max_stop_token_ids=self.max_stop_token_ids,
        )

    def policy_for(self, pool: str, published: str | None, pool_id: str = "") -> RoutingPolicyName:
        """``pool``: the WarmPool's name; ``pool_id``: its ``namespace/name`` ("" when unknown)."""
        return (
            (self.pool_policies.get(pool_id) if pool_id else None)
            or self.pool_policies.get(pool)
            or _policy_name(published)
            or self.default_policy
        )


def _policy_name(name: str | None) -> RoutingPolicyName | None:
    from ..routing.policy import ROUTING_POLICY_NAMES

    for known in ROUTING_POLICY_NAMES:
        if name == known:
            return known
    return None
