"""The serving half of the control core: serving pools, LoRAAdapters and their placement (issue 15).

Each round (``tick``) it reads the workers' registry records and
- publishes one ``ServingPoolRecord`` per WarmPool, listing the pool's adapters, so the gateway knows a
  model or adapter whose pool has no warm pod and holds its requests instead of a 404, and the addresses
  of the pool's workers the backend vouches for (the gateway forwards only to those);
- answers the serving need of each pool (by pool id, namespace/name: two namespaces may each have a
  WarmPool of one model, each with its own pods, adapters and need): ``serving.minReplicas``, at least
  one pod while the gateway reports requests waiting for the model through this pool or for one of its
  adapters (scale from zero); the core runs the pool at max(tuning need, serving need) through the
  scheduler's minimum warm GPUs;
- places adapters on the pool's serving pods (``scheduling.placement``, pure) and writes each pod's share
  to the registry, where the worker pulls and applies it with the engine's load/unload;
- reports each LoRAAdapter's status from what the workers say they hold (true residency: pod and tier),
  with Ready=False and a reason for anything that cannot be served.

Tenancy: an adapter runs on the pool ``records.resolve_pool`` picks for its namespace and base model
(its own namespace's WarmPool of the model, else the lowest id of those admitting its namespace), and
is placed only on that pool's pods. An adapter is the pair (namespace, name) everywhere here and in
what is written for the others (``protocol.adapter_id``: ``namespace/name`` in pool records,
placements, demand and request counts; the workers' records report the namespace of each adapter
they hold), so two namespaces may each have a LoRAAdapter ``summarizer`` on one pool, each with its own
status, placement and load, and deleting one never unloads the other. Clients still send the bare
name: the gateway resolves it in the caller's namespace (``elastune_gateway.server.directory``).

All state here is rebuilt from the resources and the registry after a restart: nothing is lost. What it
owns in the registry (pool records, placements) is level-triggered: written when it changes, and written
again every ``REASSERT_S``, after a round gap (Redis was unreachable: the rounds failed) and as soon as
the registry lost the pool records (a Redis restarted empty, a FLUSHALL), so a Redis that lost them is
told again within seconds without anyone acting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from elastune_common.bus import Bus
from elastune_contract.api import units
from elastune_contract.api.common import ConditionStatus, set_condition
from elastune_contract.api.constants import s3_credentials
from elastune_contract.api.loraadapter import AdapterPlacement, LoRAAdapterSpec, LoRAAdapterStatus
from elastune_contract.api.warmpool import ServingSpec, namespace_admitted
from elastune_contract.protocol import (
    AdapterState,
    PlacedAdapter,
    ServingPoolRecord,
    WorkerRecord,
    WorkerState,
    adapter_id,
    base_model_id,
    pool_id,
    pools_key,
)
from elastune_contract.vocabulary import ConditionType, Reason
from elastune_operator.control import artifacts, borrowing
from elastune_operator.control.records import record_pool, resolve_pool
from elastune_operator.metrics import ControlMetrics
from elastune_operator.scheduling.placement import AdapterDemand, PlacementConfig, PodView, place

log = logging.getLogger("elastune.operator")

DEFAULT_SERVING = ServingSpec()
POPULARITY_READ_S = 5.0
"""How often the gateway's request counts are read back (they are kept per minute)."""
REASSERT_S = 5.0
"""Pool records and placements are rewritten at least this often, changed or not (level-triggered)."""
ROUND_GAP_S = 2.0
"""Rounds further apart than this mean the rounds failed or stalled (Redis was unreachable, the
process paused): the next one rewrites everything, since the registry may have lost it meanwhile."""


@dataclass
class AdapterRecord:
    """What the control plane keeps of one LoRAAdapter (or a published prompt)."""

    namespace: str
    name: str
    """The served model name (metadata.name): what the namespace's clients send as ``model``. Two
    namespaces may each serve one of a name; ``key`` tells them apart."""
    spec: LoRAAdapterSpec
    generation: int = 1
    base_dir: Path | None = None
    """Where a relative artifactURL is resolved (the manifest's folder in local mode)."""
    status: LoRAAdapterStatus = field(default_factory=LoRAAdapterStatus)
    url: str = ""
    rank: int = 0
    problem: artifacts.Problem | None = None
    deleting: bool = False
    pool: str = ""
    """The id of the pool it is served on (``resolve_pool``), "" while none serves it."""
    unservable: str | None = None
    """``"Reason: message"`` while no pod holds it and a problem (its own, or every worker's load
    failing) keeps it from being served; published so the gateway refuses its requests at once."""

    @property
    def key(self) -> str:
        """namespace/name: its identity here and in the registry (``protocol.adapter_id``)."""
        return adapter_id(self.namespace, self.name)


