"""The pull protocol between the control plane and worker processes, over Redis (docs/design.md §5).

Workers need no inbound network path from the operator: each worker registers itself, heartbeats,
and pops its job assignments from its own queue; rank 0 of a job reports progress and the result on
the job's event stream. Both sides import this module (part of the shared contract), so the key
layout and the message shapes exist once; the Redis client that reads and writes them is
``elastune_common.bus.Bus``.

Keys (``ns`` defaults to ``elastune``):

- ``{ns}:worker:{id}`` — the worker's ``WorkerRecord`` as JSON, with a TTL refreshed by its heartbeat:
  a worker whose key expired is gone (pod deleted, process killed). On Kubernetes the id is
  ``<pod namespace>/<pod name>`` (``pod_worker_id``), so same-named pods of two namespaces never share a
  record, a placement or an assignment queue.
- ``{ns}:workers`` — set of worker ids ever registered (pruned when their record expired).
- ``{ns}:assign:{id}`` — list of ``Assignment`` JSON; the worker BLPOPs it, so it runs them in order.
- ``{ns}:job:{job}:events`` — stream of ``Event`` JSON: survives restarts of the control plane, which
  re-reads it from the last id it processed (kept in the job's status by the operator).
- ``{ns}:job:{job}:cancel:{attempt}`` — set when an attempt must stop (job deleted, a peer died).
- ``{ns}:serving-pools`` — hash of ``ServingPoolRecord`` JSON, one field per WarmPool that serves, named
  ``<namespace>/<pool>`` (``pool_id``): two namespaces' WarmPools of one name each keep their record.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from enum import StrEnum
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from elastune_contract.api.warmpool import namespace_admitted

DEFAULT_NAMESPACE = "elastune"
PASSWORD_ENV = "ELASTUNE_REDIS_PASSWORD"
"""Redis password when the URL carries none (the storage channel reads the same variable)."""
USERNAME_ENV = "ELASTUNE_REDIS_USERNAME"
"""Redis ACL user (operator, gateway or worker role: redis_acl.py) when the URL names none."""
HEARTBEAT_SECONDS = 1.0
"""How often a worker refreshes its record."""
WORKER_TTL_SECONDS = 10
"""A worker silent for this long is considered gone (ten missed heartbeats)."""
EVENTS_TTL_SECONDS = 7 * 24 * 3600
"""Event streams of finished jobs expire after a week; status already holds what matters."""


class WorkerState(StrEnum):
    STARTING = "starting"  # loading the runtime and weights (not warm yet)
    READY = "ready"  # warm and idle: takes the next assignment
    BUSY = "busy"  # running an assignment
    FAILED = "failed"  # cannot serve (e.g. the model does not load); stays up to report why


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def dumps(self) -> str:
        return self.model_dump_json()


class ServingCost(_Message):
    """A worker's profiled cost functions (for routing): seconds per step as measured on its device."""

    prefill_s_per_token: float
    """Prefill time per prompt token (the slope of a fit over chunk sizes)."""
    decode_step_base_s: float
    """Decode step time at batch 1 (intercept of step time = base + per_seq x batch)."""
    decode_step_per_seq_s: float
    """Added decode step time per request in the batch."""
    lora_kernel: str | None = None
    """padded | unpadded when the worker serves LoRA adapters (None: it does not)."""
    lora_a_s: float = 0.0
    """LoRA decode cost per unit: per (batch × max rank) slot for padded, per rank summed for unpadded."""
    lora_b_s: float = 0.0
    """Fixed LoRA cost of a decode step once any request in it uses an adapter."""
    device: str = ""
    """The torch device type the costs were measured on (cuda | cpu; empty: not said). The control
    plane's co-serving model differs by device (``scheduling.coserving.CoServeModel``)."""


