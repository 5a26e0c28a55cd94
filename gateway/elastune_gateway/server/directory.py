"""The endpoints of each model, read continuously from the Redis registry.

Workers publish a ``WorkerRecord`` with every heartbeat (1 s, TTL 10 s); one that serves carries its
``ServingState`` (load, KV usage, prefix-cache counters, fitted cost, capacity). The control plane
publishes a ``ServingPoolRecord`` per serving pool, which is how the gateway knows a model whose pool
is scaled to zero. An endpoint that failed a request is set aside for ``failure_cooldown_s`` (or until
its worker re-registers as a new process) so no new request goes there.

A refresh that fails (Redis unreachable) keeps the last view, which requests are routed from, and is
counted; a malformed record is skipped and counted (``Bus._parse``), never a failed refresh.

Workers write their own records, and all of them share one Redis user, so a record's URL is a claim,
not a fact: a worker credential could rewrite another worker's record to point at its own server. The
control plane lists the pool's workers in the pool record (``ServingPoolRecord.vouched``: pod name ->
pod IP and port, from the Kubernetes API; locally, the processes it started -> loopback), which no
worker can write, and an endpoint is built only from a record whose id and URL match an entry there
(forwarded to the URL rebuilt from the vouched host). A record that does not match is skipped, counted
(``elastune_gateway_unvouched_endpoints``) and logged once; requests for its model go to the vouched
endpoints, or wait and get the usual 503 when none is left. A model no pool record vouches for (no
control plane, or one older than the list) is served from the registry as before, unless
``vouched_only`` (fail closed).

Tenancy: how a served name is resolved. A base model is known per serving pool (``KnownModel.pool_key``,
the pool id namespace/name: two namespaces may each have a WarmPool of one model, each with its own
pods); a LoRAAdapter (or published prompt) by its namespace and name (``protocol.adapter_id``), so two
namespaces may each serve a ``summarizer``. A request's ``model`` is resolved for the caller's
namespace, the namespace of its API key's Secret (``model(name, namespace)``), in this order: (1) the
adapter of that name in the caller's namespace; (2) the base model of that name through the caller's
namespace's WarmPool of it, else through the pool of the lowest id among those that admit the caller's
namespace (spec.allowedNamespaces, ``*``: every namespace), and only that pool's pods serve it; (3) an
adapter of no namespace (loaded on a worker by
hand through its control endpoint). Nothing else: another namespace's adapter of that name is never
reached, and is not listed in ``/v1/models`` or in the 404's list of models. Without authentication (a
loopback-only ``elastune serve``) there is one tenant: a base model (through the pool of the lowest
id, when several serve it), else the adapter of that name when
exactly one namespace serves one; a name two namespaces serve is then a 404 that says so.

This is the only place a served name is resolved (issue 40): the ``KnownModel`` it gives carries the
adapter's id and rank to the routing policy (``RequestView.adapter``/``rank``), and the adapter's id to
the worker in the signed credential (``request_signer.py``); the worker looks the adapter up by that id
(no name rules of its own) and the engine checks the reference once at admission. Unsigned (a worker
with no request key: local runs), the adapter's namespace goes as ``NAMESPACE_HEADER`` beside the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Literal

from elastune_common.bus import Bus
from elastune_contract.protocol import (
    PoisonKind,
    ServingDemand,
    ServingPoolRecord,
    ServingState,
    WorkerRecord,
    WorkerState,
    adapter_id,
    base_model_id,
    pool_admits,
    pool_id,
    split_adapter_id,
    vouched_url,
)

from .metrics import GatewayMetrics

log = logging.getLogger("elastune.gateway")

_SERVING_STATES = (WorkerState.READY, WorkerState.BUSY)  # a pod that tunes keeps serving

UnvouchedReason = Literal["id", "unlisted", "address", "no_pool_record"]
"""Why a serving record got no endpoint: its id is not the one it is registered under (``id``), no pool
record of its model lists that id (``unlisted``), one does at another address (``address``), or, with
``vouched_only``, no pool record of its model vouches for any worker (``no_pool_record``)."""
UNVOUCHED_REASONS: tuple[UnvouchedReason, ...] = ("id", "unlisted", "address", "no_pool_record")
_UNVOUCHED_MEMORY = 4096
"""Distinct skipped records remembered (each is logged and counted once, however often it is read)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    id: str
    pool: str
    url: str
    started_at: float
    serving: ServingState
    pool_key: str = ""
    """The id of the pool whose record vouches for it ("": none does, see ``vouched_only``)."""

    @property
    def model(self) -> str:
        return self.serving.model


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model clients may name: served now, published as a pool, or served earlier in this process.
    What a request's ``model`` resolves to, once, at the gateway: namespace, adapter id, base model,
    pool and rank; everything after (routing, the signed credential, the worker) reads this value."""

    name: str
    pool: str
    max_model_len: int | None
    hold_timeout_s: float | None
    routing_policy: str | None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    parent: str | None = None
    """For a LoRA adapter: the base model it runs on (``name`` is then the adapter's)."""
    rank: int = 0
    """For a LoRA adapter: its rank (routing costs depend on it)."""
    namespace: str = ""
    """For a LoRA adapter: its namespace ("" for one loaded by hand); for a base model: its WarmPool's
    ("" when no pool record says: every namespace may use it)."""
    admits: tuple[str, ...] = ()
    """For a base model: the other namespaces its WarmPool admits (``*``: all)."""
    pool_key: str = ""
    """The id (namespace/name) of the pool that serves it, from its pool record ("" for a model known
    from the workers' records alone); an adapter's is its base model's."""
    unservable: str | None = None
    """For an adapter no pod holds: why it cannot be served (``"Reason: message"`` from its pool
    record: its load failed, its artifact is missing); None when waiting for a pod may serve it."""

    @property
    def id(self) -> str:
        """Its identity in the registry (demand, request counts): an adapter's ``namespace/name``, a base
        model's ``<model>@<pool id>`` (``protocol.base_model_id``; its name when no pool record names
        it), so a request waiting for it scales up that pool only."""
        if self.parent is not None:
            return adapter_id(self.namespace, self.name)
        return base_model_id(self.name, self.pool_key)

    def admitted(self, namespace: str) -> bool:
        """Whether a caller of ``namespace`` may use this base model."""
        return pool_admits(namespace, self.namespace, self.admits)

    @property
    def served_model(self) -> str:
        """The model whose endpoints serve it (the base model of an adapter)."""
        return self.parent or self.name

    @property
    def adapter(self) -> str | None:
        """The adapter's id (``protocol.adapter_id``: what the gateway signs for the worker, which looks
        the adapter up by it, and what routing policies see); None for a base model."""
        return adapter_id(self.namespace, self.name) if self.parent is not None else None

    @property
    def adapter_rank(self) -> int:
        """The rank routing policies see: the adapter's (published by the pods holding it and by its
        pool record), 0 for a base model."""
        return self.rank if self.parent is not None else 0


def _holdings(endpoints: dict[str, Endpoint]) -> set[tuple[str, str]]:
    return {(eid, "") for eid in endpoints} | {
        (eid, adapter_id(a.namespace, a.name)) for eid, ep in endpoints.items() for a in ep.serving.adapters
    }


_WHY: dict[UnvouchedReason, str] = {
    "id": "the record names another id than the one it is registered under",
    "unlisted": "no pool record of its model vouches for this worker id",
    "address": "its URL is not at the address the control plane vouches for this worker id",
    "no_pool_record": "no pool record of its model vouches for any worker (vouched_only)",
}


def _base_of(
    models: dict[tuple[str, str], KnownModel], model: str, pool_key: str, default: KnownModel | None = None
) -> KnownModel:
    """The base model ``model`` through pool ``pool_key`` (any pool of it when that one is not known)."""
    found = models.get((pool_key, model))
    if found is None:
        found = next((m for (_, n), m in sorted(models.items()) if n == model), None)
    if found is None:
        found = default or KnownModel(model, "", None, None, None, pool_key=pool_key)
    return found


class Directory:
    def __init__(
        self,
        bus: Bus,
        failure_cooldown_s: float,
        metrics: GatewayMetrics | None = None,
        *,
        vouched_only: bool = False,
    ) -> None:
        self.bus = bus
        self.vouched_only = vouched_only
        """True: no endpoint for a model whose pool records vouch for no worker (fail closed, for a
        cluster where the operator always publishes them); False: such a model is served from the
        registry alone (a gateway in front of workers no control plane runs)."""
        self.unvouched: dict[UnvouchedReason, int] = {}
        """Serving records skipped at the last read, by reason."""
        self._unvouched_seen: set[tuple[str, str, str]] = set()
        self.metrics = metrics
        bus.on_poison = self._count_poison
        self.failure_cooldown_s = failure_cooldown_s
        self._endpoints: dict[str, Endpoint] = {}
        self._models: dict[tuple[str, str], KnownModel] = {}
        """Base models by (pool id, name); ("", name) for a model no pool record names."""
        self._adapters: dict[tuple[str, str], KnownModel] = {}
        """Adapters by (namespace, name)."""
        self._down: dict[str, tuple[float, float]] = {}
        """endpoint id → (until, started_at of the process that failed)."""
        self._changed = asyncio.Event()
        self.last_refresh: float | None = None
        """time.monotonic() of the last good read of the registry (None: never read)."""
        self.last_error: str | None = None
        self.failed_refreshes = 0
        """Reads that failed in a row (0 after a good one)."""
        self._requests: dict[str, int] = {}
        """Requests per served model (a base model's name, an adapter's id) since the last flush to the
        registry (adapter popularity)."""

    # -- reading the registry ---------------------------------------------------------------------
    async def refresh(self) -> None:
        # Swapped on the event loop, where requests are counted: no count is lost to the thread.
        counts, self._requests = self._requests, {}
        try:
            workers, pools = await asyncio.to_thread(self._read, counts)
        except Exception as exc:  # Redis down: keep the last view, say so in /readyz and the log
            for name, n in counts.items():  # counted again with the next refresh
                self._requests[name] = self._requests.get(name, 0) + n
            if self.last_error is None:
                log.warning("cannot read the registry (routing from the last view): %s", exc)
            self.last_error = str(exc)
            self.failed_refreshes += 1
            if self.metrics is not None:
                self.metrics.registry_refresh_failures.inc()
            return
        if self.last_error is not None:
            log.info("registry readable again after %d failed read(s)", self.failed_refreshes)
        self.last_error, self.failed_refreshes = None, 0
        self.last_refresh = time.monotonic()
        self._apply(workers, pools)

    def _read(self, counts: dict[str, int]) -> tuple[dict[str, WorkerRecord], dict[str, ServingPoolRecord]]:
        self.bus.count_requests(counts)
        return self.bus.workers(), self.bus.serving_pools()

    def _count_poison(self, kind: PoisonKind) -> None:
        if self.metrics is not None:
            self.metrics.poison_records.labels(kind).inc()

    def age(self) -> float | None:
        """Seconds since the last good read of the registry (None: never read)."""
        return None if self.last_refresh is None else time.monotonic() - self.last_refresh

    def readiness(self, stale_after_s: float) -> str | None:
        """Why the gateway cannot serve (None: it can). It can while it knows an endpoint, from its last
        view however old, or while that view is recent enough to hold requests for a scaling pool; a
        failed read alone never makes it unready (readiness must not track Redis's)."""
        age = self.age()
        if age is None:
            return self.last_error or "the registry was not read yet"
        if self._endpoints or age <= stale_after_s:
            return None
        why = f"no endpoint known and the registry was last read {age:.0f} s ago"
        return f"{why}: {self.last_error}" if self.last_error else why

    def count_request(self, name: str) -> None:
        """One request for ``name`` (a base model's name or an adapter's ``KnownModel.id``): the control
        plane places adapters by these counts (replicas of popular adapters on more pods)."""
        self._requests[name] = self._requests.get(name, 0) + 1

    def _vouched_endpoints(
        self, workers: dict[str, WorkerRecord], pools: dict[str, ServingPoolRecord]
    ) -> dict[str, Endpoint]:
        """The endpoints of the serving records the control plane vouches for (see the module's doc),
        built once per registry read so that routing a request costs nothing more."""
        vouching: dict[str, dict[str, list[str]]] = {}  # model -> worker id -> vouched addresses
        vouched_by: dict[tuple[str, str], str] = {}  # (model, worker id) -> the pool id vouching for it
        for rec in pools.values():
            if rec.vouched is not None:
                ids = vouching.setdefault(rec.model, {})
                for wid, address in rec.vouched.items():
                    ids.setdefault(wid, []).append(address)
                    vouched_by.setdefault((rec.model, wid), pool_id(rec.namespace, rec.pool))
        endpoints: dict[str, Endpoint] = {}
        skipped: Counter[UnvouchedReason] = Counter()
        for key, w in workers.items():
            if w.serving is None or not w.url or w.state not in _SERVING_STATES:
                continue
            by_id = vouching.get(w.serving.model)
            url: str | None = w.url
            reason: UnvouchedReason | None = None
            if w.id != key:
                reason = "id"
            elif by_id is not None:
                addresses = by_id.get(w.id, [])
                url = next((u for a in addresses if (u := vouched_url(a, w.url)) is not None), None)
                reason = None if url is not None else "address" if addresses else "unlisted"
            elif self.vouched_only:
                reason = "no_pool_record"
            if reason is not None or url is None:
                skipped[reason or "unlisted"] += 1
                self._skipped_once(reason or "unlisted", key, w)
                continue
            pool_key = vouched_by.get((w.serving.model, w.id), "")
            endpoints[w.id] = Endpoint(w.id, w.pool, url, w.started_at, w.serving, pool_key)
        self.unvouched = dict(skipped)
        if self.metrics is not None:
            for r in UNVOUCHED_REASONS:
                self.metrics.unvouched.labels(r).set(skipped[r])
        return endpoints

    def _skipped_once(self, reason: UnvouchedReason, key: str, w: WorkerRecord) -> None:
        mark = (reason, key, w.url)
        if mark in self._unvouched_seen:
            return
        if len(self._unvouched_seen) >= _UNVOUCHED_MEMORY:
            self._unvouched_seen.clear()
        self._unvouched_seen.add(mark)
        if self.metrics is not None:
            self.metrics.unvouched_records.labels(reason).inc()
        model = w.serving.model if w.serving is not None else w.model
        log.warning(
            "not forwarding to worker record %.100r (id %.100r, model %.100r, url %.200r): %s",
            key, w.id, model, w.url, _WHY[reason],
        )  # fmt: skip

    def _apply(self, workers: dict[str, WorkerRecord], pools: dict[str, ServingPoolRecord]) -> None:
        endpoints = self._vouched_endpoints(workers, pools)
        for eid, (_, started) in list(self._down.items()):
            ep = endpoints.get(eid)
            if ep is None or ep.started_at != started:
                del self._down[eid]  # gone, or a new process under the same id: forget the failure
        # A base model served before stays known (its pool may be at zero); adapters are known only
        # while a pod holds one or its pool lists it, so a deleted adapter is a 404 again.
        models = dict(self._models)
        if pools:  # a deleted pool's model is no longer served through it (a registry read empty keeps all)
            live = {pool_id(rec.namespace, rec.pool) for rec in pools.values()}
            models = {k: m for k, m in models.items() if not k[0] or k[0] in live}
        for rec in pools.values():
            mk = (pool_id(rec.namespace, rec.pool), rec.model)
            prev = models.get(mk) or models.get(("", rec.model))
            models[mk] = KnownModel(
                rec.model, rec.pool, prev.max_model_len if prev else None, rec.hold_timeout_s,
                rec.routing_policy, rec.ttft_slo_s, rec.tpot_slo_s,
                namespace=rec.namespace, admits=tuple(rec.admits), pool_key=mk[0],
            )  # fmt: skip
        for ep in endpoints.values():
            same = [k for k in models if k[1] == ep.model and (not ep.pool_key or k[0] == ep.pool_key)]
            for k in same:
                models[k] = replace(models[k], max_model_len=ep.serving.max_model_len)
            if not same:
                models[("", ep.model)] = KnownModel(ep.model, ep.pool, ep.serving.max_model_len, None, None)
        # A model a pool record names is that pool's (its namespace admits whom it admits), never also
        # one of no pool that any caller may use.
        for orphan in [k for k in models if not k[0] and any(o[0] and o[1] == k[1] for o in models)]:
            del models[orphan]
        adapters: dict[tuple[str, str], KnownModel] = {}
        for ep in endpoints.values():  # adapters, by namespace and name, on their base model's pool
            base = _base_of(models, ep.model, ep.pool_key)
            for a in ep.serving.adapters:
                adapters[(a.namespace, a.name)] = replace(
                    base, name=a.name, parent=ep.model, rank=a.rank, namespace=a.namespace, admits=()
                )
        for rec in pools.values():  # adapters the control plane placed: known before any pod holds them
            base = models[(pool_id(rec.namespace, rec.pool), rec.model)]
            for key, rank in rec.adapters.items():
                ns, name = split_adapter_id(key)
                held = (ns, name) in adapters  # a pod holds it: servable whatever the record says
                adapters[(ns, name)] = replace(
                    base, name=name, parent=rec.model, rank=rank, namespace=ns, admits=(),
                    unservable=None if held else rec.unservable.get(key),
                )  # fmt: skip
        self._models, self._adapters = models, adapters
        # Waiting requests look again when a pod comes or goes, and when one finishes loading an adapter.
        if _holdings(endpoints) != _holdings(self._endpoints):
            self._changed.set()
            self._changed = asyncio.Event()
        self._endpoints = endpoints

    # -- what the app asks ------------------------------------------------------------------------
    def models(self, namespace: str | None = None) -> dict[str, KnownModel]:
        """The models a caller of ``namespace`` may name (None: no authentication, one tenant), by the
        name it sends: what ``model`` resolves for each (see the module's doc)."""
        out: dict[str, KnownModel] = {}
        names = {name for _, name in self._adapters} | {name for _, name in self._models}
        for name in sorted(names):
            m = self.model(name, namespace)
            if m is not None:
                out[name] = m
        return out

    def model(self, name: str, namespace: str | None = None) -> KnownModel | None:
        """What ``name`` means for a caller of ``namespace`` (None: no authentication, one tenant):
        the rule is in the module's doc."""
        bases = sorted((m for (_, n), m in self._models.items() if n == name), key=lambda m: m.pool_key)
        if namespace is not None:
            own = self._adapters.get((namespace, name))
            if own is not None:
                return own
            base = next((m for m in bases if m.namespace == namespace), None) or next(
                (m for m in bases if m.admitted(namespace)), None
            )
            if base is not None:
                return base
            return self._adapters.get(("", name))
        if bases:
            return bases[0]
        same = [m for (_, n), m in self._adapters.items() if n == name]
        return same[0] if len(same) == 1 else None

    def adapter(self, namespace: str, name: str) -> KnownModel | None:
        """The adapter of this identity as last read (no name rule: for a request already resolved, to
        see whether it became servable or unservable while it waits)."""
        return self._adapters.get((namespace, name))

    def namespaces_serving(self, name: str) -> list[str]:
        """The namespaces with an adapter of this name (to explain a name that is ambiguous without a
        key)."""
        return sorted(ns for ns, n in self._adapters if n == name)

    def endpoints(self, model: KnownModel, exclude: frozenset[str] = frozenset()) -> list[Endpoint]:
        """The model's warm endpoints that may take a request, in a stable order (by id): those of its
        pool (an endpoint no pool record vouches for serves any pool of its model); for an adapter,
        those of its base model's pool that have it loaded (in any tier)."""
        now = time.monotonic()
        return [
            ep
            for eid, ep in sorted(self._endpoints.items())
            if ep.model == model.served_model
            and (not model.pool_key or not ep.pool_key or ep.pool_key == model.pool_key)
            and (
                model.parent is None
                or any(a.name == model.name and a.namespace == model.namespace for a in ep.serving.adapters)
            )
            and eid not in exclude
            and self._down.get(eid, (0.0, 0.0))[0] <= now
        ]

    def base(self, model: KnownModel) -> KnownModel:
        """The base model ``model`` runs on (itself for a base model), through the same pool."""
        if model.parent is None:
            return model
        return _base_of(self._models, model.served_model, model.pool_key, model)

    def all_endpoints(self) -> list[Endpoint]:
        return [ep for _, ep in sorted(self._endpoints.items())]

    def has_endpoint(self, endpoint_id: str) -> bool:
        """Whether the registry, as last read, still lists the endpoint (a silent worker's record expires
        after its heartbeat TTL)."""
        return endpoint_id in self._endpoints

    def is_down(self, endpoint_id: str) -> bool:
        return self._down.get(endpoint_id, (0.0, 0.0))[0] > time.monotonic()

    def mark_down(self, endpoint_id: str, why: str) -> None:
        ep = self._endpoints.get(endpoint_id)
        if ep is None:
            return
        log.warning("endpoint %s (%s) set aside for %.0f s: %s", ep.id, ep.url, self.failure_cooldown_s, why)
        self._down[endpoint_id] = (time.monotonic() + self.failure_cooldown_s, ep.started_at)

    async def wait_changed(self, timeout: float) -> None:
        """Returns when the set of endpoints changed, or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def post_demand(self, demand: ServingDemand) -> None:
        try:
            self.bus.post_demand(demand)
        except Exception as exc:  # the request still waits; the operator just learns later
            log.warning("cannot publish serving demand for %s: %s", demand.model, exc)
