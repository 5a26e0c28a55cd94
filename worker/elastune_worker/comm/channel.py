"""Storage channels: the key-value stores worker processes exchange gradients through (LambdaML style).

A channel only moves opaque bytes; the collective (``allreduce.py``) owns key naming and payload format.
Two backends:

* ``redis://[:password@]host:port/db`` (also ``rediss://`` for TLS). When the URL has no password, it is
  taken from ``$ELASTUNE_REDIS_PASSWORD`` or read from the file named by ``$ELASTUNE_REDIS_PASSWORD_FILE``
  (a mounted Kubernetes Secret), so passwords need not appear in pod specs.
* ``memcached://host:port[?max_item_size=BYTES]``. Memcached refuses items above its item size limit
  (``-I``, 1 MiB by default), so values are split into parts below ``max_item_size`` (default 1 MiB).
  Splitting works with a stock server, but every part is one more round-trip item: for prompts whose
  gradients are several MiB, start the server with a raised limit (e.g. ``memcached -I 8m``) and pass the
  matching ``?max_item_size=8388608``.

Channels are not thread-safe (the memcached client holds one socket): use one per worker process/thread.
"""

from __future__ import annotations

import os
import secrets
import struct
from collections.abc import Iterable, Mapping, Sequence
from hashlib import sha256
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from pymemcache.client.base import Client as MemcacheClient
from pymemcache.exceptions import MemcacheError, MemcacheUnexpectedCloseError

from elastune_common.redact import redact_url
from elastune_common.tls import redis_ssl_kwargs

__all__ = [
    "DEFAULT_MAX_ITEM_SIZE",
    "REDIS_PASSWORD_ENV",
    "REDIS_PASSWORD_FILE_ENV",
    "ChannelError",
    "ChannelUnavailable",
    "MemcachedChannel",
    "RedisChannel",
    "StorageChannel",
    "make_channel",
    "redact_url",
]

REDIS_PASSWORD_ENV = "ELASTUNE_REDIS_PASSWORD"
REDIS_PASSWORD_FILE_ENV = "ELASTUNE_REDIS_PASSWORD_FILE"
REDIS_USERNAME_ENV = "ELASTUNE_REDIS_USERNAME"
DEFAULT_MAX_ITEM_SIZE = 1024 * 1024  # memcached's default `-I`
DEFAULT_TIMEOUT_S = 5.0


class ChannelError(RuntimeError):
    """A storage operation failed (server error, item rejected)."""


class ChannelUnavailable(ChannelError):
    """The storage server cannot be reached or refused the connection (auth)."""


@runtime_checkable
class StorageChannel(Protocol):
    """Byte store shared by the workers of one job. Missing keys read as absent, never as errors."""

    url: str  # password redacted; for error messages

    def set(self, key: str, value: bytes, ttl_s: int) -> None: ...

    def set_many(self, items: Mapping[str, bytes], ttl_s: int) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """Values of the keys that exist; absent keys are left out of the result."""
        ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def ping(self) -> None:
        """Raise ChannelUnavailable unless the server answers."""
        ...

    def close(self) -> None: ...


def _check_ttl(ttl_s: int) -> int:
    if ttl_s < 1:
        # Both servers treat 0 as "never expire": a leaked key would then live forever.
        raise ValueError(f"ttl_s must be >= 1 second, got {ttl_s}")
    return int(ttl_s)


# --------------------------------------------------------------------------------------------- Redis