class AdapterState(_Message):
    """A LoRA adapter loaded on a worker, and where it is now."""

    name: str
    """The name clients send as ``model`` (the LoRAAdapter's metadata.name)."""
    namespace: str = ""
    """The LoRAAdapter's namespace ("" for one loaded by name alone, e.g. by hand): with ``name`` its
    identity (``adapter_id``), so two namespaces' adapters of one name on one worker stay apart."""
    rank: int
    tier: str
    """device (in a device slot) | host (in host memory) | storage (registered, read on demand)."""
    load_seconds: float | None = None
    """How long its last load into this worker took (storage to host memory), when the worker knows."""
    running: int = 0
    """Running requests using it: placement never takes it from this worker while > 0."""


class ServingState(_Message):
    """What a serving worker publishes with every heartbeat (the gateway's view of it)."""

    model: str
    """The model id clients send."""
    max_model_len: int
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    cost: ServingCost | None = None
    max_num_seqs: int = 0
    """Requests in the running batch at most (0: not published)."""
    kv_capacity_tokens: int = 0
    """KV-cache size in tokens: what its prefix cache can hold at most (0: not published)."""
    max_loras: int = 0
    """Device adapter slots (0: the worker serves no LoRA adapters)."""
    adapters: list[AdapterState] = Field(default_factory=list)
    adapter_error: str | None = None
    """The last adapter load that failed, and why (cleared by the next load that succeeds)."""
    placement_errors: dict[str, str] = Field(default_factory=dict)
    """Adapters the control plane placed here that failed to load: ``adapter_id`` -> why (LoRAAdapter
    status)."""
    placement_reasons: dict[str, str] = Field(default_factory=dict)
    """The reason of each placement error, when the worker knows it (a vocabulary constant such as
    StorageAccessDenied); the others are AdapterLoadFailed."""
    last_request_at: float | None = None
    """Unix time the last request arrived (the control plane keeps pods that serve from going idle)."""
    utilization: float = 0.0
    """Share of the time since the previous heartbeat the engine spent on inference steps: what is left
    is the spare budget a co-served tuning job can use."""


class WorkerRecord(_Message):
    id: str
    pool: str
    model: str
    state: WorkerState
    url: str = ""
    """http://host:port of the worker's server (informational: dispatch never needs it)."""
    metrics_url: str = ""
    """http://host:port/metrics of its metrics listener, apart from ``url`` (informational: what a local
    scraper or a test reads; on a cluster Prometheus finds the pod's ``metrics`` container port)."""
    pid: int = 0
    started_at: float
    """Unix time the process started: T_cold is measured from here to ``ready_at``."""
    ready_at: float | None = None
    heartbeat: float = 0.0
    job: str | None = None
    attempt: int | None = None
    rank: int | None = None
    world: int | None = None
    reason: str | None = None
    message: str | None = None
    serving: ServingState | None = None
    """Set while the worker serves /v1 (refreshed with every heartbeat)."""


class ServingPoolRecord(_Message):
    """A serving pool as the control plane publishes it for the gateway (one per WarmPool that serves).

    It lets the gateway know a model whose pool has no warm pod (scaled to zero): requests for it wait
    up to ``hold_timeout_s`` instead of getting a 404."""

    pool: str
    model: str
    """The model id clients send (the served model name of the pool's workers)."""
    routing_policy: str | None = None
    """The pool's routing policy by name (the gateway's RoutingPolicyName); None: the gateway's default."""
    hold_timeout_s: float = Field(default=30.0, ge=0)
    """How long a request waits in the gateway for a warm pod before a 503."""
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    namespace: str = ""
    """The WarmPool's namespace ("" from an operator that predates the field: admits everyone)."""
    admits: list[str] = Field(default_factory=list)
    """Other namespaces whose callers may use the pool's base model (its spec.allowedNamespaces; ``*``:
    every namespace). The gateway resolves a base model name for a caller of the pool's namespace or of
    one listed here (``pool_admits``)."""
    adapters: dict[str, int] = Field(default_factory=dict)
    """LoRAAdapters (and published prompts, rank 0) of the pool's model: ``adapter_id`` (namespace/name)
    -> rank. The gateway knows them while no pod holds them (scaled to zero, or still loading) and holds
    their requests."""
    unservable: dict[str, str] = Field(default_factory=dict)
    """Adapters of ``adapters`` that cannot be served for a reason scaling does not fix (their load
    failed, the artifact is missing or wrong): ``adapter_id`` -> ``"Reason: message"`` as the
    LoRAAdapter's condition says. The gateway answers their requests at once with that reason instead
    of holding them for a pool that is not the problem."""
    vouched: dict[str, str] | None = None
    """The pool's workers as the control plane knows them, from a source no worker writes (the pods the
    API lists, the processes the local backend started): worker id -> ``host`` or ``host:port``
    (``vouched_address``). The gateway forwards to a worker of this model only when its registry
    record's id and URL match an entry here (``vouched_url``), so a worker credential that rewrites
    another worker's record cannot redirect its traffic. None: an operator that predates the field."""


