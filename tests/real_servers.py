"""Real Redis and Memcached servers for tests, on free ports (no fakes: docs/design.md §8); a server that
cannot start fails the test with the reason (e.g. the Debian package is missing)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elastune_common.servers import Server, ServerError
from elastune_common.servers import start_memcached as _start_memcached
from elastune_common.servers import start_redis as _start_redis


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def start_redis(tmp: Path, *extra: str) -> Server:
    try:
        return _start_redis(tmp, *extra)
    except ServerError as exc:
        pytest.fail(str(exc))


def start_memcached(tmp: Path, *extra: str) -> Server:
    try:
        return _start_memcached(tmp, *extra)
    except ServerError as exc:
        pytest.fail(str(exc))