class RedisChannel:
    """Redis (redis-py) backend. Values of any size up to Redis' 512 MB are stored as single strings."""

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = redact_url(url)
        kwargs: dict[str, object] = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
        if urlsplit(url).password is None:
            password = _password_from_env()
            if password is not None:
                kwargs["password"] = password
        if urlsplit(url).username is None and os.environ.get(REDIS_USERNAME_ENV):
            kwargs["username"] = os.environ[REDIS_USERNAME_ENV]  # the worker's Redis ACL user
        kwargs.update(redis_ssl_kwargs(url))  # rediss://: the CA of $ELASTUNE_REDIS_CA_FILE
        self._client = redis.Redis.from_url(url, **kwargs)

    @property
    def client(self) -> redis.Redis:
        """The underlying client (tests and tooling scan keys with it)."""
        return self._client

    def _unavailable(self, exc: Exception) -> ChannelUnavailable:
        return ChannelUnavailable(f"storage channel {self.url} is unavailable: {exc}")

    def set(self, key: str, value: bytes, ttl_s: int) -> None:
        self.set_many({key: value}, ttl_s)

    def set_many(self, items: Mapping[str, bytes], ttl_s: int) -> None:
        ttl = _check_ttl(ttl_s)
        if not items:
            return
        try:
            # One round trip; transaction=False because atomicity across keys is not needed.
            pipe = self._client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(key, value, ex=ttl)
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise self._unavailable(exc) from exc
        except redis.RedisError as exc:
            raise ChannelError(f"storage channel {self.url}: set failed: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        return self.get_many([key]).get(key)

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        try:
            values = self._client.mget(list(keys))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise self._unavailable(exc) from exc
        except redis.RedisError as exc:
            raise ChannelError(f"storage channel {self.url}: get failed: {exc}") from exc
        # The client returns bytes (no decode_responses); the check also narrows redis-py's loose types.
        return {k: v for k, v in zip(keys, values, strict=True) if isinstance(v, bytes)}

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        try:
            self._client.delete(*keys)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise self._unavailable(exc) from exc
        except redis.RedisError as exc:
            raise ChannelError(f"storage channel {self.url}: delete failed: {exc}") from exc

    def ping(self) -> None:
        try:
            self._client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # AuthenticationError is a ConnectionError
            raise self._unavailable(exc) from exc
        except redis.ResponseError as exc:  # e.g. NOAUTH when the server wants a password we lack
            raise self._unavailable(exc) from exc

    def close(self) -> None:
        self._client.close()


def _password_from_env() -> str | None:
    password = os.environ.get(REDIS_PASSWORD_ENV)
    if password:
        return password
    path = os.environ.get(REDIS_PASSWORD_FILE_ENV)
    if path:
        # Secrets mounted as files usually end with a newline that is not part of the password.
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    return None


# ------------------------------------------------------------------------------------------ Memcached

# Memcached counts the key, the item header and the CAS value against `-I`; keep this much headroom.
_ITEM_OVERHEAD = 512
_MAX_KEY_LEN = 250  # memcached protocol limit
_TAG_INLINE = b"\x00"
_TAG_SPLIT = b"\x01"
# Head of a split value: number of parts, total length, random token naming this write's parts.
_SPLIT_HEAD = struct.Struct("<IQ8s")


class MemcachedChannel:
    """Memcached (pymemcache) backend that splits values so that every item stays below ``max_item_size``.

    Layout: ``key`` holds a one-byte tag plus either the value itself (small values) or a head
    (part count, total length, token); the parts live under ``key:part:{token}:{n}``. Parts are written
    before the head, so a reader that sees the head finds the parts; the per-write token means an
    overwrite can never splice parts of two writes together.
    """

    def __init__(
        self,
        host: str,
        port: int = 11211,
        *,
        max_item_size: int = DEFAULT_MAX_ITEM_SIZE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        url: str | None = None,
    ) -> None:
        if max_item_size < 2 * _ITEM_OVERHEAD:
            raise ValueError(f"max_item_size must be >= {2 * _ITEM_OVERHEAD} bytes, got {max_item_size}")
        self.url = url or f"memcached://{host}:{port}"
        self.max_item_size = max_item_size
        self._part_size = max_item_size - _ITEM_OVERHEAD - 1  # -1: the tag byte of inline values
        self._client = MemcacheClient(
            (host, port),
            connect_timeout=timeout_s,
            timeout=timeout_s,
            no_delay=True,
            default_noreply=False,  # surface rejected writes (e.g. item too large) instead of losing them
        )

    def _error(self, exc: Exception, op: str) -> ChannelError:
        # Socket errors and a dropped connection mean the server is gone; anything else is a real error.
        if isinstance(exc, OSError | MemcacheUnexpectedCloseError):
            return ChannelUnavailable(f"storage channel {self.url} is unavailable: {exc}")
        return ChannelError(f"storage channel {self.url}: {op} failed: {exc}")

    @staticmethod
    def _server_key(key: str) -> str:
        # Long job names can push keys past memcached's 250-byte limit; a digest keeps them unique.
        if len(key.encode()) <= _MAX_KEY_LEN - 40:  # leave room for the ":part:..." suffix
            return key
        return "elastune:h:" + sha256(key.encode()).hexdigest()

    def set(self, key: str, value: bytes, ttl_s: int) -> None:
        self.set_many({key: value}, ttl_s)

    def set_many(self, items: Mapping[str, bytes], ttl_s: int) -> None:
        ttl = _check_ttl(ttl_s)
        parts: dict[str, bytes] = {}
        heads: dict[str, bytes] = {}
        for key, value in items.items():
            skey = self._server_key(key)
            view = memoryview(value)
            if len(view) <= self._part_size:
                heads[skey] = _TAG_INLINE + bytes(view)
                continue
            token = secrets.token_bytes(8)
            size = self._part_size
            n_parts = -(-len(view) // size)
            for p in range(n_parts):
                parts[_part_key(skey, token, p)] = bytes(view[p * size : (p + 1) * size])
            heads[skey] = _TAG_SPLIT + _SPLIT_HEAD.pack(n_parts, len(view), token)
        self._store(parts, ttl)
        self._store(heads, ttl)

    def _store(self, items: dict[str, bytes], ttl: int) -> None:
        if not items:
            return
        try:
            failed = self._client.set_many(items, expire=ttl, noreply=False)
        except (OSError, MemcacheError) as exc:
            raise self._error(exc, "set") from exc
        if failed:
            raise ChannelError(f"storage channel {self.url}: server did not store {len(failed)} item(s)")

    def get(self, key: str) -> bytes | None:
        return self.get_many([key]).get(key)

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        skeys = {k: self._server_key(k) for k in keys}
        raw = self._fetch(list(set(skeys.values())))
        out: dict[str, bytes] = {}
        split: dict[str, tuple[int, list[str]]] = {}
        for key, skey in skeys.items():
            item = raw.get(skey)
            if item is None:
                continue
            if item[:1] == _TAG_INLINE:
                out[key] = item[1:]
            else:
                n_parts, total, token = _SPLIT_HEAD.unpack(item[1:])
                split[key] = (total, [_part_key(skey, token, p) for p in range(n_parts)])
        if split:
            part_values = self._fetch([pk for _, pks in split.values() for pk in pks])
            for key, (total, pks) in split.items():
                chunks = [part_values.get(pk) for pk in pks]
                if any(c is None for c in chunks):
                    continue  # evicted or deleted under us: absent, like any other missing key
                value = b"".join(chunks)  # type: ignore[arg-type]
                if len(value) == total:
                    out[key] = value
        return out

    def _fetch(self, skeys: list[str]) -> dict[str, bytes]:
        try:
            return self._client.get_many(skeys)
        except (OSError, MemcacheError) as exc:
            raise self._error(exc, "get") from exc

    def delete(self, keys: Iterable[str]) -> None:
        skeys = list({self._server_key(k) for k in keys})
        if not skeys:
            return
        # Heads of split values name their parts; read them first so the parts do not wait for the TTL.
        doomed = list(skeys)
        for skey, item in self._fetch(skeys).items():
            if item[:1] == _TAG_SPLIT:
                n_parts, _total, token = _SPLIT_HEAD.unpack(item[1:])
                doomed.extend(_part_key(skey, token, p) for p in range(n_parts))
        try:
            self._client.delete_many(doomed, noreply=False)
        except (OSError, MemcacheError) as exc:
            raise self._error(exc, "delete") from exc

    def ping(self) -> None:
        try:
            self._client.version()
        except (OSError, MemcacheError) as exc:
            raise self._error(exc, "ping") from exc

    def close(self) -> None:
        self._client.close()


def _part_key(skey: str, token: bytes, p: int) -> str:
    return f"{skey}:part:{token.hex()}:{p}"


# -------------------------------------------------------------------------------------------- factory


def make_channel(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> StorageChannel:
    """Connect to the channel named by ``url`` and check that the server answers.

    Raises ValueError for an unsupported scheme or a malformed URL and ChannelUnavailable (naming the
    URL, password redacted) when the server cannot be reached.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    channel: StorageChannel
    if scheme in ("redis", "rediss"):
        channel = RedisChannel(url, timeout_s=timeout_s)
    elif scheme == "memcached":
        if not parts.hostname:
            raise ValueError(f"memcached URL needs a host: {redact_url(url)!r}")
        query = parse_qs(parts.query)
        unknown = set(query) - {"max_item_size"}
        if unknown:
            raise ValueError(f"unknown memcached URL option(s) {sorted(unknown)} in {redact_url(url)!r}")
        max_item = int(query["max_item_size"][-1]) if "max_item_size" in query else DEFAULT_MAX_ITEM_SIZE
        channel = MemcachedChannel(
            unquote(parts.hostname),
            parts.port or 11211,
            max_item_size=max_item,
            timeout_s=timeout_s,
            url=redact_url(url),
        )
    else:
        raise ValueError(
            f"unsupported storage channel scheme {parts.scheme!r} in {redact_url(url)!r}; "
            "expected redis://, rediss:// or memcached://"
        )
    try:
        channel.ping()
    except ChannelUnavailable:
        channel.close()
        raise
    return channel
