"""The gateway's HTTP/1.1 client to workers (server/upstream.py) against a real HTTP server on loopback
that answers as the test scripts it: keep-alive reuse, chunked and sized answers, a kept-alive connection
the server closed, silence, refusal, a connection dropped mid-answer, an answer abandoned half-read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from elastune_common.servers import free_port
from elastune_gateway.server import upstream
from elastune_gateway.server.upstream import ConnectFailed, ConnectionLost, ReadTimeout, UpstreamPool

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""Answers request number n on a connection; returns whether to keep the connection open."""


def _sized(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


class Server:
    def __init__(self, script: Script) -> None:
        self.script, self.connections = script, 0
        self.bodies: list[bytes] = []
        self.closed = 0  # connections the client closed (EOF or reset seen by the server)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                self.bodies.append(await _read_request(reader))
                keep = await self.script(reader, writer, n)
                await writer.drain()
                n += 1
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed += 1
        finally:
            writer.close()


def test_connections_are_kept_alive_and_sized_and_chunked_answers_arrive_whole() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if n % 2 == 0:
            w.write(_sized(b'{"n":%d}' % n))
        else:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for part in (b"data: a\n\n", b"data: b\n\n"):
                w.write(b"%x\r\n%s\r\n" % (len(part), part))
                await w.drain()
                await asyncio.sleep(0.01)
            w.write(b"0\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=2)
            r = await pool.post(s.url, "/v1/completions", b'{"x":1}', {"x-request-id": "abc"})
            assert r.status_code == 200 and r.header("Content-Type") == "application/json"
            assert await r.read() == b'{"n":0}'
            r.release()
            r = await pool.post(s.url, "/v1/completions", b'{"x":2}')
            chunks = [c async for c in r.iter_chunks()]
            r.release()
            assert b"".join(chunks) == b"data: a\n\ndata: b\n\n" and len(chunks) == 2
            assert s.connections == 1 and s.bodies == [b'{"x":1}', b'{"x":2}']
            await pool.close()

    asyncio.run(main())


def test_a_kept_alive_connection_the_worker_closed_is_replaced_without_an_error() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(_sized(b"{}"))
        return False  # answers, then closes the connection (as an idle keep-alive timeout does)

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=2)
            for _ in range(3):
                r = await pool.post(s.url, "/", b"{}")
                assert await r.read() == b"{}"
                r.release()
                await asyncio.sleep(0.05)  # the close reaches the client
            assert s.connections == 3
            for _ in range(3):  # at once: the close may arrive only after the next request was written
                r = await pool.post(s.url, "/", b"{}")
                assert await r.read() == b"{}"
                r.release()
            assert s.connections == 6
            await pool.close()

    asyncio.run(main())


def test_an_answer_abandoned_half_read_closes_its_connection() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
        await w.drain()
        await asyncio.sleep(0.3)
        w.write(b"67890")
        return True

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=2)
            r = await pool.post(s.url, "/", b"{}")
            async for chunk in r.iter_chunks():
                assert chunk == b"12345"
                break
            r.release()  # the rest would arrive on this connection: it must not carry the next request
            r = await pool.post(s.url, "/", b"{}")
            assert await r.read() == b"1234567890"
            r.release()
            assert s.connections == 2
            await pool.close()

    asyncio.run(main())


def test_silence_is_a_read_timeout_and_a_closed_port_a_connect_failure() -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        await asyncio.sleep(5)
        return False

    async def main() -> None:
        async with Server(silent) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=0.3)
            t0 = time.monotonic()
            with pytest.raises(ReadTimeout):
                await pool.post(s.url, "/", b"{}")
            assert 0.25 < time.monotonic() - t0 < 2
            with pytest.raises(ConnectFailed):
                await pool.post(f"http://127.0.0.1:{free_port()}", "/", b"{}")
            await pool.close()

    asyncio.run(main())


def test_a_connection_dropped_mid_answer_is_connection_lost_and_before_it_connect_failed() -> None:
    async def mid(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        return False  # closed without the last chunk

    async def before(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        return False  # closed without a status line

    async def main() -> None:
        async with Server(mid) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=2)
            r = await pool.post(s.url, "/", b"{}")
            got = []
            with pytest.raises(ConnectionLost):
                async for chunk in r.iter_chunks():
                    got.append(chunk)
            assert got == [b"data: a\n\n"]
            r.release()
        async with Server(before) as s:
            with pytest.raises(ConnectFailed):
                await pool.post(s.url, "/", b"{}")
            await pool.close()

    asyncio.run(main())


# -- issue 39 item 6: what a misbehaving worker can make the client hold, and for how long ---------------


@pytest.mark.parametrize("when", ["while idle", "in the same write"])
def test_bytes_no_request_asked_for_are_never_handed_to_the_next_request(when: str) -> None:
    answered = 0

    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        nonlocal answered
        answered += 1
        unsolicited = _sized(b'{"unsolicited":1}') if answered == 1 else b""
        if when == "in the same write":
            w.write(_sized(b'{"n":%d}' % answered) + unsolicited)
        else:
            w.write(_sized(b'{"n":%d}' % answered))
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(unsolicited)  # arrives while the connection sits in the pool
        return True

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=2)
            r = await pool.post(s.url, "/", b"{}")
            assert await r.read() == b'{"n":1}'
            r.release()
            await asyncio.sleep(0.2)
            r = await pool.post(s.url, "/", b"{}")
            assert await r.read() == b'{"n":2}'  # its own answer, not the one nobody asked for
            r.release()
            assert s.connections == 2
            await pool.close()

    asyncio.run(main())


