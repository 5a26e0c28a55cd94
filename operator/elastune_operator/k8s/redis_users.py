"""A Redis user per WarmPool (issue 39 item 2): each pool's workers get a credential of their own, confined
to that pool's keys, instead of one worker password copied into every pool namespace.

What a pool's worker touches (``elastune_common.bus`` worker side, ``elastune_worker.comm``), and so all
its user may touch (``pool_acl_rules``):

- its registry record ``{bus}:worker:<ns>/<pod>`` (SET with a TTL, DEL on exit) and the id set
  ``{bus}:workers`` (SADD only: the control plane prunes ids whose record expired, so no SREM, which would
  let a pod drop other pools' workers from the registry);
- its assignment queue ``{bus}:assign:<ns>/<pod>`` (BLPOP, DEL) and placement ``{bus}:placement:<ns>/<pod>``
  (HGETALL, DEL), both written by the operator only;
- the events ``{bus}:job:<job ns>/<job>:events`` (XADD, EXPIRE) and cancel flags (EXISTS) of jobs of the
  namespaces the pool admits (its own and ``spec.allowedNamespaces``), and their gradients
  ``elastune:<job ns>.<job>.<uid>.a<n>:<step>:grad|merged:...`` (SET, GET, MGET, DEL).

Pods of a pool's Deployment are named ``<pool>-<replicaset hash>-<suffix>``, so ``<ns>/<pool>-*`` are its
worker ids. Redis key patterns are globs: pool ``a``'s pattern also matches pool ``a-b``'s pods of the
same namespace (one tenant; a namespace is the trust boundary), never another namespace's (a namespace
name holds no ``/`` and no ``.``). Everything else - FLUSHALL, CONFIG, KEYS, SCAN, ACL, other keys - is
refused (NOPERM).

Passwords: 32 random bytes, stored by Redis as SHA-256 hashes (``#<hash>``) and handed to the pods in the
Secret ``<pool>-redis-user`` (keys ``username``, ``password``) the pool's Deployment reads its env from.
The operator keeps only the hashes, in the WarmPool's ``status.redisUser`` (the contract's
``RedisUserStatus``), and re-asserts every pool's user from there every ``RECHECK_S``: a Redis that
restarts empty (no persistence, a replaced external Redis) gets each user back with the passwords the
pool's running pods hold, and no password is kept anywhere but in the Secret. Status, not Redis, is the
record: what lives only in Redis is lost with it. A new password's hash is recorded there before Redis or
the Secret gets the password (intent before effect). Rotation (on an interval, or when the WarmPool's
``rotate.elastune.dev/redis-password`` annotation changes): a new password is added to the user and
written to the Secret; the old one stays valid (Redis allows several passwords per user) until every
listed pod of the pool was created after the rotation, then it is removed. Env from a Secret is read when
a container starts, so a running worker keeps its password and a restarted one reads the new one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import redis
from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_contract.api import units
from elastune_contract.api.constants import GROUP, LABEL_WARM_POOL, PLURAL_WARM_POOLS, VERSION
from elastune_contract.api.warmpool import ALL_NAMESPACES, RedisUserStatus, WarmPool
from elastune_contract.protocol import pool_id

log = logging.getLogger("elastune.redis_users")

SECRET_SUFFIX = "-redis-user"
USERNAME_KEY = "username"
PASSWORD_KEY = "password"
ROTATE_ANNOTATION = f"rotate.{GROUP}/redis-password"
"""Set or change this annotation of a WarmPool (any value) to rotate its Redis password now. Not under
``elastune.dev/``: kopf keeps its own state there and leaves those annotations out of what it diffs."""
MAX_PREVIOUS = 4
"""Old passwords kept valid at most (each until no pod older than its rotation is listed); a fifth
rotation before the pods restart drops the oldest."""
RECHECK_S = 5.0
"""How often every pool's user is re-asserted from its status (a restarted Redis lost its users)."""
POD_CHECK_S = 5.0
"""How often a pool with an old password still valid lists its pods to see whether it can go."""
# What every client does on connect (redis-py: HELLO/AUTH, CLIENT SETINFO) and to check the server.
_CONNECT = "+ping +hello +auth +client|setname +client|getname +client|id"


class RedisUserUnavailable(Exception):
    """The pool's Redis user cannot be created: the message says why and what the operator needs."""