class PlacedAdapter(_Message):
    """An adapter the control plane wants a worker to hold (adapter placement, pulled by the worker),
    under its ``adapter_id`` in the worker's placement hash: the worker loads it as (namespace, name)."""

    url: str
    """The artifact (PEFT directory) as the worker resolves it: a path, file://, pvc://claim/path or
    s3://bucket/prefix."""
    secret: str | None = None
    """For s3://: the name of the Secret (in the pool's namespace, mounted into its pods) with the
    credentials and endpoint, or AMBIENT_CREDENTIALS when the adapter sets useAmbientCredentials (None:
    the worker refuses the download); only the name travels through Redis, never its content."""
    tier: str = "host"
    """device: keep it in a device slot (pinned or popular); host: keep it in host memory."""


class ServingDemand(_Message):
    """Requests the gateway holds for a model with no warm endpoint: the operator scales the pool up."""

    model: str
    waiting: int
    oldest_since: float
    """Unix time the oldest waiting request arrived."""
    updated_at: float


class Assignment(_Message):
    """One worker's share of one attempt of a TuningJob."""

    job: str
    """Job key, ``namespace/name``."""
    attempt: int = Field(ge=1)
    rank: int = Field(ge=0)
    world: int = Field(ge=1)
    model: str
    """The LLM the job needs; a worker holding another model refuses the assignment."""
    spec: dict[str, Any]
    """The TuningJob spec as the API stores it (camelCase): the contract, validated again by the worker."""
    dataset: str
    """Where this worker reads the JSONL (the spec's URI, resolved by the control plane)."""
    channel_url: str = ""
    """Storage channel of the gradient all-reduce (redis:// or memcached://); unused when world == 1."""
    comm_job: str
    """All-reduce key of this attempt: keys of a failed attempt can never mix into the retry's."""
    collective_timeout_s: float = 60.0
    checkpoint_dir: str
    artifact_dir: str
    eval_every: int = Field(default=10, ge=1)
    checkpoint_every: int = Field(default=10, ge=1)
    progress_every: int = Field(default=10, ge=1)
    """Rank 0 reports progress every this many steps (and after every evaluation)."""
    eval_fraction: float = 0.1
    max_eval: int = 64
    seed: int = 0
    owner_uid: str = ""
    """metadata.uid of the TuningJob: rank 0 writes it into the owner marker beside the checkpoint and
    artifact locations (elastune_worker.storage.ownership), so the job's deletion removes only its files."""
    proof: str = ""
    """The attempt's proof for this rank (``attempt_proof``): the worker stamps it on every event of the
    assignment, and the control plane counts an event only with the proof it computes for that job,
    attempt and rank. Only the assigned worker received it, so another pod that writes
    to the job's event stream cannot end, fail or answer the job."""
    prompt_bank: Literal["auto", "always", "never"] = "never"
    """Whether rank(s) look up the initial prompt in the Prompt Bank before tuning (the control plane's
    latency-budget decision; ``auto`` lets the worker re-check it with the bank's own prediction)."""
    bank_budget_s: float | None = None
    """20 % of the SLO: the latency budget under ``auto``."""
    initial_prompt: str | None = None
    """Overrides spec.initialPrompt: a retry starts from the prompt the first attempt's lookup chose
    (its checkpoints were trained from it)."""
    coserve: bool = False
    """Run inside the worker's serving engine, in the token budget its inference leaves each iteration
    (FlexLLM co-serving), instead of on the whole GPU; world must be 1. A worker without a serving engine
    runs it dedicated."""
    tpot_slo_s: float | None = None
    """The serving pool's TPOT SLO: a co-served job's iterations stay within it."""


