"""API keys (docs/design.md §6 Tenancy, issue 25 items 2-3): the Secret a user writes, the record the
operator publishes for the gateway, and the Redis keys both use.

A key is a Kubernetes Secret labelled ``elastune.dev/api-key: "true"`` in the namespace whose models it
reaches, with ``stringData.key`` (the key itself), optional ``models`` (comma-separated; default: every
model of that namespace: its WarmPools' models and its LoRAAdapters), ``requestsPerMinute`` and
``tokensPerMinute`` (prompt + completion tokens), and ``allowPriority`` (``"true"``/``"false"``, default
false: whether the OpenAI body's ``priority``, vLLM's queue-jumping extension, is honoured for the key;
for any other key the gateway ignores it), and ``debug`` (``"true"``/``"false"``, default false: whether
the gateway's answers to the key name the worker that served them, ``x-elastune-endpoint``; a platform
operator's key, since a worker's id names a pod of the pool's namespace).

Least privilege: the gateway never reads Secrets. The operator (which may list/watch Secrets in the
namespaces it watches) publishes only the SHA-256 of each key with its scope and limits, as one Redis hash
``{ns}:api-keys`` (field: the hex digest, value: an ``ApiKeyRecord``), and rewrites it on Secret events and
periodically, so a deleted or changed key stops working within seconds. The gateway reads that hash with
its Redis user (the worker's user cannot: redis_acl.py) and counts per-key usage in fixed one-minute
windows under ``{ns}:ratelimit:{digest[:16]}:{requests|tokens}:{minute}``, so limits hold across replicas.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

API_KEY_LABEL = "elastune.dev/api-key"
"""The label (value ``"true"``) that makes a Secret an API key."""
RATE_WINDOW_SECONDS = 60
"""Limits are per minute, counted in fixed windows of this length."""
TENANT_HEADER = "x-elastune-tenant"
"""Set by the gateway on each request it forwards for an authenticated key: the key's Secret
(``namespace/name``), the tenant the engine's ``fair`` queue policy shares service across. Only the gateway
sets it (it forwards no client header; workers take inference only from the gateway); without it the
worker's tenant is ``""``."""


class ApiKeyRecord(BaseModel):
    """What the gateway knows of one key (never the key itself)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret: str
    """``namespace/name`` of the Secret: the label of the key's metrics and what logs name."""
    models: tuple[str, ...]
    """The served model names the key may use (resolved by the operator; empty: none)."""
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    allow_priority: bool = False
    """The key may set the request's ``priority`` (lower first in the engine's priority/sjf queues);
    for other keys the gateway ignores a client's ``priority``."""
    debug: bool = False
    """Answers to the key carry ``x-elastune-endpoint`` (the worker that served them)."""


class InvalidApiKeySecret(ValueError):
    """A labelled Secret that cannot be a key (no ``key``, a limit that is not a positive integer, an
    ``allowPriority`` that is neither true nor false)."""


def key_digest(key: str) -> str:
    """The SHA-256 of a key, hex: the only form of it outside its Secret."""
    return hashlib.sha256(key.encode()).hexdigest()


def api_keys_key(ns: str) -> str:
    return f"{ns}:api-keys"


def rate_key(ns: str, digest: str, kind: Literal["requests", "tokens"], window: int) -> str:
    return f"{ns}:ratelimit:{digest[:16]}:{kind}:{window}"


def is_api_key_secret(doc: Mapping[str, Any]) -> bool:
    meta = doc.get("metadata") or {}
    labels = meta.get("labels") or {} if isinstance(meta, Mapping) else {}
    return (
        doc.get("kind", "Secret") == "Secret"
        and isinstance(labels, Mapping)
        and str(labels.get(API_KEY_LABEL, "")).lower() == "true"
    )


class KeySecret(BaseModel):
    """A labelled Secret, read: its key, the models it names (None: all of its namespace's) and limits."""

    model_config = ConfigDict(frozen=True)

    namespace: str
    name: str
    key: str
    models: tuple[str, ...] | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    allow_priority: bool = False
    debug: bool = False

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"

    def record(self, namespace_models: Iterable[str]) -> ApiKeyRecord:
        """The published record: the key's models within its namespace's (never another namespace's)."""
        mine = set(namespace_models)
        models = sorted(mine if self.models is None else mine & set(self.models))
        return ApiKeyRecord(
            secret=self.id, models=tuple(models),
            requests_per_minute=self.requests_per_minute, tokens_per_minute=self.tokens_per_minute,
            allow_priority=self.allow_priority, debug=self.debug,
        )  # fmt: skip