def pool_username(bus_ns: str, namespace: str, pool: str) -> str:
    return f"{bus_ns}:pool:{namespace}/{pool}"


def pool_secret_name(pool: str) -> str:
    """``<pool>-redis-user``; a WarmPool name near the 253-character limit is shortened with a digest."""
    name = f"{pool}{SECRET_SUFFIX}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(pool.encode()).hexdigest()[:10]
    return f"{pool[: 253 - len(SECRET_SUFFIX) - 11]}-{digest}{SECRET_SUFFIX}"


def admitted(pool: WarmPool) -> list[str]:
    """The namespaces whose jobs may run on the pool: its own and spec.allowedNamespaces (``*``: all)."""
    own = pool.metadata.namespace or "default"
    allowed = [str(a) for a in pool.spec.allowed_namespaces or []]
    return ["*"] if ALL_NAMESPACES in allowed else list(dict.fromkeys([own, *allowed]))


def pool_acl_rules(
    bus_ns: str, namespace: str, pool: str, admits: list[str], reads_only: bool = False
) -> str:
    """The rules of the pool's user after ``user <name> on #<hash>...``: one selector per kind of key,
    each with only the commands the worker runs on it (``acl_rules`` of the contract, per pool);
    ``reads_only``: only the read-only selectors (a pool cut off for its Redis budget)."""
    b, mine = bus_ns, f"{namespace}/{pool}-*"
    events = " ".join(f"~{b}:job:{ns}/*:events" for ns in admits)
    cancels = " ".join(f"%R~{b}:job:{ns}/*:cancel:*" for ns in admits)
    grads = " ".join(f"~elastune:{ns}.*:grad:* ~elastune:{ns}.*:merged:*" for ns in admits)
    selectors = [
        f"~{b}:worker:{mine} +set",
        f"~{b}:workers +sadd",
        f"~{b}:assign:{mine} +blpop",
        f"{events} +xadd +expire",
        f"{cancels} +exists",
        f"%R~{b}:placement:{mine} +hgetall",
        f"~{b}:worker:{mine} ~{b}:assign:{mine} ~{b}:placement:{mine} +del",
        f"{grads} +set +get +mget +del",
    ]
    if reads_only:
        selectors = [s for s in selectors if s.startswith("%R")]
    # MULTI/EXEC: redis-py pipelines are transactions by default.
    base = f"resetkeys resetchannels -@all {_CONNECT} +multi +exec +discard"
    return " ".join([base, *(f"({s})" for s in selectors)])


def _hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


@dataclass
class UserState:
    """What the operator keeps of a pool's user (hashes only, never a password)."""

    current: str
    previous: list[str] = field(default_factory=list)
    rotated_at: float = 0.0
    request: str = ""
    """The rotate annotation's value last acted on."""
    written: bool = False
    """Whether the Secret holds ``current``'s password (written after the user has it)."""
    suspended: bool = False
    """Write rights cut (over its Redis budget: k8s.redis_budget) until a rotation is asked for."""

    def to_status(self) -> dict[str, Any]:
        """``status.redisUser`` as a merge patch: every field set, so none keeps an older value."""
        stamp = units.format_timestamp(datetime.fromtimestamp(self.rotated_at, UTC))
        status = RedisUserStatus(
            password_hash=self.current, previous_hashes=self.previous, rotated_at=stamp,
            rotation_request=self.request, secret_written=self.written, suspended=self.suspended,
        )  # fmt: skip
        return status.model_dump(by_alias=True, mode="json")

    @classmethod
    def from_status(cls, status: RedisUserStatus) -> UserState:
        return cls(
            current=status.password_hash, previous=list(status.previous_hashes),
            rotated_at=units.parse_timestamp(status.rotated_at).timestamp(),
            request=status.rotation_request or "", written=status.secret_written, suspended=status.suspended,
        )  # fmt: skip