class PromptBankReport(_Message):
    """What a worker's Prompt Bank step decided for an attempt (Event.prompt_bank).

    ``reason`` is a vocabulary constant: PromptBankUsed, PromptBankDisabled, LatencyBudgetExceeded, or
    why the bank could not serve (EmptyBank, NoFeatures, NoTargets)."""

    source: Literal["bank", "job"]
    """Where the initial prompt came from: the bank's pick, or the job's own spec.initialPrompt."""
    reason: str
    message: str = ""
    prompt: str | None = None
    predicted_seconds: float | None = None
    """The bank's own predicted lookup time (better than the estimator's configured guess)."""
    score: float | None = None
    evaluations: int | None = None
    latency_seconds: float | None = None
    cluster: int | None = None
    candidates: int | None = None

    @property
    def used(self) -> bool:
        return self.source == "bank"


EventType = Literal["started", "progress", "succeeded", "failed", "cancelled"]


class Event(_Message):
    type: EventType
    job: str
    attempt: int
    rank: int
    worker: str
    proof: str = ""
    """The assignment's ``proof`` (see Assignment.proof)."""
    time: float = Field(default_factory=time.time)
    iterations: int | None = None
    checkpointed: int | None = None
    """Iterations covered by the newest checkpoint: where a retry resumes."""
    loss: float | None = None
    metric: str | None = None
    value: float | None = None
    resumed_from: int | None = None
    """Iteration this attempt started from (its newest checkpoint; 0 on a fresh start)."""
    initial_value: float | None = None
    """The metric with the initial prompt, before any step (first attempt only)."""
    seconds_per_iteration: float | None = None
    sync_seconds: float | None = None
    reason: str | None = None
    """CamelCase reason of a failure (DatasetNotFound, ...) or of the termination (TargetReached, ...)."""
    message: str | None = None
    prompt: str | None = None
    artifact: str | None = None
    metrics: dict[str, float] | None = None
    prompt_bank: PromptBankReport | None = None
    """The Prompt Bank decision of this attempt (first progress event)."""
    coserved: bool | None = None
    """On ``started``: whether the attempt runs co-served in the worker's serving engine (with
    ``message`` saying why not when a co-served assignment was refused by the engine)."""


def vouched_address(host: str, port: int | None = None) -> str:
    """A ``ServingPoolRecord.vouched`` entry: the host (an IPv6 one bracketed), with the port when the
    control plane knows it."""
    host = host.strip("[]")
    bracketed = f"[{host}]" if ":" in host else host
    return bracketed if port is None else f"{bracketed}:{port}"


def _same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)  # one IPv6 address, two spellings
    except ValueError:
        return a.lower() == b.lower()


def vouched_url(address: str, url: str) -> str | None:
    """The URL to forward to when the registered ``url`` is at the vouched ``address`` (host or
    host:port), rebuilt from the vouched host and the registered port so that nothing of the record's
    spelling (user info, path, odd encodings a second URL parser might read differently) reaches the
    forwarder; None when they do not match or either is malformed."""
    try:
        want, got = urlsplit("//" + address), urlsplit(url)
        want_port, got_port = want.port, got.port
    except ValueError:
        return None
    if got.scheme not in ("http", "https") or got_port is None or not want.hostname or not got.hostname:
        return None
    if not _same_host(want.hostname, got.hostname) or (want_port is not None and want_port != got_port):
        return None
    return f"{got.scheme}://{vouched_address(want.hostname)}:{got_port}"


NAMESPACE_HEADER = "x-elastune-namespace"
"""Sent by the gateway with a request for an adapter: the adapter's namespace, which the gateway resolved
for the caller; with the request's ``model`` it is the adapter's id. Read only on the unsigned dev path
(a worker with no request key): a signed request's adapter id is the credential's. Without it, ``model``
is the base model or an adapter of no namespace; there is no "the only one of that name" rule."""


