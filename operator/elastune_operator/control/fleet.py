"""The fleet: which worker process stands for which GPU of the scheduler's state.

The scheduler thinks in GPUs (launched, warm, busy, released) of pools, by pool id (namespace/name);
the backend starts worker processes or pods, which show up in the Redis registry when they run. The
fleet binds a newly warm worker to the oldest GPU launched for its pool (``record_pool``: two
namespaces' pools of one model never take each other's workers; its measured start-to-ready time is
T_cold), notices workers that
vanished, died before becoming warm or cannot load their model, and re-binds the workers of an attempt
that outlived a control-plane restart. What happens to the jobs is the core's business: the fleet
reports, the core decides.

Level-triggered: a bound worker whose record is missing for one read is not lost yet (a Redis that
restarted empty, or a FLUSHALL, loses every record until the next heartbeat re-registers it); it is lost
when the backend says it exited or its record stays missing for ``MISSING_GRACE_S`` (60 s). A worker lost that
way (silent, not exited) which registers again later (it was paused past its TTL, or partitioned) is
bound and used again like a new one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from elastune_common.bus import Bus
from elastune_contract.protocol import PoisonKind, WorkerRecord, WorkerState, vouched_url
from elastune_operator.control.backend import ClusterBackend, WorkerExit
from elastune_operator.control.records import MISSING_GRACE_S, PoolConfig, record_pool
from elastune_operator.metrics import ControlMetrics
from elastune_operator.scheduling.estimator import Estimator
from elastune_operator.scheduling.state import ClusterState

log = logging.getLogger("elastune.control")


def exit_pool(how: WorkerExit, pools: Mapping[str, PoolConfig]) -> str | None:
    """The id of the pool of a worker that exited: the one the backend names, else (a backend that
    names none, or not by id) the lowest id of a pool serving its model."""
    if how.pool in pools:
        return how.pool
    return min((k for k, p in pools.items() if p.model == how.model), default=None)


class FleetEvents(Protocol):
    """What the fleet reports while it syncs, in registry order; the core decides what it means for jobs."""

    def worker_lost(self, wid: str, gid: int, now: float, how: WorkerExit | None = None) -> None:
        """A bound worker is gone (record expired, or the backend says how: process exited, pod
        crash-looping or OOMKilled)."""

    def worker_start_failed(self, wid: str, how: WorkerExit, now: float) -> None:
        """A worker exited, or its pod cannot start, before it ever became warm."""

    def worker_broken(self, rec: WorkerRecord, now: float) -> None:
        """A worker reports it cannot serve its model (FAILED)."""

    def gpu_warm(self, job: str) -> None:
        """A GPU held for ``job`` just became warm."""


class Fleet:
    def __init__(
        self,
        state: ClusterState,
        bus: Bus,
        backend: ClusterBackend,
        estimator: Estimator,
        metrics: ControlMetrics,
        missing_grace_s: float = MISSING_GRACE_S,
    ) -> None:
        self.state, self.bus, self.backend = state, bus, backend
        self.missing_grace_s = missing_grace_s
        self.estimator, self.metrics = estimator, metrics
        self.gpu_of: dict[str, int] = {}  # worker id -> GPU id
        self.worker_of: dict[int, str] = {}  # GPU id -> worker id
        self.unbound: dict[str, list[int]] = {}  # pool id -> GPUs launched, no worker bound yet (FIFO)
        self.failed_workers: set[str] = set()
        self.gone: set[str] = set()
        self.start_failures: dict[str, int] = {}  # pool id -> start failures in a row
        self.pool_of: dict[str, str] = {}  # worker id -> pool id, of the records last read
        self.missing: dict[str, float] = {}  # bound worker id -> when its record was first missing
        self.silent: set[str] = set()  # lost because its record vanished (no exit seen): may come back
        self._unvouched: set[str] = set()  # records ignored (logged once each): no pod of their pool
        # One malformed registry record is logged, counted and skipped (Bus._parse), never a failed round.
        bus.on_poison = self._count_poison

    def _count_poison(self, kind: PoisonKind) -> None:
        self.metrics.poison_records.labels(kind).inc()

    def add_pool(self, key: str) -> None:
        self.unbound.setdefault(key, [])

    # -- the registry -------------------------------------------------------------------------------
    def sync(
        self, now: float, pools: Mapping[str, PoolConfig], adoptable: set[str], events: FleetEvents
    ) -> dict[str, WorkerRecord]:
        """Read the registry and the backend's exits, report what changed, bind warm workers to
        launched GPUs of their pools (``pools``: pool id -> config); returns the registry as read.

        ``adoptable`` are jobs this process knows and dispatched itself: a busy worker of any other job
        (the control plane restarted) is left to the core's recovery, never adopted as idle."""
        records = self._vouched_only(self.bus.workers(), pools)
        exited = self.backend.exited()
        self.pool_of = {wid: key for wid, rec in records.items() if (key := record_pool(rec, pools))}
        for wid, gid in list(self.gpu_of.items()):
            if wid in records and wid not in exited:
                self.missing.pop(wid, None)
                continue
            if wid not in exited and now - self.missing.setdefault(wid, now) < self.missing_grace_s:
                continue  # the registry may have lost it (Redis restarted): its next heartbeat tells
            self.missing.pop(wid, None)
            if wid not in exited:
                self.silent.add(wid)
            events.worker_lost(wid, gid, now, exited.get(wid))
        for wid, how in exited.items():
            if wid in self.gone or wid in self.failed_workers or exit_pool(how, pools) is None:
                continue
            rec = records.get(wid)
            if rec is not None and rec.state is WorkerState.FAILED:
                continue  # it says why itself: worker_broken below
            self.gone.add(wid)
            # Never warm: gone before it registered, or while it was still loading (a pod OOMKilled
            # while loading its weights registered as starting, and its record outlives it a while).
            if wid not in self.gpu_of and (rec is None or rec.state is WorkerState.STARTING):
                events.worker_start_failed(wid, how, now)
        for wid, rec in records.items():
            if wid in self.silent and wid in self.gone and wid not in exited:
                # Its record was deleted when it was lost: this one is a new heartbeat. It is back.
                self.gone.discard(wid)
                self.silent.discard(wid)
                log.warning("worker %s registered again after it was considered gone: using it again", wid)
                pool_ns = self.pool_of.get(wid, "").rpartition("/")[0]
                self.metrics.workers_returned.labels(rec.model, pool_ns).inc()
            key = self.pool_of.get(wid)
            if wid in self.gpu_of or wid in self.gone or key is None:
                continue
            if rec.state is WorkerState.FAILED and wid not in self.failed_workers:
                self.failed_workers.add(wid)
                events.worker_broken(rec, now)
            elif wid in exited:
                continue
            elif rec.state is WorkerState.BUSY and rec.job not in adoptable:
                # Busy with an attempt this process did not dispatch (it restarted): the core's recovery
                # adopts it with its job, or it comes back READY when that attempt ends or is cancelled.
                continue
            elif rec.state in (WorkerState.READY, WorkerState.BUSY) and (
                self.unbound[key] or self.state.cold_free > 0
            ):
                job = self._bind(wid, rec, key, now)
                if job:
                    events.gpu_warm(job)
        return records

    def _vouched_only(
        self, records: dict[str, WorkerRecord], pools: Mapping[str, PoolConfig]
    ) -> dict[str, WorkerRecord]:
        """The records the backend vouches for: a record counts only when its worker id is a pod (or a
        process) the backend lists for the pool the record names, at the address it registered (issue 39
        item 1: a pool's image is its author's choice, and the worker credential can write any record;
        a pod of another namespace that wrote a READY record naming this pool was handed its job).
        Anything else is dropped, logged once and counted. A backend that vouches for nothing (tests'
        fakes) leaves the registry as read."""
        vouch = getattr(self.backend, "vouched", None)
        if vouch is None:
            return records
        vouched: dict[str, dict[str, str]] = vouch()
        out: dict[str, WorkerRecord] = {}
        for wid, rec in records.items():
            key = record_pool(rec, pools)
            if key is None:
                out[wid] = rec  # no pool of ours: nothing is bound or placed from it
                continue
            address = vouched.get(key, {}).get(wid)
            if address is not None and vouched_url(address, rec.url) is not None:
                out[wid] = rec
                self._unvouched.discard(wid)
                continue
            if wid not in self._unvouched:
                self._unvouched.add(wid)
                log.warning(
                    "ignoring the registry record of %s for pool %s: no pod of that pool has this id and "
                    "address (%s)", wid, key, rec.url or "no URL",
                )  # fmt: skip
                self.metrics.unvouched.labels("worker").inc()
        return out

    def _bind(self, wid: str, rec: WorkerRecord, key: str, now: float) -> str | None:
        """Bind a warm worker to the oldest GPU launched for its pool ``key`` (one nobody launched in
        this process — the control plane restarted — is adopted as a new GPU). Returns the GPU's job."""
        unbound = self.unbound[key]
        gid = unbound.pop(0) if unbound else self.state.launch(key, now).id
        self.gpu_of[wid], self.worker_of[gid] = gid, wid
        if rec.ready_at is not None:
            cold = max(0.0, rec.ready_at - rec.started_at)
            self.estimator.observe_cold_start(key, cold)
            self.metrics.cold_start.labels(rec.model, key.rpartition("/")[0]).observe(cold)
        gpu = self.state.gpus[gid]
        self.state.gpu_ready(gid, now)
        self.start_failures.pop(key, None)  # max_attempts counts start failures in a row
        return gpu.job

    # -- changes the core asks for ------------------------------------------------------------------
    def launched(self, key: str, gid: int) -> None:
        """A GPU left the cold pool for pool ``key``; the next warm worker of that pool binds to it."""
        self.unbound[key].append(gid)

    def count_start_failure(self, key: str) -> int:
        n = self.start_failures[key] = self.start_failures.get(key, 0) + 1
        return n

    def forget(self, wid: str) -> int | None:
        """A bound worker is gone: unbind it and drop its registry entry. Returns its GPU."""
        self.missing.pop(wid, None)
        gid = self.gpu_of.pop(wid, None)
        if gid is not None:
            self.worker_of.pop(gid, None)
        self.gone.add(wid)
        self.bus.forget_worker(wid)
        log.warning("worker %s is gone", wid)
        return gid

    def take_unbound(self, key: str) -> int | None:
        """A launched worker will never become warm: any unbound GPU of the pool stands for it."""
        return self.unbound[key].pop() if self.unbound.get(key) else None

    def unbind(self, gid: int) -> str | None:
        """The GPU returns to the cold pool: its worker (if any) is no longer ours. Returns it."""
        wid = self.worker_of.pop(gid, None)
        if wid is not None:
            del self.gpu_of[wid]
            self.missing.pop(wid, None)
        return wid

    def workers(self, gids: list[int]) -> list[str]:
        return [self.worker_of[g] for g in gids]

    def alive(self, wids: list[str]) -> list[str]:
        return [w for w in wids if w in self.gpu_of]

    def adopt(self, key: str, wids: list[str], now: float) -> list[int]:
        """Workers still running an attempt after a control-plane restart get warm GPUs of pool ``key``
        again."""
        gids = []
        for wid in wids:
            gpu = self.state.launch(key, now)
            self.state.gpu_ready(gpu.id, now)
            self.gpu_of[wid], self.worker_of[gpu.id] = gpu.id, wid
            gids.append(gpu.id)
        return gids
