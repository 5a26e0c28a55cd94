"""Real Memcached servers (and extra Redis ones) for worker tests; the session Redis: tests/conftest.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from elastune_common.servers import Server
from real_servers import start_memcached, start_redis
from real_servers import stop as _stop


@pytest.fixture(scope="session")
def memcached_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_memcached(tmp_path_factory.mktemp("memcached"), "-I", "8m", "-m", "256")
    server.url += "?max_item_size=8388608"  # the client splits values at the server's item size
    yield server
    _stop(server.proc)


@pytest.fixture(params=["redis", "memcached"])
def backend(request: pytest.FixtureRequest) -> Server:
    """A running server of each backend; servers start only when a test asks for them."""
    return request.getfixturevalue(f"{request.param}_server")


def server_keys(server: Server, prefix: str) -> list[str]:
    """Live keys starting with ``prefix``: SCAN on Redis, ``lru_crawler metadump`` on memcached.

    The memcached crawler is best effort (it can miss items the LRU maintainer is moving), so use the
    result to hunt for leftovers, and exact gets to prove a key is present or gone.
    """
    if server.name == "redis-server":
        import redis

        client = redis.Redis.from_url(server.url)
        try:
            return sorted(k.decode() for k in client.scan_iter(match=prefix + "*", count=1000))
        finally:
            client.close()
    for _ in range(50):
        lines = _metadump(server.port)
        if lines and lines[0].startswith("BUSY"):  # another crawl still running
            time.sleep(0.02)
            continue
        keys = [unquote(line.split(" ", 1)[0][4:]) for line in lines if line.startswith("key=")]
        return sorted(k for k in keys if k.startswith(prefix))
    pytest.fail("memcached lru_crawler stayed busy")


def _metadump(port: int) -> list[str]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"lru_crawler metadump all\r\n")
        buf = b""
        while not (buf.endswith(b"END\r\n") or buf.startswith((b"BUSY", b"ERROR", b"CLIENT_ERROR"))):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return buf.decode().splitlines()


@pytest.fixture
def keys_of() -> Callable[[Server, str], list[str]]:
    """``server_keys`` as a fixture, so test modules need not import this conftest by name."""
    return server_keys


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Factory for a private server with extra flags (``make_server("memcached", "-I", "64k")``)."""
    started: list[Server] = []

    def make(kind: str, *extra: str) -> Server:
        folder = tmp_path / f"{kind}-{len(started)}"
        folder.mkdir()
        server = (start_redis if kind == "redis" else start_memcached)(folder, *extra)
        started.append(server)
        return server

    yield make
    for server in started:
        _stop(server.proc)
