"""A minimal Redis client for the rate limiter's hot path: pipelines of simple commands (INCR, EXPIRE,
GET, INCRBY) on one kept connection, several pipelines in flight at once, replies parsed as they arrive.

Why not redis-py's asyncio client: profiled with native frames (py-spy --native under
`elastune bench gateway`), its pipeline was about a tenth of the gateway's CPU per request with limits
on: a pipeline object, a retry wrapper and a timeout context per call, a connection taken from and
returned to a pool, and many ``get_running_loop()`` calls, each a getpid() system call in CPython 3.11.
Here a pipeline is one write and one future; Redis answers pipelines in order, so replies go to the
oldest waiting pipeline. RESP2, ``redis://`` and ``rediss://`` URLs (user, password, database in the
path); a timeout or a broken connection fails every pipeline on it and the next one reconnects.

Bounded against a Redis that misbehaves (issue 39 item 6): a bulk reply over ``max_reply_bytes`` or a
reply line over ``MAX_LINE_BYTES`` drops the connection instead of buffering it; array replies are refused
outright (no command sent here returns one, so no depth or length can be exhausted); every pipeline has
the deadline ``timeout``; a connection that fails before its first reply makes the next attempts wait a
growing, jittered back-off (``BACKOFF_FIRST_S`` doubling to ``BACKOFF_MAX_S``), during which pipelines fail
at once rather than each dialling a Redis that is down.
"""

from __future__ import annotations

import asyncio
import collections
import random
import ssl
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

Reply = int | bytes | str | None

MAX_REPLY_BYTES = 16 << 20
"""Largest bulk reply taken (the gateway reads counters and short values; Redis allows 512 MB)."""
MAX_LINE_BYTES = 64 << 10
"""Longest status, error or integer line; more without its CRLF is not Redis."""
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 2.0


class RedisUnavailable(Exception):
    """No answer: no connection, a dropped one, a timeout, or an answer that is not RESP."""


class ReplyError(Exception):
    """Redis answered a command with an error (``-ERR ...``, ``-NOPERM ...``)."""


_INCOMPLETE = object()


