"""Real Redis and Memcached servers for the worker tests, started on free ports (no fakes: DESIGN.md §6)."""

from __future__ import annotations

import getpass
import os

# Two cores shared by the test processes: busy-waiting OpenMP threads make torch ~25x slower. Set before
# any test imports torch; worker subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

INSTALL_HINT = "apt-get install -y redis-server memcached"


@dataclass
class Server:
    name: str
    port: int
    url: str
    proc: subprocess.Popen[bytes]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; the storage-channel tests need real servers: {INSTALL_HINT}")
    return path


def _start(name: str, argv_for_port: list[str], url_for_port: str, log: Path) -> Server:
    """Start the server, retrying on a port race, and wait until it accepts TCP connections."""
    last_err = ""
    for _ in range(3):
        port = free_port()
        argv = [a.format(port=port) for a in argv_for_port]
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return Server(name, port, url_for_port.format(port=port), proc)
            except OSError:
                time.sleep(0.02)
        _stop(proc)
        last_err = log.read_text(errors="replace")[-2000:]
    pytest.fail(f"could not start {name} ({' '.join(argv)}):\n{last_err}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # SIGKILL: the servers keep nothing worth flushing, and memcached's SIGTERM exit lags up to a second.
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def start_redis(tmp: Path, *extra: str) -> Server:
    binary = _binary("redis-server")
    argv = [binary, "--port", "{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(tmp), *extra]
    return _start("redis-server", argv, "redis://127.0.0.1:{port}/0", tmp / "redis.log")


def start_memcached(tmp: Path, *extra: str) -> Server:
    binary = _binary("memcached")
    argv = [binary, "-p", "{port}", "-U", "0", "-l", "127.0.0.1", *extra]
    if os.geteuid() == 0:
        argv += ["-u", getpass.getuser()]  # memcached refuses to run as root without -u
    return _start("memcached", argv, "memcached://127.0.0.1:{port}", tmp / "memcached.log")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    _stop(server.proc)


@pytest.fixture(scope="session")
def memcached_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_memcached(tmp_path_factory.mktemp("memcached"), "-I", "8m", "-m", "256")
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
