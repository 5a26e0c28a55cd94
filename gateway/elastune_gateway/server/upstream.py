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

What a worker can make it hold is bounded (issue 39 item 6): a head of at most ``max_header_bytes`` and
``max_headers`` headers, an SSE event (bytes between two blank lines) of at most ``max_event_bytes``, a
whole other answer of at most ``max_body_bytes`` (``AnswerTooLarge``, the connection dropped); a request
ends within ``total_timeout`` however steadily the worker trickles (``DeadlineExceeded``); a connection idle
longer than ``idle_timeout`` (below the worker's keep-alive, uvicorn's 5 s) is closed, not reused; bytes
arriving on a connection no request is using close it (never handed to the next request).
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


class AnswerTooLarge(ConnectionLost):
    """The worker's head, an event of its stream or its whole answer went past a cap: dropped."""


class DeadlineExceeded(ReadTimeout):
    """The request's total deadline passed, however steadily the worker was sending."""


class Limits:
    """What one answer may make the gateway hold, and how long connections and requests may last."""

    __slots__ = ("idle", "max_body_bytes", "max_event_bytes", "max_header_bytes", "max_headers", "total")

    def __init__(
        self,
        max_header_bytes: int = 64 << 10,
        max_headers: int = 100,
        max_event_bytes: int = 1 << 20,
        max_body_bytes: int = 64 << 20,
        idle_timeout: float = 4.0,
        total_timeout: float = 1800.0,
    ) -> None:
        self.max_header_bytes, self.max_headers = max_header_bytes, max_headers
        self.max_event_bytes, self.max_body_bytes = max_event_bytes, max_body_bytes
        self.idle, self.total = idle_timeout, total_timeout


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: Limits) -> None:
        self.loop, self.limits = loop, limits
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None
        self.due = 0.0
        self.deadline = float("inf")
        self.in_use = False
        self.idle_since = 0.0
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
        self.head_bytes = 0
        self.event_stream = False
        self.since_event = 0  # bytes since the last blank line of an event stream, or of the whole body
        self.ends_line = False

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.in_use or self.done:
            # Bytes no request asked for (on an idle connection, or past the end of the answer): a
            # confused or hostile worker; the next request must never read them as its answer.
            self.keep_alive = False
            self._close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.done:
                self._fail(ConnectionLost(f"malformed HTTP answer: {exc}"))
            self._close()
            return
        if not self.head_done:  # httptools buffers a header until it ends: count what is still open
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_header_bytes:
                self._too_large(f"a response head over {self.limits.max_header_bytes} bytes")

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done:
            why = f": {exc}" if exc else ""
            kind = ConnectionLost if self.head_done else ConnectFailed
            self._fail(kind(f"the connection closed before the end of the answer{why}"))

    # -- httptools callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.done:  # a second answer in the same read, unasked for: the connection is not reused
            self.keep_alive = False
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))
        if len(self.headers) > self.limits.max_headers:
            self._too_large(f"more than {self.limits.max_headers} response headers")
            raise _Stop

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        for k, v in self.headers:
            if k == b"content-type":
                self.event_stream = v.startswith(b"text/event-stream")
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.error is not None:
            return
        if not self.event_stream:
            self.since_event += len(body)
            if self.since_event > self.limits.max_body_bytes:
                self._too_large(f"an answer over {self.limits.max_body_bytes} bytes")
                raise _Stop
        else:
            end = body.rfind(b"\n\n")
            if end >= 0:
                self.since_event = len(body) - end - 2
            elif self.ends_line and body[:1] == b"\n":
                self.since_event = len(body) - 1
            else:
                self.since_event += len(body)
            self.ends_line = body[-1:] == b"\n"
            if self.since_event > self.limits.max_event_bytes:
                self._too_large(f"a stream event over {self.limits.max_event_bytes} bytes")
                raise _Stop
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

    def _too_large(self, what: str) -> None:
        self._fail(AnswerTooLarge(f"the worker sent {what}: answer dropped"))
        self._close()

    def _close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()

    async def wait(self, timeout: float) -> None:
        """Until the parser made progress (or failed); ReadTimeout after ``timeout`` s of silence,
        DeadlineExceeded at the request's deadline.

        One timer per answer, not per wait (a stream waits once per chunk): when it fires it checks
        whether the current wait is due and, if not yet, sets itself for the rest; a wait due sooner
        than the timer (a stream's idle timeout after the longer wait for the head) moves it."""
        w = self.waiter = self.loop.create_future()
        self.due = min(self.loop.time() + timeout, self.deadline)
        if self.timer is not None and self.timer.when() > self.due:
            self.timer.cancel()
            self.timer = None
        if self.timer is None:
            self.timer = self.loop.call_at(self.due, self._check_silence)
        try:
            await w
        finally:
            self.waiter = None

    def _check_silence(self) -> None:
        self.timer = None
        w = self.waiter
        if w is None:
            return  # between waits: the next one sets the timer again
        if self.loop.time() < self.due:
            self.timer = self.loop.call_at(self.due, self._check_silence)
        elif not w.done():
            if self.due >= self.deadline:
                w.set_exception(DeadlineExceeded("the request's total deadline passed"))
            else:
                w.set_exception(ReadTimeout("no answer within the read timeout"))

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