def read_secret(doc: Mapping[str, Any], default_namespace: str = "default") -> KeySecret:
    """A Secret (``data`` base64 as the API returns it, or ``stringData`` as written) as a KeySecret."""
    meta = doc.get("metadata") or {}
    data: dict[str, str] = {}
    for k, v in (doc.get("data") or {}).items():
        try:
            data[str(k)] = base64.b64decode(str(v)).decode()
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidApiKeySecret(f"data.{k} is not base64 of UTF-8 text") from exc
    data.update({str(k): str(v) for k, v in (doc.get("stringData") or {}).items()})
    key = data.get("key", "").strip()
    where = f"Secret {meta.get('namespace') or default_namespace}/{meta.get('name')}"
    if not key:
        raise InvalidApiKeySecret(f"{where}: no `key`")
    models = None
    if data.get("models", "").strip():
        models = tuple(m.strip() for m in data["models"].split(",") if m.strip())
    limits: dict[str, int | None] = {}
    for field in ("requestsPerMinute", "tokensPerMinute"):
        raw = data.get(field, "").strip()
        if not raw:
            limits[field] = None
            continue
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise InvalidApiKeySecret(f"{where}: {field} must be a positive integer, got {raw!r}")
        limits[field] = value
    allow = data.get("allowPriority", "").strip().lower()
    if allow not in ("", "true", "false"):
        raise InvalidApiKeySecret(f'{where}: allowPriority must be "true" or "false", got {allow!r}')
    debug = data.get("debug", "").strip().lower()
    if debug not in ("", "true", "false"):
        raise InvalidApiKeySecret(f'{where}: debug must be "true" or "false", got {debug!r}')
    return KeySecret(
        namespace=str(meta.get("namespace") or default_namespace), name=str(meta.get("name") or ""),
        key=key, models=models,
        requests_per_minute=limits["requestsPerMinute"], tokens_per_minute=limits["tokensPerMinute"],
        allow_priority=allow == "true", debug=debug == "true",
    )  # fmt: skip


def key_map(
    secrets: Iterable[KeySecret], namespace_models: Mapping[str, Iterable[str]]
) -> dict[str, ApiKeyRecord]:
    """digest → record for every key Secret (namespace_models: namespace → its served model names).
    Two Secrets holding the same key: the first by namespace/name wins."""
    out: dict[str, ApiKeyRecord] = {}
    for s in sorted(secrets, key=lambda s: s.id):
        out.setdefault(key_digest(s.key), s.record(namespace_models.get(s.namespace, ())))
    return out


MAP_META_FIELD = "!published"
"""The map's own field (never a digest: those are hex): ``{"version": ..., "keys": n}``, written with every
publish. Its presence tells a map the operator published, even an empty one (every key revoked), from
no map at all (Redis restarted empty, a FLUSHALL, no publisher yet), which revokes nothing: the gateway
keeps the last map it confirmed, within its staleness bound."""


class MapMeta(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int
    """Nanoseconds since the epoch at publishing: later publishes have larger versions."""
    keys: int = Field(ge=0)


def publish(redis: Any, ns: str, records: Mapping[str, ApiKeyRecord]) -> None:
    """Replace the whole map in one transaction (a key missing from ``records`` stops working), with
    its meta field (``MAP_META_FIELD``)."""
    meta = MapMeta(version=time.time_ns(), keys=len(records))
    pipe = redis.pipeline(transaction=True)
    pipe.delete(api_keys_key(ns))
    fields = {d: _record_json(r) for d, r in records.items()}
    pipe.hset(api_keys_key(ns), mapping={**fields, MAP_META_FIELD: meta.model_dump_json()})
    pipe.execute()


def map_meta(raw: Mapping[str, str]) -> MapMeta | None:
    """The meta field of a map as read; None when there is no published map (or it is unreadable)."""
    text = raw.get(MAP_META_FIELD)
    if text is None:
        return None
    try:
        return MapMeta.model_validate_json(text)
    except ValidationError:
        return None


def _record_json(record: ApiKeyRecord) -> str:
    """A record as published. ``allow_priority`` and ``debug`` only when set: a gateway older than the
    field (its records forbid unknown fields) then still reads every key that does not use it."""
    unset = {f for f in ("allow_priority", "debug") if not getattr(record, f)}
    return record.model_dump_json(exclude=unset or None)


def parse_map(raw: Mapping[str, str]) -> tuple[dict[str, ApiKeyRecord], int]:
    """The gateway's view of the map: (digest → record, malformed entries skipped)."""
    out: dict[str, ApiKeyRecord] = {}
    bad = 0
    for digest, text in raw.items():
        if digest == MAP_META_FIELD:
            continue
        try:
            out[digest] = ApiKeyRecord.model_validate(json.loads(text))
        except (ValidationError, ValueError, TypeError):
            bad += 1
    return out, bad