class PoolRedisUsers:
    """Creates, rotates and deletes the pools' Redis users; ``redis_client`` is the operator's own, which
    needs ``+acl|setuser +acl|deluser +acl|getuser`` (docs/operations/redis-state.md); ``custom`` writes
    the WarmPools' status, where each user's state is kept."""

    def __init__(
        self,
        redis_client: redis.Redis,
        core: client.CoreV1Api,
        custom: client.CustomObjectsApi,
        bus_ns: str,
        rotation_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis_client
        self.core = core
        self.custom = custom
        self.bus_ns = bus_ns
        self.rotation_s = rotation_s
        self.clock = clock
        self._states: dict[str, UserState] = {}  # pool id -> what this process last wrote to its status
        self._checked: dict[str, float] = {}  # pool id -> clock of the last re-assert
        self._pods_checked: dict[str, float] = {}  # pool id -> clock of the last pod listing

    # -- the pool's user ------------------------------------------------------------------------------
    def ensure(self, pool: WarmPool) -> str:
        """Create or re-assert the pool's user and Secret, rotating when due; the Secret's name.
        Raises RedisUserUnavailable when Redis refuses (no ACL rights, or no ACLs at all)."""
        ns, name = pool.metadata.namespace or "default", pool.metadata.name or ""
        key = pool_id(ns, name)
        state = self._load(pool)
        request = (pool.metadata.annotations or {}).get(ROTATE_ANNOTATION, "")
        now = self.clock()
        due = state is not None and (
            request != state.request or (self.rotation_s > 0 and now - state.rotated_at >= self.rotation_s)
        )
        if state is None or not state.written or due:
            # A new password; one asked for also gives back write rights a budget cut took.
            self._issue(pool, state, request, now)
        else:
            self._setuser(pool, state)
        self._checked[key] = now
        return pool_secret_name(name)

    def tick(self, pools: list[WarmPool]) -> None:
        """Every round: rotate what is due, retire old passwords no pod needs, re-assert users."""
        now = self.clock()
        for pool in pools:
            key = pool_id(pool.metadata.namespace or "default", pool.metadata.name or "")
            try:
                state = self._load(pool)
                if (
                    state is not None
                    and state.previous
                    and now - self._pods_checked.get(key, 0) >= POD_CHECK_S
                ):
                    self._pods_checked[key] = now
                    self._retire(pool, state)
                rotate = (
                    self.rotation_s > 0 and state is not None and now - state.rotated_at >= self.rotation_s
                )
                if rotate or now - self._checked.get(key, 0) >= RECHECK_S:
                    self.ensure(pool)
            except (RedisUserUnavailable, redis.RedisError, ApiException) as exc:
                log.warning("Redis user of WarmPool %s: %s", key, exc)

    def suspend(self, pool: WarmPool) -> None:
        """Cut the user's write rights now (its open connections too) until a rotation is asked for."""
        state = self._load(pool)
        if state is None or state.suspended:
            return
        state = replace(state, suspended=True)
        self._store(pool, state)
        self._setuser(pool, state)

    def suspended(self, pool: WarmPool) -> bool:
        state = self._load(pool)
        return state is not None and state.suspended

    def remove(self, namespace: str, name: str) -> None:
        """The pool is gone: its user goes (Redis disconnects its clients); its Secret goes with the
        WarmPool (owner reference)."""
        key = pool_id(namespace, name)
        self._states.pop(key, None)  # a WarmPool of that name created later starts afresh
        self.redis.execute_command("ACL", "DELUSER", pool_username(self.bus_ns, namespace, name))
        self._checked.pop(key, None)
        self._pods_checked.pop(key, None)

    # -- internals ------------------------------------------------------------------------------------
    def _issue(self, pool: WarmPool, state: UserState | None, request: str, now: float) -> None:
        """A new password: recorded (hash, in status), given to the user, then written to the Secret
        (intent before effect: a stop in between leaves ``written`` false and the next ensure issues
        another, keeping this one valid like a rotated one)."""
        ns, name = pool.metadata.namespace or "default", pool.metadata.name or ""
        # What is recorded first (a user without passwords when nothing is): a Redis that refuses ACL
        # SETUSER fails here, before a status write, so a refused pool's retries record nothing.
        self._setuser(pool, state)
        password = secrets.token_urlsafe(32)
        # A rotation: the running pods' password stays valid until they are gone. One not confirmed
        # written (a stop between the Secret and the status) stays too: the Secret may hold it.
        previous = [state.current, *state.previous][:MAX_PREVIOUS] if state is not None else []
        suspended = state is not None and state.suspended and request == state.request
        # Whole seconds, rounded up: pods' creationTimestamp has whole seconds (_retire compares them).
        new = UserState(
            current=_hash(password), previous=previous, rotated_at=float(math.ceil(now)), request=request,
            suspended=suspended,
        )  # fmt: skip
        self._store(pool, new)
        self._setuser(pool, new)
        self._write_secret(pool, password)
        self._store(pool, replace(new, written=True))
        log.info("Redis user of WarmPool %s/%s: new password (%d old still valid)", ns, name, len(previous))

    def _setuser(self, pool: WarmPool, state: UserState | None) -> None:
        """The user as ``state`` says (None: no password, so nobody can log in as it)."""
        ns, name = pool.metadata.namespace or "default", pool.metadata.name or ""
        suspended = state is not None and state.suspended
        rules = pool_acl_rules(self.bus_ns, ns, name, admitted(pool), reads_only=suspended)
        known = [state.current, *state.previous] if state is not None else []
        hashes = [f"#{h}" for h in dict.fromkeys(known)]
        # reset: nothing of an earlier version of the rules (or of a user someone made by hand) stays.
        args = ["reset", "on", *hashes, *rules.split()]
        try:
            self.redis.execute_command("ACL", "SETUSER", pool_username(self.bus_ns, ns, name), *args)
        except redis.exceptions.NoPermissionError as exc:
            raise RedisUserUnavailable(
                "the operator's Redis user may not create users: grant it +acl|setuser +acl|deluser "
                f"+acl|getuser (docs/operations/redis-state.md); Redis said: {exc}"
            ) from exc
        except redis.exceptions.ResponseError as exc:
            raise RedisUserUnavailable(
                f"Redis refused ACL SETUSER (Redis 7 with ACLs is required for per-pool users): {exc}"
            ) from exc

    def _write_secret(self, pool: WarmPool, password: str) -> None:
        ns, name = pool.metadata.namespace or "default", pool.metadata.name or ""
        username = pool_username(self.bus_ns, ns, name)
        data = {
            USERNAME_KEY: base64.b64encode(username.encode()).decode(),
            PASSWORD_KEY: base64.b64encode(password.encode()).decode(),
        }
        secret = pool_secret_name(name)
        body: Any = {  # a plain dict, as the API takes it (the client's stubs want its model)
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": secret,
                "namespace": ns,
                "labels": {"app.kubernetes.io/managed-by": "elastune-operator", LABEL_WARM_POOL: name},
                "ownerReferences": [
                    {
                        "apiVersion": f"{GROUP}/v1alpha1",
                        "kind": "WarmPool",
                        "name": name,
                        "uid": pool.metadata.uid or "",
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "type": "Opaque",
            "data": data,
        }
        try:
            self.core.create_namespaced_secret(ns, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_namespaced_secret(secret, ns, {"data": data})

    def _retire(self, pool: WarmPool, state: UserState) -> None:
        """Drop the old passwords once no listed pod of the pool was created before the rotation."""
        ns, name = pool.metadata.namespace or "default", pool.metadata.name or ""
        resp: Any = self.core.list_namespaced_pod(
            ns, label_selector=f"{LABEL_WARM_POOL}={name}", _preload_content=False
        )
        pods = json.loads(resp.data).get("items") or []
        for pod in pods:
            created = (pod.get("metadata") or {}).get("creationTimestamp")
            if not created or _seconds(created) < state.rotated_at:
                return  # a pod that may still hold an old password
        state = replace(state, previous=[])
        self._store(pool, state)
        self._setuser(pool, state)
        log.info(
            "Redis user of WarmPool %s/%s: old passwords removed (no pod older than the rotation)", ns, name
        )

    def _load(self, pool: WarmPool) -> UserState | None:
        """What this process last recorded, else the WarmPool's status as read (after a restart)."""
        key = pool_id(pool.metadata.namespace or "default", pool.metadata.name or "")
        if key in self._states:
            return self._states[key]
        recorded = pool.status.redis_user if pool.status is not None else None
        return UserState.from_status(recorded) if recorded is not None else None

    def _store(self, pool: WarmPool, state: UserState) -> None:
        """Into the WarmPool's status (a merge patch of ``status.redisUser`` only), then in memory; an
        API error leaves both as they were and is raised."""
        ns, name = pool.metadata.namespace or "default", pool.metadata.name or ""
        body = {"status": {"redisUser": state.to_status()}}
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL_WARM_POOLS, name, body)
        self._states[pool_id(ns, name)] = state


def _seconds(timestamp: str) -> float:
    """An RFC 3339 timestamp of the API (``2026-12-07T19:00:00Z``) as Unix seconds."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