class _Protocol(asyncio.Protocol):
    def __init__(self, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        self.max_reply_bytes = max_reply_bytes
        self.replied = False  # a pipeline was answered: the connection worked
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.pending: collections.deque[
            tuple[asyncio.Future[list[Reply | ReplyError]], int, list[Reply | ReplyError]]
        ]
        self.pending = collections.deque()
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.fail(RedisUnavailable(f"the connection to Redis closed{f': {exc}' if exc else ''}"))

    def fail(self, error: Exception) -> None:
        while self.pending:
            future = self.pending.popleft()[0]
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        pos = 0
        try:
            while self.pending:
                future, wanted, replies = self.pending[0]
                while len(replies) < wanted:
                    reply, pos = _parse(self.buffer, pos, self.max_reply_bytes)
                    if reply is _INCOMPLETE:
                        return
                    replies.append(reply)  # type: ignore[arg-type]
                self.pending.popleft()
                self.replied = True
                if not future.done():
                    future.set_result(replies)
        except ValueError as exc:
            self.fail(RedisUnavailable(f"not a RESP answer: {exc}"))
            self.close()
        finally:
            del self.buffer[:pos]


def _parse(buf: bytearray, pos: int, max_bulk: int = MAX_REPLY_BYTES) -> tuple[object, int]:
    """One reply from ``buf`` at ``pos`` and where the next starts; ``_INCOMPLETE`` if not all there."""
    end = buf.find(b"\r\n", pos, pos + MAX_LINE_BYTES + 2)
    if end < 0:
        if len(buf) - pos > MAX_LINE_BYTES:
            raise ValueError(f"a reply line over {MAX_LINE_BYTES} bytes")
        return _INCOMPLETE, pos
    kind, line = buf[pos : pos + 1], bytes(buf[pos + 1 : end])
    if kind == b":":
        return int(line), end + 2
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, end + 2
        if size > max_bulk:
            raise ValueError(f"a bulk reply of {size} bytes, over the {max_bulk}-byte cap")
        stop = end + 2 + size
        if len(buf) < stop + 2:
            return _INCOMPLETE, pos
        return bytes(buf[end + 2 : stop]), stop + 2
    if kind == b"+":
        return line.decode(), end + 2
    if kind == b"-":
        return ReplyError(line.decode("utf-8", "replace")), end + 2
    if kind == b"*":
        raise ValueError("an array reply (no command sent here returns one)")
    raise ValueError(f"unexpected reply type {bytes(kind)!r}")


def _pack(command: tuple[str | bytes | int, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(command)]
    for arg in command:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


class PipelineClient:
    """``await execute([(b"INCR", key), ...])`` → the replies in order (a ``ReplyError`` in place of a
    command Redis refused); ``RedisUnavailable`` when no answer came within ``timeout`` seconds."""

    def __init__(
        self,
        url: str,
        timeout: float,
        username: str | None = None,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        """``ssl_context``: how ``rediss://`` is verified (server/tls.py; None: the system's CAs)."""
        u = urlsplit(url)
        if u.scheme not in ("redis", "rediss") or u.query:
            raise ValueError(
                f"the rate limiter takes redis://[user:password@]host[:port][/db] or rediss://…, got "
                f"{u.scheme}://…{'?' + u.query if u.query else ''}"
            )
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.tls = u.scheme == "rediss"
        self.ssl_context = ssl_context
        self.db = int(u.path.strip("/") or 0)
        self.username = unquote(u.username) if u.username else username
        self.password = unquote(u.password) if u.password else password
        self.timeout = timeout
        self.max_reply_bytes = max_reply_bytes
        self._failures = 0  # connections in a row that failed before their first reply
        self._retry_at = 0.0
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None

    async def execute(self, commands: Sequence[tuple[str | bytes | int, ...]]) -> list[Reply | ReplyError]:
        protocol = self._protocol
        if protocol is None or protocol.lost:
            wait = self._retry_at - asyncio.get_running_loop().time()
            if wait > 0:
                raise RedisUnavailable(f"Redis at {self.host}:{self.port} failed; next try in {wait:.2f} s")
            try:
                protocol = await self._connect()
            except RedisUnavailable:
                self._back_off()
                raise
        try:
            replies = await self._send(protocol, commands)
        except RedisUnavailable:
            if not protocol.replied:  # accepted, then nothing: as good as refused
                self._back_off()
            raise
        self._failures = 0
        return replies

    def _back_off(self) -> None:
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**self._failures) * random.uniform(0.5, 1.0)
        self._failures = min(self._failures + 1, 16)
        self._retry_at = asyncio.get_running_loop().time() + delay

    async def close(self) -> None:
        if self._protocol is not None:
            self._protocol.close()
            self._protocol = None

    async def _send(
        self, protocol: _Protocol, commands: Sequence[tuple[str | bytes | int, ...]]
    ) -> list[Reply | ReplyError]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Reply | ReplyError]] = loop.create_future()
        protocol.pending.append((future, len(commands), []))
        assert protocol.transport is not None
        protocol.transport.write(b"".join(_pack(c) for c in commands))
        timer = loop.call_later(self.timeout, _expire, protocol, future, self.timeout)
        try:
            return await future
        finally:
            timer.cancel()

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # concurrent pipelines share the one new connection
            if self._protocol is not None and not self._protocol.lost:
                return self._protocol
            loop = asyncio.get_running_loop()
            context = (self.ssl_context or ssl.create_default_context()) if self.tls else None
            try:
                async with asyncio.timeout(self.timeout):
                    _, protocol = await loop.create_connection(
                        lambda: _Protocol(self.max_reply_bytes), self.host, self.port, ssl=context
                    )
            except (OSError, TimeoutError) as exc:
                raise RedisUnavailable(f"cannot connect to Redis at {self.host}:{self.port}: {exc}") from exc
            hello: list[tuple[str | bytes | int, ...]] = []
            if self.password is not None:
                auth = ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
                hello.append(auth)
            if self.db:
                hello.append(("SELECT", self.db))
            if hello:
                for reply in await self._send(protocol, hello):
                    if isinstance(reply, ReplyError):
                        protocol.close()
                        raise RedisUnavailable(f"Redis refused the connection's setup: {reply}")
            self._protocol = protocol
            return protocol


def _expire(protocol: _Protocol, future: asyncio.Future[list[Reply | ReplyError]], timeout: float) -> None:
    if not future.done():
        # The connection's later replies can no longer be matched to their pipelines: start over.
        protocol.fail(RedisUnavailable(f"no answer from Redis within {timeout:g} s"))
        protocol.close()
