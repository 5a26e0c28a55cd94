"""A lean HTTP/1.1 client for the one call on the gateway's hot path: POST a JSON body to a worker and
relay its answer, whole or streamed.

Why not httpx: profiled under load (`elastune bench gateway`, py-spy), httpx and httpcore were about a
third of the gateway's CPU per request — mostly their connection pool checking every idle connection's
socket (through anyio's typed attributes) on each request, and two socket writes per request. Here each
connection is an ``asyncio.Protocol`` whose bytes go straight to httptools' C parser (the one uvicorn
uses), a request is one write, and an idle connection the worker closed leaves the pool the moment its
EOF arrives (``connection_lost``), so reusing one costs nothing.

Failures are told apart as the request path needs them: ``ConnectFailed`` (nothing came back: connection
refused, reset or closed before the status line) may be retried elsewhere; ``ReadTimeout`` (the worker
was silent longer than the read timeout) and ``ConnectionLost`` (dropped mid-answer) may not.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20
"""Bytes of answer buffered for a slow client before the worker's socket stops being read."""


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """Nothing of an answer came back: the request did not run there (or cannot be known to have)."""


class ReadTimeout(UpstreamError):
    """The worker sent nothing for longer than the read timeout."""


class ConnectionLost(UpstreamError):
    """The connection broke after the status line, before the end of the answer."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None
        self.waiting_since = 0.0
        self.timeout = 0.0
        self._reset()

    def _reset(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionLost(f"malformed HTTP answer: {exc}"))
            self._close()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done:
            why = f": {exc}" if exc else ""
            kind = ConnectionLost if self.head_done else ConnectFailed
            self._fail(kind(f"the connection closed before the end of the answer{why}"))

    # -- httptools callbacks ------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # read now: the parser resets after this
        self.done = True
        self._wake()

    # -- the caller's side --------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()

    async def wait(self, timeout: float) -> None:
        """Until the parser made progress (or failed); ReadTimeout after ``timeout`` s of silence.

        One timer per answer, not per wait (a stream waits once per chunk): when it fires it checks how
        long the current wait has lasted and, if not yet ``timeout``, sets itself for the rest."""
        w = self.waiter = self.loop.create_future()
        self.waiting_since, self.timeout = self.loop.time(), timeout
        if self.timer is None:
            self.timer = self.loop.call_at(self.waiting_since + timeout, self._check_silence)
        try:
            await w
        finally:
            self.waiter = None

    def _check_silence(self) -> None:
        self.timer = None
        w = self.waiter
        if w is None:
            return  # between waits: the next one sets the timer again
        due = self.waiting_since + self.timeout
        if self.loop.time() >= due:
            _expire(w)
        else:
            self.timer = self.loop.call_at(due, self._check_silence)

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.done and self.keep_alive and self.error is None and not self.closed


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(ReadTimeout("no answer within the read timeout"))


class UpstreamResponse:
    """A worker's answer with its status line and headers read; read or iterate the body, then
    ``release`` (also when abandoning it: an unfinished answer closes its connection)."""

    def __init__(self, pool: UpstreamPool, key: str, conn: _Connection) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self.status_code = conn.status
        self._released = False

    @property
    def complete(self) -> bool:
        """The whole answer arrived and was taken."""
        return self._conn.done and not self._conn.chunks

    def header(self, name: str) -> str | None:
        value = self.header_bytes(name.lower().encode())
        return None if value is None else value.decode("latin-1")

    def header_bytes(self, lowered: bytes) -> bytes | None:
        """A header's value as it came (``lowered``: its name in lower case)."""
        for k, v in self._conn.headers:
            if k == lowered:
                return v
        return None

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def iter_chunks(self, idle_timeout: float | None = None) -> AsyncIterator[bytes]:
        """The body's chunks as they come; ``idle_timeout``: longest silence between two (default: the
        pool's read timeout), then ReadTimeout."""
        c = self._conn
        wait = self._pool.read_timeout if idle_timeout is None else idle_timeout
        while True:
            if c.chunks:
                yield c.take()
                continue
            if c.done:
                return
            if c.error is not None:
                raise c.error
            await c.wait(wait)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool._put(self._key, self._conn)


class UpstreamPool:
    """Keep-alive connections per worker address; ``post`` is the whole API."""

    def __init__(self, connect_timeout: float, read_timeout: float, max_idle_per_host: int = 256) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[str, list[_Connection]] = {}
        self._targets: dict[str, tuple[str, int, bool, bytes]] = {}
        self._busy: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None

    def _target(self, base_url: str) -> tuple[str, int, bool, bytes]:
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            tls = u.scheme == "https"
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConnectFailed(f"not an http(s) address: {base_url!r}")
            port = u.port or (443 if tls else 80)
            t = self._targets[base_url] = (u.hostname, port, tls, (u.netloc or u.hostname).encode())
        return t

    async def _connect(self, base_url: str) -> _Connection:
        host, port, tls, _ = self._target(base_url)
        loop = asyncio.get_running_loop()
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), host, port, ssl=self._ssl if tls else None
                )
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {base_url} within {self.connect_timeout:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        return conn

    def _get_idle(self, base_url: str) -> _Connection | None:
        idle = self._idle.get(base_url)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    def _put(self, base_url: str, conn: _Connection) -> None:
        self._busy.discard(conn)
        if not conn.reusable():
            conn._close()
            return
        idle = self._idle.setdefault(base_url, [])
        if len(idle) >= self.max_idle_per_host:
            conn._close()
            return
        conn._reset()
        idle.append(conn)

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> UpstreamResponse:
        """Sends the request and waits for the status line and headers (not the body)."""
        _, _, _, host = self._target(base_url)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {host.decode()}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n"
        ).encode("latin-1")
        conn = self._get_idle(base_url)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(base_url)
        try:
            return await self._exchange(base_url, conn, head + body)
        except ConnectFailed:
            if not reused:
                raise
        # A kept-alive connection the worker closed as we wrote on it: once more on a new one.
        return await self._exchange(base_url, await self._connect(base_url), head + body)

    async def _exchange(self, base_url: str, conn: _Connection, request: bytes) -> UpstreamResponse:
        self._busy.add(conn)
        try:
            assert conn.transport is not None
            conn.transport.write(request)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_timeout)
        except BaseException:
            self._busy.discard(conn)
            conn._close()
            raise
        return UpstreamResponse(self, base_url, conn)

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn._close()
        self._idle.clear()
        for conn in list(self._busy):
            conn._close()
        self._busy.clear()
