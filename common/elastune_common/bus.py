"""The Redis client of the bus protocol: both sides of ``elastune_contract.protocol`` (its key layout
and message shapes) on one connection pool. Workers register, heartbeat and pop assignments; the control
plane reads the registry and event streams and writes assignments, pool records and placements."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar, cast
from urllib.parse import urlsplit

import redis
from pydantic import BaseModel, ValidationError

from elastune_common.redact import redact_url
from elastune_common.tls import redis_ssl_kwargs
from elastune_contract.protocol import (
    DEFAULT_NAMESPACE,
    EVENTS_TTL_SECONDS,
    PASSWORD_ENV,
    POPULARITY_WINDOW_S,
    USERNAME_ENV,
    WORKER_TTL_SECONDS,
    Assignment,
    Event,
    PlacedAdapter,
    PoisonKind,
    ServingDemand,
    ServingPoolRecord,
    WorkerRecord,
    assign_key,
    cancel_key,
    demand_key,
    events_key,
    placement_key,
    pool_id,
    pools_key,
    requests_key,
    worker_key,
)


class BusUnreachable(ConnectionError):
    """Redis cannot be reached; the message names the URL."""


log = logging.getLogger("elastune.bus")

_M = TypeVar("_M", bound=BaseModel)

_POISON_MEMORY = 4096
MAX_ENTRY_CHARS = 1 << 20
"""A registry entry (worker record, event, placement...) longer than this is dropped unparsed, as a poison
entry (counted): the largest legitimate one, a worker record listing its adapters, is a few KiB, and a pod
may write anything of up to Redis' proto-max-bulk-len under its own keys (issue 39 item 2)."""
"""Distinct poison entries remembered (each is logged and counted once, however often it is read)."""