class _Stop(Exception):
    """Raised in a parser callback to stop parsing an answer that went past a cap."""


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

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float,
        max_idle_per_host: int = 256,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        """``ssl_context`` (server/tls.py): workers are reached over HTTPS only, verified with it, their
        certificate checked for ``server_hostname`` (the name every worker certificate carries; None: the
        URL's host); a plain ``http://`` worker address is then refused, never used."""
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_idle_per_host = max_idle_per_host
        self.limits = limits or Limits()
        self._pruner: asyncio.TimerHandle | None = None
        self._idle: dict[str, list[_Connection]] = {}  # oldest first
        self._targets: dict[str, tuple[str, int, bool, bytes]] = {}
        self._busy: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = ssl_context
        self._tls_only, self._server_hostname = ssl_context is not None, server_hostname

    def _target(self, base_url: str) -> tuple[str, int, bool, bytes]:
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            tls = u.scheme == "https"
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConnectFailed(f"not an http(s) address: {base_url!r}")
            if self._tls_only and not tls:
                raise ConnectFailed(f"worker TLS is on: refusing the plain HTTP address {base_url!r}")
            port = u.port or (443 if tls else 80)
            t = self._targets[base_url] = (u.hostname, port, tls, (u.netloc or u.hostname).encode())
        return t

    async def _connect(self, base_url: str) -> _Connection:
        host, port, tls, _ = self._target(base_url)
        loop, limits = asyncio.get_running_loop(), self.limits
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, limits), host, port, ssl=self._ssl if tls else None,
                    server_hostname=self._server_hostname if tls else None,
                )  # fmt: skip
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {base_url} within {self.connect_timeout:g} s") from exc
        except ssl.SSLCertVerificationError as exc:  # the worker CA or name is wrong: say so, not "reset"
            raise ConnectFailed(f"TLS: {base_url} is not a worker the worker CA vouches for: {exc}") from exc
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        return conn

    def _get_idle(self, base_url: str) -> _Connection | None:
        idle = self._idle.get(base_url)
        if not idle:
            return None
        fresh_since = asyncio.get_running_loop().time() - self.limits.idle
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closing
            if conn.idle_since < fresh_since:
                conn._close()  # the worker's keep-alive may close it as the request goes out
                continue
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    def _put(self, base_url: str, conn: _Connection) -> None:
        self._busy.discard(conn)
        conn.in_use = False
        if not conn.reusable():
            conn._close()
            return
        idle = self._idle.setdefault(base_url, [])
        if len(idle) >= self.max_idle_per_host:
            conn._close()
            return
        conn._reset()
        conn.idle_since = conn.loop.time()
        idle.append(conn)
        if self._pruner is None:
            self._pruner = conn.loop.call_at(conn.idle_since + self.limits.idle, self._prune)

    def _prune(self) -> None:
        """Closes the connections idle past the bound (each list is oldest first), then sets itself
        for the next one to expire: idle sockets do not outlive the bound however quiet traffic is."""
        self._pruner = None
        loop = asyncio.get_running_loop()
        fresh_since, next_due = loop.time() - self.limits.idle, float("inf")
        for url, idle in list(self._idle.items()):
            stale = 0
            while stale < len(idle) and (idle[stale].idle_since <= fresh_since or idle[stale].closed):
                idle[stale]._close()
                stale += 1
            del idle[:stale]
            if idle:
                next_due = min(next_due, idle[0].idle_since + self.limits.idle)
            else:
                del self._idle[url]
        if next_due != float("inf"):
            self._pruner = loop.call_at(next_due, self._prune)

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
        deadline = asyncio.get_running_loop().time() + self.limits.total
        conn = self._get_idle(base_url)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(base_url)
        try:
            return await self._exchange(base_url, conn, head + body, deadline)
        except ConnectFailed:
            if not reused:
                raise
        # A kept-alive connection the worker closed as we wrote on it: once more on a new one.
        return await self._exchange(base_url, await self._connect(base_url), head + body, deadline)

    async def _exchange(
        self, base_url: str, conn: _Connection, request: bytes, deadline: float
    ) -> UpstreamResponse:
        self._busy.add(conn)
        conn.in_use, conn.deadline = True, deadline
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
        if self._pruner is not None:
            self._pruner.cancel()
            self._pruner = None
        for idle in self._idle.values():
            for conn in idle:
                conn._close()
        self._idle.clear()
        for conn in list(self._busy):
            conn._close()
        self._busy.clear()