def adapter_id(namespace: str, name: str) -> str:
    """An adapter's identity in the registry (placements, pool records, worker records, demand and
    request counts): ``namespace/name``, or the name alone for an adapter of no namespace (loaded by
    hand). A Kubernetes name holds no ``/``, so two namespaces' adapters of one name never meet; the
    engine keys its adapters the same way (``elastune_worker.engine.core.adapter_ref.adapter_key``)."""
    return f"{namespace}/{name}" if namespace else name


def split_adapter_id(key: str) -> tuple[str, str]:
    """(namespace, name) of an ``adapter_id``."""
    namespace, _, name = key.rpartition("/")
    return namespace, name


def pool_admits(namespace: str, pool_namespace: str, admits: list[str] | tuple[str, ...]) -> bool:
    """Whether a caller (or an object) of ``namespace`` may use a pool of ``pool_namespace`` whose
    WarmPool admits ``admits`` (``*``: every namespace); a pool of no namespace admits everyone."""
    return not pool_namespace or namespace_admitted(namespace, pool_namespace, admits)


def pod_worker_id(namespace: str, pod: str) -> str:
    """A worker's id in the registry: ``<namespace>/<pod>`` for a pod of a namespace (Kubernetes: pod
    names are unique only within a namespace), the name alone for a worker of none (local processes).
    Its record, placement and assignment queue are keyed by it (``worker_key``, ``placement_key``,
    ``assign_key``)."""
    return f"{namespace}/{pod}" if namespace else pod


def split_worker_id(wid: str) -> tuple[str, str]:
    """(namespace, pod name) of a ``pod_worker_id`` ("" for a worker of no namespace)."""
    namespace, _, pod = wid.rpartition("/")
    return namespace, pod


def pool_id(namespace: str, name: str) -> str:
    """A serving pool's field in ``{ns}:serving-pools``: ``<namespace>/<WarmPool name>`` (the name alone
    for a pool of no namespace)."""
    return f"{namespace}/{name}" if namespace else name


def base_model_id(model: str, pool: str) -> str:
    """A base model's identity in the registry's demand and request counts, per serving pool (two
    namespaces may each have a WarmPool of one model, and a request waiting for one scales only that
    one): ``<model>@<pool id>``; the model's name alone for a model no pool record names (a gateway
    in front of workers alone, or one older than this id: the control plane reads both)."""
    return f"{model}@{pool}" if pool else model


def worker_key(ns: str, worker_id: str) -> str:
    return f"{ns}:worker:{worker_id}"


def pools_key(ns: str) -> str:
    return f"{ns}:serving-pools"


POPULARITY_WINDOW_S = 60
"""Requests per served name are counted in windows of this length (placement's 'requests per window')."""


def requests_key(ns: str, window: int) -> str:
    return f"{ns}:requests:{window}"


def demand_key(ns: str, model: str) -> str:
    return f"{ns}:demand:{model}"


def placement_key(ns: str, worker_id: str) -> str:
    return f"{ns}:placement:{worker_id}"


def assign_key(ns: str, worker_id: str) -> str:
    return f"{ns}:assign:{worker_id}"


def events_key(ns: str, job: str) -> str:
    return f"{ns}:job:{job}:events"


def cancel_key(ns: str, job: str, attempt: int) -> str:
    return f"{ns}:job:{job}:cancel:{attempt}"


PoisonKind = Literal["worker", "pool", "placement", "demand", "event", "assignment"]
"""Which kind of registry entry could not be read (the label of the poison-record metrics)."""


def attempt_proof(key: bytes, job: str, attempt: int, rank: int) -> str:
    """HMAC-SHA256 of the assignment's identity under the control plane's key: what the assigned worker
    stamps on its events (only it received the assignment). A key that outlives the control plane's
    restarts (a Secret on Kubernetes) lets a restarted control plane accept an adopted attempt's events."""
    message = f"{job}\n{attempt}\n{rank}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()