class Bus:
    """Both sides of the protocol on one Redis connection pool."""

    def __init__(self, url: str, namespace: str = DEFAULT_NAMESPACE, *, socket_timeout: float = 10.0) -> None:
        self.url = url
        self.ns = namespace
        extra = {}
        if urlsplit(url).password is None and os.environ.get(PASSWORD_ENV):
            extra["password"] = os.environ[PASSWORD_ENV]  # from a Secret, never in the URL on disk
        if urlsplit(url).username is None and os.environ.get(USERNAME_ENV):
            extra["username"] = os.environ[USERNAME_ENV]  # the role's Redis ACL user (redis_acl.py)
        # encoding_errors="replace": bytes that are not UTF-8 in one record make that record unreadable
        # (skipped and counted below), never the whole MGET or HGETALL that read it.
        self.redis = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=5.0,
            decode_responses=True,
            encoding_errors="replace",
            **redis_ssl_kwargs(url),  # rediss://: the CA of $ELASTUNE_REDIS_CA_FILE (elastune_common.tls)
            **extra,
        )
        self.on_poison: Callable[[PoisonKind], None] | None = None
        """Called once per distinct malformed entry read (a metric counts them: the operator's
        elastune_control_poison_records_total, the gateway's elastune_gateway_poison_records_total)."""
        self.poison: dict[str, int] = {}
        """Distinct malformed entries read so far, by kind."""
        self._poison_seen: set[tuple[str, str, int]] = set()

    def _parse(self, model: type[_M], raw: str, kind: PoisonKind, where: str) -> _M | None:
        """One registry entry, or None when it is malformed: logged and counted once, then skipped, so
        one bad record never fails a whole read (level-triggered: the rest of the round goes on)."""
        try:
            if len(raw) > MAX_ENTRY_CHARS:
                raise ValueError(f"{len(raw)} characters, more than the {MAX_ENTRY_CHARS} an entry may have")
            return model.model_validate_json(raw)
        except (ValidationError, ValueError) as exc:
            mark = (kind, where, hash(raw))
            if mark in self._poison_seen:
                return None
            if len(self._poison_seen) >= _POISON_MEMORY:
                self._poison_seen.clear()
            self._poison_seen.add(mark)
            self.poison[kind] = self.poison.get(kind, 0) + 1
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("skipping a malformed %s entry at %s (%s): %.200r", kind, where, first, raw)
            if self.on_poison is not None:
                self.on_poison(kind)
            return None

    def ping(self) -> None:
        try:
            self.redis.ping()
        except redis.RedisError as exc:
            raise BusUnreachable(f"cannot reach Redis at {redact_url(self.url)}: {exc}") from exc

    def close(self) -> None:
        self.redis.close()

    # -- worker side --------------------------------------------------------------------------------
    def publish_worker(self, record: WorkerRecord, ttl: int = WORKER_TTL_SECONDS) -> None:
        record.heartbeat = time.time()
        pipe = self.redis.pipeline()
        pipe.set(worker_key(self.ns, record.id), record.dumps(), ex=ttl)
        pipe.sadd(f"{self.ns}:workers", record.id)
        pipe.execute()

    def pop_assignment(self, worker_id: str, timeout: float = 1.0) -> Assignment | None:
        item = self.redis.blpop([assign_key(self.ns, worker_id)], timeout=timeout)
        if item is None:
            return None
        return self._parse(Assignment, str(item[1]), "assignment", assign_key(self.ns, worker_id))

    def post(self, event: Event) -> None:
        key = events_key(self.ns, event.job)
        pipe = self.redis.pipeline()
        pipe.xadd(key, {"event": event.dumps()})
        pipe.expire(key, EVENTS_TTL_SECONDS)
        pipe.execute()

    def leave(self, worker_id: str) -> None:
        """The worker side of ``forget_worker``: its record, queue and placement go; its id stays in the
        id set until the control plane's next ``workers()`` prunes it (a pool's Redis user has no SREM,
        which would let it drop other pools' workers: elastune_operator.k8s.redis_users)."""
        self.redis.delete(
            worker_key(self.ns, worker_id), assign_key(self.ns, worker_id), placement_key(self.ns, worker_id)
        )

    def cancelled(self, job: str, attempt: int) -> bool:
        return bool(self.redis.exists(cancel_key(self.ns, job, attempt)))

    # -- control side -------------------------------------------------------------------------------
    def workers(self) -> dict[str, WorkerRecord]:
        """Live workers by id; ids whose record expired are pruned from the registry."""
        # decode_responses=True: the client returns str (its stubs say bytes | str).
        ids: list[str] = sorted(cast(set[str], self.redis.smembers(f"{self.ns}:workers")))
        if not ids:
            return {}
        raws = self.redis.mget([worker_key(self.ns, i) for i in ids])
        live: dict[str, WorkerRecord] = {}
        gone = []
        for wid, raw in zip(ids, raws, strict=True):
            if raw is None:
                gone.append(wid)
            elif (rec := self._parse(WorkerRecord, str(raw), "worker", worker_key(self.ns, wid))) is not None:
                live[wid] = rec
        if gone:
            self.redis.srem(f"{self.ns}:workers", *gone)
        return live

    def assign(self, worker_id: str, assignment: Assignment) -> None:
        self.redis.rpush(assign_key(self.ns, worker_id), assignment.dumps())

    def events(self, job: str, after: str = "0-0", count: int = 1000) -> list[tuple[str, Event]]:
        """Events of ``job`` after stream id ``after``, oldest first (malformed ones skipped and counted)."""
        out = []
        key = events_key(self.ns, job)
        rows = cast(list[tuple[str, dict[str, str]]], self.redis.xrange(key, min=f"({after}", count=count))
        for entry_id, fields in rows:
            raw = fields.get("event", "") if isinstance(fields, dict) else ""
            ev = self._parse(Event, raw, "event", f"{key}#{entry_id}")
            if ev is not None:
                out.append((entry_id, ev))
        return out

    def cancel(self, job: str, attempt: int, ttl: int = 24 * 3600) -> None:
        self.redis.set(cancel_key(self.ns, job, attempt), "1", ex=ttl)

    # -- serving --------------------------------------------------------------------------------------
    def publish_pool(self, record: ServingPoolRecord) -> None:
        self.redis.hset(pools_key(self.ns), pool_id(record.namespace, record.pool), record.dumps())

    def forget_pool(self, pool: str, namespace: str = "") -> None:
        self.redis.hdel(pools_key(self.ns), pool_id(namespace, pool))

    def serving_pools(self) -> dict[str, ServingPoolRecord]:
        """The pool records by ``pool_id`` (``<namespace>/<pool>``)."""
        raw = cast(dict[str, str], self.redis.hgetall(pools_key(self.ns)))
        out = {}
        for pool, v in sorted(raw.items()):
            rec = self._parse(ServingPoolRecord, v, "pool", f"{pools_key(self.ns)}#{pool}")
            if rec is not None:
                out[pool] = rec
        return out

    def post_demand(self, demand: ServingDemand, ttl: int = WORKER_TTL_SECONDS) -> None:
        """Refreshed while requests wait; expires ``ttl`` seconds after the last one stops waiting."""
        self.redis.set(demand_key(self.ns, demand.model), demand.dumps(), ex=ttl)

    def demand(self, model: str) -> ServingDemand | None:
        raw = cast(str | None, self.redis.get(demand_key(self.ns, model)))
        return None if raw is None else self._parse(ServingDemand, raw, "demand", demand_key(self.ns, model))

    def count_requests(self, counts: dict[str, int], now: float | None = None) -> None:
        """Add requests per served name (model or adapter) to the current window. Every gateway replica
        adds to the same per-window hash, so their counts sum; a window expires after three windows."""
        if not counts:
            return
        window = int((time.time() if now is None else now) // POPULARITY_WINDOW_S)
        key = requests_key(self.ns, window)
        pipe = self.redis.pipeline()
        for name, n in counts.items():
            pipe.hincrby(key, name, n)
        pipe.expire(key, 3 * POPULARITY_WINDOW_S)
        pipe.execute()

    def popularity(self, now: float | None = None) -> dict[str, int]:
        """Requests per served name over the last full window and the current one (1-2 windows)."""
        window = int((time.time() if now is None else now) // POPULARITY_WINDOW_S)
        pipe = self.redis.pipeline()
        for w in (window - 1, window):
            pipe.hgetall(requests_key(self.ns, w))
        out: dict[str, int] = {}
        for counts in cast(list[dict[str, str]], pipe.execute()):
            for name, n in counts.items():
                if n.lstrip("-").isdigit():  # HINCRBY keeps them integers; anything else is skipped
                    out[name] = out.get(name, 0) + int(n)
        return out

    def set_placement(self, worker_id: str, adapters: dict[str, PlacedAdapter]) -> None:
        """Replace what ``worker_id`` should hold (one write: the worker never reads half a change)."""
        key = placement_key(self.ns, worker_id)
        pipe = self.redis.pipeline()
        pipe.delete(key)
        if adapters:
            pipe.hset(key, mapping={name: a.dumps() for name, a in adapters.items()})
        pipe.execute()

    def placement(self, worker_id: str) -> dict[str, PlacedAdapter]:
        key = placement_key(self.ns, worker_id)
        raw = cast(dict[str, str], self.redis.hgetall(key))
        out = {}
        for name, v in sorted(raw.items()):
            placed = self._parse(PlacedAdapter, v, "placement", f"{key}#{name}")
            if placed is not None:
                out[name] = placed
        return out

    def forget_worker(self, worker_id: str) -> None:
        pipe = self.redis.pipeline()
        pipe.delete(
            worker_key(self.ns, worker_id), assign_key(self.ns, worker_id), placement_key(self.ns, worker_id)
        )
        pipe.srem(f"{self.ns}:workers", worker_id)
        pipe.execute()
