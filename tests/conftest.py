"""Fixtures every test folder may use: a real Redis server for the session."""

from __future__ import annotations

import os

# Two cores shared by the test processes: busy-waiting OpenMP threads make torch ~25x slower. Set before
# any test imports torch; worker subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator

import pytest

from elastune_common.servers import Server
from real_servers import start_redis, stop


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    stop(server.proc)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (test.sh), the pod world's modules share one worker and so run one after
    another: each world is half a dozen pods on two cores, and its fault tests wait on their timing."""
    for item in items:
        if "tests/cluster" in str(item.path):
            item.add_marker(pytest.mark.xdist_group("podworld"))
