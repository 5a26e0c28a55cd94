"""Fixtures every test folder may use: a real Redis server for the session."""

from __future__ import annotations

import os

# Two cores shared by the test processes: busy-waiting OpenMP threads make torch ~25x slower. Set before
# any test imports torch; worker subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator
from typing import Any

import pytest

from elastune_common.servers import Server
from real_servers import start_redis, stop


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    stop(server.proc)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called only when test.sh runs workers
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The pod world's tests (tests/cluster) as one unit of work, on one worker, in their order: one
    world at a time (each is half a dozen pods on two cores, and its fault tests wait on their timing),
    and a module's tests build on one another's objects (a PersistentVolumeClaim one test creates,
    the next one's pods mount). Every other test is a unit of its own. xdist's own ``loadgroup`` would
    say this with a mark, but with pytest 9 its renaming of the tests' ids has no effect (seen: the
    pod world's tests ran on both workers). An explicit ``--dist`` other than load is respected."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class PodWorldTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/cluster" if nodeid.startswith("tests/cluster/") else nodeid

    return PodWorldTogether(config, log)