def test_a_connection_idle_past_the_bound_is_closed_and_never_reused() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(_sized(b"{}"))
        return True

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=2, limits=upstream.Limits(idle_timeout=0.2))
            r = await pool.post(s.url, "/", b"{}")
            assert await r.read() == b"{}"
            r.release()
            r = await pool.post(s.url, "/", b"{}")  # fresh: reused
            assert await r.read() == b"{}"
            r.release()
            assert s.connections == 1
            await _until(lambda: s.closed == 1)  # pruned on the timer, with no request to look at it
            r = await pool.post(s.url, "/", b"{}")
            assert await r.read() == b"{}"
            r.release()
            assert s.connections == 2
            await pool.close()

    asyncio.run(main())


async def _until(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    stop = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < stop, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("shape", ["an endless header", "ten thousand headers"])
def test_an_oversized_head_fails_the_request_and_drops_the_connection(shape: str) -> None:
    sent = 0

    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        nonlocal sent
        w.write(b"HTTP/1.1 200 OK\r\nx-pad: ")
        for i in range(10_000):  # up to ~10 MB unless the client hangs up
            piece = b"a" * 1024 if shape == "an endless header" else b"b\r\nx-h%d: " % i
            w.write(piece)
            sent += len(piece)
            await w.drain()
        w.write(b"1\r\ncontent-length: 2\r\n\r\n{}")
        return True

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=5)
            with pytest.raises(ConnectionLost, match=r"head|headers") as caught:
                await pool.post(s.url, "/", b"{}")
            assert type(caught.value).__name__ == "AnswerTooLarge"
            await _until(lambda: s.closed == 1)  # the connection was dropped, the worker's writes stopped
            assert sent < 4 << 20
            await pool.close()

    asyncio.run(main())


def test_an_endless_stream_event_fails_the_stream_with_memory_bounded() -> None:
    sent = 0

    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        nonlocal sent
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        w.write(b"d\r\ndata: small\n\n\r\n")
        for _i in range(256):  # 16 MB of one event that never ends, unless the client hangs up
            piece = b"data: " + b"x" * 65536
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
            await w.drain()
        w.write(b"2\r\n\n\n\r\n0\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=5)
            r = await pool.post(s.url, "/", b"{}")
            got = 0
            with pytest.raises(ConnectionLost, match="event over") as caught:
                async for chunk in r.iter_chunks():
                    got += len(chunk)
            r.release()
            assert type(caught.value).__name__ == "AnswerTooLarge"
            assert got <= (1 << 20) + (256 << 10)  # what reached the caller: about one event's cap
            await _until(lambda: s.closed == 1)
            assert sent < 8 << 20
            await pool.close()

    asyncio.run(main())


def test_a_stream_silent_past_its_idle_timeout_fails_then_not_at_the_longer_head_timeout() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        w.write(b"9\r\ndata: a\n\n\r\n")
        await w.drain()
        await asyncio.sleep(6)  # silent
        return False

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=5)
            r = await pool.post(s.url, "/", b"{}")
            t0 = time.monotonic()
            with pytest.raises(ReadTimeout):
                async for _ in r.iter_chunks(idle_timeout=0.3):
                    pass
            r.release()
            assert time.monotonic() - t0 < 2  # the stream's 0.3 s, not the 5 s wait for the head
            await pool.close()

    asyncio.run(main())


def test_a_total_deadline_ends_a_steadily_trickling_stream() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _i in range(50):  # an event every 0.1 s for 5 s: never silent past the idle timeout
            w.write(b"9\r\ndata: a\n\n\r\n")
            await w.drain()
            await asyncio.sleep(0.1)
        w.write(b"0\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(script) as s:
            pool = UpstreamPool(connect_timeout=2, read_timeout=2, limits=upstream.Limits(total_timeout=0.6))
            t0 = time.monotonic()
            r = await pool.post(s.url, "/", b"{}")
            events = 0
            with pytest.raises(ReadTimeout, match="total deadline"):
                async for _ in r.iter_chunks(idle_timeout=1):
                    events += 1
            r.release()
            assert 0.5 < time.monotonic() - t0 < 2 and events >= 3
            await pool.close()

    asyncio.run(main())
