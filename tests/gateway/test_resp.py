"""The rate limiter's Redis client (server/resp.py) against a real redis-server: pipelines in flight at
once get their own replies, a refused command comes back as an error in its place, a silent Redis is a
timeout, and a Redis that went away and came back is reconnected to."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from elastune_common.servers import binary
from elastune_gateway.server.resp import PipelineClient, RedisUnavailable, ReplyError
from real_servers import start_redis, stop


def test_concurrent_pipelines_get_their_own_replies_in_order(redis_server: Any) -> None:
    async def scenario() -> list[list[Any]]:
        client = PipelineClient(redis_server.url, timeout=5)
        try:
            key = f"resp-test:{time.time_ns()}"
            # 50 pipelines written before any answer is read: replies must go to the right one.
            batches = [[("INCR", key), ("EXPIRE", key, 60), ("GET", key)] for _ in range(50)]
            return await asyncio.gather(*(client.execute(b) for b in batches))
        finally:
            await client.close()

    replies = asyncio.run(scenario())
    counts = sorted(r[0] for r in replies)
    assert counts == list(range(1, 51))
    assert all(r[1] == 1 and r[2] == str(r[0]).encode() for r in replies)


def test_a_refused_command_is_an_error_in_its_place_and_a_missing_key_is_none(redis_server: Any) -> None:
    async def scenario() -> list[Any]:
        client = PipelineClient(redis_server.url, timeout=5)
        try:
            key = f"resp-test:{time.time_ns()}"
            big = "x" * 100_000  # longer than one read: the parser waits for the rest
            return await client.execute(
                [("SET", key, "text"), ("INCR", key), ("GET", key + ":none"), ("SET", key, big), ("GET", key)]
            )
        finally:
            await client.close()

    ok, refused, missing, ok2, big = asyncio.run(scenario())
    assert ok == "OK" and ok2 == "OK" and missing is None and big == b"x" * 100_000
    assert isinstance(refused, ReplyError) and "not an integer" in str(refused)


def test_a_silent_redis_is_a_timeout(tmp_path: Path) -> None:
    with socket.socket() as listener:  # accepts the connection, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        async def scenario() -> float:
            client = PipelineClient(f"redis://127.0.0.1:{port}/0", timeout=0.3)
            start = time.monotonic()
            with pytest.raises(RedisUnavailable, match="no answer"):
                await client.execute([("INCR", "k")])
            await client.close()
            return time.monotonic() - start

        assert 0.25 < asyncio.run(scenario()) < 5


def test_a_restarted_redis_is_reconnected_to(tmp_path: Path) -> None:
    server = start_redis(tmp_path)

    async def scenario() -> None:
        client = PipelineClient(server.url, timeout=2)
        try:
            assert await client.execute([("INCR", "k")]) == [1]
            stop(server.proc)
            with pytest.raises(RedisUnavailable):
                await client.execute([("INCR", "k")])
            argv = [binary("redis-server"), "--port", str(server.port), "--bind", "127.0.0.1"]
            argv += ["--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
            server.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert await client.execute([("INCR", "k")]) == [1]  # a new server: counts from 1
                    break
                except RedisUnavailable:
                    assert time.monotonic() < deadline, "no reconnection to the restarted redis-server"
                    await asyncio.sleep(0.05)
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        stop(server.proc)


def test_urls_it_cannot_follow_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="redis://"):
        PipelineClient("unix:///run/redis.sock", timeout=1)
    with pytest.raises(ValueError, match="socket_timeout"):
        PipelineClient("redis://127.0.0.1:6379/0?socket_timeout=3", timeout=1)
    c = PipelineClient("rediss://gw:s%40cret@redis.example:6380/3", timeout=1, username="env", password="env")
    got = (c.host, c.port, c.tls, c.db, c.username, c.password)
    assert got == ("redis.example", 6380, True, 3, "gw", "s@cret")


# -- issue 39 item 6: a Redis (or something posing as one) that misbehaves -----------------------------


@pytest.mark.parametrize(
    ("head", "piece", "why"),
    [
        (b"$1073741824\r\n", b"x" * 65536, "bulk reply of 1073741824 bytes"),  # a 1 GB value
        (b"+", b"a" * 65536, "reply line over"),  # a status line that never ends
    ],
    ids=["a 1 GB bulk reply", "an endless status line"],
)
def test_an_oversized_reply_drops_the_connection_instead_of_buffering_it(
    head: bytes, piece: bytes, why: str
) -> None:
    sent = 0
    hung_up = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.read(1024)
        writer.write(head)
        try:
            for _ in range(640):  # 40 MB unless the client hangs up
                writer.write(piece)
                sent += len(piece)
                await writer.drain()
        except ConnectionError:
            hung_up.set()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = PipelineClient(f"redis://127.0.0.1:{port}/0", timeout=5)
        start = time.monotonic()
        with pytest.raises(RedisUnavailable, match=why):
            await client.execute([("GET", "k")])
        assert time.monotonic() - start < 3  # at the cap, not at the command's deadline
        await asyncio.wait_for(hung_up.wait(), 3)
        assert sent < 24 << 20
        await client.close()
        server.close()

    asyncio.run(scenario())


def test_a_redis_that_fails_is_dialled_again_only_after_a_growing_back_off() -> None:
    accepted = 0

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.close()  # accepts, then closes before any reply: as good as refused

    async def scenario() -> None:
        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = PipelineClient(f"redis://127.0.0.1:{port}/0", timeout=2)
        start, failed = time.monotonic(), 0
        while time.monotonic() - start < 0.5:  # a busy gateway: a pipeline every 5 ms
            with pytest.raises(RedisUnavailable):
                await client.execute([("INCR", "k")])
            failed += 1
            await asyncio.sleep(0.005)
        assert failed > 40
        assert 2 <= accepted <= 6  # 0.05 s doubling (jittered) within 0.5 s, not one dial per pipeline
        await client.close()
        server.close()

    asyncio.run(scenario())