@dataclass
class _Pool:
    name: str
    model: str
    spec: ServingSpec
    namespace: str = "default"
    allowed: tuple[str, ...] = ()
    job_storage: str | None = None

    @property
    def key(self) -> str:
        return pool_id(self.namespace, self.name)

    def admits(self, namespace: str) -> bool:
        return namespace_admitted(namespace, self.namespace, self.allowed)


class ServingControl:
    def __init__(
        self,
        bus: Bus,
        on_status: Callable[[AdapterRecord], None] | None = None,
        clock: Callable[[], float] = time.time,
        *,
        check_artifact_paths: bool = True,
        lend_gpus_only: bool = True,
        metrics: ControlMetrics | None = None,
        vouched: Callable[[], dict[str, dict[str, str]]] | None = None,
    ) -> None:
        self.bus = bus
        self.vouched = vouched
        """The backend's workers per pool (pool id namespace/name -> worker id -> address), from what it
        started or the API lists, never from the registry: published in each pool record for the gateway,
        which forwards only to these. None: the backend vouches for nothing (the records carry no list)."""
        self.metrics = metrics
        self.check_artifact_paths = check_artifact_paths
        self.lend_gpus_only = lend_gpus_only
        self.on_status = on_status or (lambda _rec: None)
        self.clock = clock
        self.pools: dict[str, _Pool] = {}  # pool id (namespace/name) -> pool
        self.adapters: dict[str, AdapterRecord] = {}  # namespace/name -> record
        self._published: dict[str, str] = {}  # namespace/pool -> last record written
        self._placed: dict[str, dict[str, PlacedAdapter]] = {}  # worker -> placement written
        self._status_sent: dict[str, str] = {}
        self._pods: dict[str, int] = {}  # pool id -> serving pods seen in the last round
        self._popularity: dict[str, int] = {}  # adapter id or model -> requests in the last 1-2 windows
        self._popularity_at = float("-inf")
        self._asserted_at = float("-inf")  # when everything was last rewritten
        self._last_tick: float | None = None

    # -- pools --------------------------------------------------------------------------------------
    def add_pool(
        self,
        name: str,
        model: str,
        spec: ServingSpec | None,
        *,
        namespace: str = "default",
        allowed: tuple[str, ...] = (),
        job_storage: str | None = None,
    ) -> None:
        pool = _Pool(name, model, spec or DEFAULT_SERVING, namespace, allowed, job_storage)
        self.pools[pool.key] = pool
        for rec in self.adapters.values():
            if rec.spec.base_model == model:
                self._validate(rec)  # a pool of its own namespace may now serve it instead

    def remove_pool(self, key: str) -> None:
        """``key``: the pool's id (namespace/name)."""
        pool = self.pools.pop(key, None)
        if pool is None:
            return
        self.bus.forget_pool(pool.name, pool.namespace)
        self._published.pop(key, None)
        self._pods.pop(key, None)
        for rec in self.adapters.values():
            if rec.spec.base_model == pool.model:
                self._validate(rec)

    def hold(self, key: str) -> ServingSpec:
        """The serving section of pool ``key`` (the engine's defaults for an unknown one)."""
        pool = self.pools.get(key)
        return pool.spec if pool is not None else DEFAULT_SERVING

    # -- adapters -----------------------------------------------------------------------------------
    def upsert_adapter(self, rec: AdapterRecord) -> None:
        """A LoRAAdapter was created, changed or seen again after a restart (idempotent per generation).
        Another namespace's adapter of the same name is another adapter (each namespace's callers reach
        their own)."""
        known = self.adapters.get(rec.key)
        if known is not None and known.generation == rec.generation and not known.deleting:
            return
        if known is not None:
            rec.status = known.status
        self.adapters[rec.key] = rec
        self._validate(rec)

    def delete_adapter(self, namespace: str, name: str, workers: dict[str, WorkerRecord]) -> bool:
        """Unload it everywhere; True once no worker holds it any more (the finalizer may go). Only this
        namespace's adapter: another namespace's of the same name stays placed and served."""
        key = adapter_id(namespace, name)
        rec = self.adapters.get(key)
        if rec is None:
            return True
        rec.deleting = True
        if holders_of(key, workers):
            return False
        del self.adapters[key]
        self._status_sent.pop(rec.key, None)
        return True

    def _validate(self, rec: AdapterRecord) -> None:
        pool = resolve_pool(self.pools.values(), rec.namespace, rec.spec.base_model)
        of_model = sorted(p.key for p in self.pools.values() if p.model == rec.spec.base_model)
        rec.problem = None
        rec.url, rec.rank = "", 0
        rec.pool = pool.key if pool is not None else ""
        if any(p.model == rec.name for p in self.pools.values()):
            rec.problem = artifacts.Problem(
                Reason.NAME_CLASHES_WITH_MODEL,
                f"{rec.name} is the name of a base model a WarmPool serves; rename the adapter",
            )
        elif pool is None and not of_model:
            known = ", ".join(sorted({p.model for p in self.pools.values()})) or "none"
            rec.problem = artifacts.Problem(
                Reason.UNKNOWN_MODEL,
                f"no WarmPool serves baseModel {rec.spec.base_model!r} (pools serve: {known})",
            )
        elif pool is None:
            names = ", ".join(of_model)
            rec.problem = artifacts.Problem(
                Reason.POOL_NOT_SHARED,
                f"the WarmPools of baseModel {rec.spec.base_model!r} ({names}) do not admit namespace "
                f"{rec.namespace}: create a WarmPool in {rec.namespace}, or have one of them list "
                f"{rec.namespace} in spec.allowedNamespaces",
            )
        elif self.lend_gpus_only and (
            foreign := borrowing.adapter_references(rec.spec, rec.namespace, pool.namespace, pool.job_storage)
        ):  # never inspected, placed or mounted: a borrower names nothing of the pool's namespace
            message = borrowing.refusal("LoRAAdapter", rec.namespace, pool.key, foreign)
            rec.problem = artifacts.Problem(Reason.FOREIGN_REFERENCE, message)
        else:
            found = artifacts.inspect(
                rec.spec, pool.spec.max_lora_rank, rec.base_dir, check_paths=self.check_artifact_paths
            )
            if isinstance(found, artifacts.Problem):
                rec.problem = found
            elif rec.spec.type == "lora" and pool.spec.max_loras == 0:
                rec.problem = artifacts.Problem(
                    Reason.INVALID_SPEC,
                    f"the WarmPool {pool.name} serves no LoRA adapters (serving.maxLoras 0)",
                )
            else:
                rec.url, rec.rank = found.url, found.rank or rec.spec.rank or 0
                rec.status.rank = found.rank
        rec.status.observed_generation = rec.generation

    # -- the round ----------------------------------------------------------------------------------
    def serving_need(self, key: str) -> int:
        """Pods pool ``key`` (its id) must keep for serving: its minimum, one while requests for it wait
        (for its base model through this pool, or for an adapter it serves). Requests waiting for the
        model by name alone (a gateway older than ``base_model_id``) count for every pool of it."""
        pool = self.pools.get(key)
        if pool is None:
            return 0
        need = pool.spec.min_replicas
        names = [base_model_id(pool.model, key), pool.model]
        names += [r.key for r in self.adapters.values() if r.pool == key and r.url]
        if any(self.bus.demand(name) is not None for name in names):
            need = max(need, 1)
        return need

    def tick(self, workers: dict[str, WorkerRecord], pool_of: dict[str, str] | None = None) -> None:
        """``pool_of``: worker id -> pool id of the records (the fleet's, read this round); None: worked
        out here (``records.record_pool``)."""
        # Requests per adapter from the gateway(s) (POPULARITY_WINDOW_S windows): replicas by share. The
        # counts move by the minute, so they are read every few seconds, not every 50 ms round.
        now = self.clock()
        self._reassert_if_due(now)
        if self.pools and now - self._popularity_at >= POPULARITY_READ_S:
            self._popularity, self._popularity_at = self.bus.popularity(now), now
        vouched = self.vouched() if self.vouched is not None else None
        if pool_of is None:
            pool_of = {wid: k for wid, w in workers.items() if (k := record_pool(w, self.pools))}
        for key, pool in self.pools.items():
            self._publish_pool(pool, None if vouched is None else vouched.get(key, {}))
            serving = {
                wid: w
                for wid, w in workers.items()
                if pool_of.get(wid) == key
                and w.serving is not None
                and w.state in (WorkerState.READY, WorkerState.BUSY)
            }
            self._pods[key] = len(serving)
            self._place(pool, serving)
        for rec in list(self.adapters.values()):
            self._report(rec, workers)

    def _reassert_if_due(self, now: float) -> None:
        """Forget what was written, so this round writes it all again, when it is time (periodic), after
        a gap between rounds (reconnect) or when the registry lost the pool records (one HLEN a round)."""
        why = None
        if self._last_tick is not None and now - self._last_tick > ROUND_GAP_S:
            why = "reconnect"
        elif now - self._asserted_at >= REASSERT_S:
            why = "periodic"
        elif self._published and self.bus.redis.hlen(pools_key(self.bus.ns)) < len(self._published):
            why = "lost"
            log.warning("the registry lost the serving pool records (Redis restarted?): writing them again")
        self._last_tick = now
        if why is None:
            return
        self._published.clear()
        self._placed.clear()
        self._asserted_at = now
        if self.metrics is not None:
            self.metrics.reasserts.labels(why).inc()

    def _publish_pool(self, pool: _Pool, vouched: dict[str, str] | None) -> None:
        s = pool.spec
        record = ServingPoolRecord(
            pool=pool.name,
            model=pool.model,
            routing_policy=s.routing_policy,
            hold_timeout_s=float(s.hold_timeout_seconds),
            ttft_slo_s=s.slo.ttft_milliseconds / 1000 if s.slo and s.slo.ttft_milliseconds else None,
            tpot_slo_s=s.slo.tpot_milliseconds / 1000 if s.slo and s.slo.tpot_milliseconds else None,
            namespace=pool.namespace,
            admits=sorted(pool.allowed),
            adapters={
                r.key: r.rank
                for r in sorted(self.adapters.values(), key=lambda r: r.key)
                if r.pool == pool.key and r.url and not r.deleting
            },
            unservable={
                r.key: r.unservable
                for r in sorted(self.adapters.values(), key=lambda r: r.key)
                if r.pool == pool.key and r.url and not r.deleting and r.unservable
            },
            vouched=None if vouched is None else dict(sorted(vouched.items())),
        )
        text = record.dumps()
        if self._published.get(key := pool.key) != text:
            self.bus.publish_pool(record)
            self._published[key] = text

    def _place(self, pool: _Pool, serving: dict[str, WorkerRecord]) -> None:
        wanted = [r for r in self.adapters.values() if r.pool == pool.key and r.url and not r.deleting]
        pods = [
            PodView(
                name=wid,
                max_loras=max(w.serving.max_loras, 0) if w.serving else 0,
                max_cpu_loras=max(pool.spec.max_cpu_loras, pool.spec.max_loras),
                max_lora_rank=pool.spec.max_lora_rank,
                device=frozenset(_ids(w, lambda a: a.tier == "device")),
                host=frozenset(_ids(w, lambda a: a.tier != "device")),
                in_use=frozenset(_ids(w, lambda a: a.running > 0)),
                ready=True,
            )
            for wid, w in sorted(serving.items())
        ]
        demands = [
            AdapterDemand(
                name=r.key,
                rank=r.rank,
                replicas=r.spec.replicas,
                pinned=r.spec.pinned,
                requests_per_window=float(self._popularity.get(r.key, 0)),
            )
            for r in sorted(wanted, key=lambda r: r.key)
        ]
        by_name = {r.key: r for r in wanted}  # placement names adapters by their id (namespace/name)
        placement = place(pods, demands, PlacementConfig()) if pods else None
        for wid in serving:
            share: dict[str, PlacedAdapter] = {}
            if placement is not None:
                # An in-use adapter that is no longer wanted (being deleted) stays in the placement but
                # has no record: it is left out, and the worker's unload waits for its requests.
                for name in sorted(placement.device.get(wid, frozenset()) & by_name.keys()):
                    share[name] = _placed(by_name[name], "device")
                for name in sorted(placement.host.get(wid, frozenset()) & by_name.keys()):
                    share.setdefault(name, _placed(by_name[name], "host"))
            if self._placed.get(wid) != share:
                self.bus.set_placement(wid, share)
                self._placed[wid] = share

    # -- status -------------------------------------------------------------------------------------
    def _report(self, rec: AdapterRecord, workers: dict[str, WorkerRecord]) -> None:
        holders: list[Holder] = []
        errors: list[str] = []
        reasons: set[str] = set()
        for wid, w in sorted(workers.items()):
            if w.serving is None:
                continue
            for a in w.serving.adapters:
                if adapter_id(a.namespace, a.name) == rec.key:
                    holders.append(Holder(wid, "device" if a.tier == "device" else "host", a.load_seconds))
            if rec.key in w.serving.placement_errors:
                errors.append(f"{wid}: {w.serving.placement_errors[rec.key]}")
                reasons.add(w.serving.placement_reasons.get(rec.key, Reason.ADAPTER_LOAD_FAILED))
        problem = rec.problem
        if problem is None and errors and not holders:
            # The worker's load is the check the control plane could not make (a claim only pods mount,
            # another base model's shapes): the same kind of condition, in the worker's words.
            # The worker's own reason (StorageAccessDenied...) when every pod that tried agrees on it.
            reason = reasons.pop() if len(reasons) == 1 else Reason.ADAPTER_LOAD_FAILED
            problem = artifacts.Problem(reason, "; ".join(errors))
        rec.unservable = f"{problem.reason}: {problem.message}" if problem and not holders else None
        self._set_status(rec, holders, problem)

    def _set_status(
        self, rec: AdapterRecord, holders: list[Holder], problem: artifacts.Problem | None
    ) -> None:
        st, gen = rec.status, rec.generation
        ready: tuple[ConditionStatus, str, str]
        loaded: tuple[ConditionStatus, str, str]
        now = self.clock()
        stamp = units.format_timestamp(datetime.fromtimestamp(now, UTC))
        since = {p.pod: p.since for p in st.loaded_on}
        st.loaded_on = [
            AdapterPlacement(pod=h.pod, tier=h.tier, since=since.get(h.pod) or stamp) for h in holders
        ]
        st.ready_replicas = sum(1 for h in holders if h.tier == "device")
        loads = [h.load_seconds for h in holders if h.load_seconds is not None]
        if loads:
            st.load_seconds = f"{max(loads):.3f}"
        if problem is not None:
            ready = ("False", problem.reason, problem.message)
        else:
            ready = (
                "True",
                Reason.SERVABLE,
                f"served as model {rec.name} to namespace {rec.namespace} on WarmPool {rec.pool} "
                f"({rec.spec.base_model})",
            )
        if holders:
            where = ", ".join(f"{h.pod} ({h.tier})" for h in holders)
            loaded = ("True", Reason.ADAPTER_LOADED, f"held by {where}")
        elif problem is not None:
            loaded = ("False", problem.reason, "not loaded: " + problem.message)
        elif not self._pods.get(rec.pool):
            loaded = (
                "False",
                Reason.NO_WARM_POD,
                "no warm pod in the pool; the first request for it scales the pool up and it loads there",
            )
        else:
            loaded = ("False", Reason.LOADING, "placed on the pool's pods; loading")
        for type_, (status, reason, message) in (
            (ConditionType.READY, ready),
            (ConditionType.LOADED, loaded),
        ):
            st.conditions = set_condition(
                st.conditions,
                type_,
                status,
                reason,
                message,
                observed_generation=gen,
            )
        st.observed_generation = gen
        text = st.model_dump_json()
        if self._status_sent.get(rec.key) != text:
            self._status_sent[rec.key] = text
            self.on_status(rec)


@dataclass(frozen=True)
class Holder:
    pod: str
    tier: Literal["device", "host"]
    load_seconds: float | None


def _ids(w: WorkerRecord, which: Callable[[AdapterState], bool]) -> list[str]:
    """The ids (namespace/name) of the adapters ``w`` reports holding that ``which`` selects."""
    return [adapter_id(a.namespace, a.name) for a in (w.serving.adapters if w.serving else []) if which(a)]


def holders_of(key: str, workers: dict[str, WorkerRecord]) -> list[str]:
    """The workers that report holding the adapter ``key`` (namespace/name), by id."""
    return sorted(
        wid
        for wid, w in workers.items()
        if w.serving and any(adapter_id(a.namespace, a.name) == key for a in w.serving.adapters)
    )


def _placed(rec: AdapterRecord, tier: str) -> PlacedAdapter:
    """What a worker is told to hold: the artifact and, for s3://, only the NAME of its Secret (or
    AMBIENT_CREDENTIALS when the adapter asks for the pods' own identity)."""
    spec = rec.spec
    return PlacedAdapter(
        url=rec.url, tier=tier, secret=s3_credentials(spec.artifact_secret, spec.use_ambient_credentials)
    )
