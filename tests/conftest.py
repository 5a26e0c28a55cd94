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

# Markers (registered in pyproject.toml), set here from what a module does rather than by hand, so a new
# module is marked the day it is written: `root` for the pod world (network and mount namespaces),
# `slow` for modules that start processes (the pod world, a kopf operator, `elastune serve`, workers,
# gateways) or train a model. `pytest -m "not slow"` is the quick loop (about a minute here).
_SLOW_HELPERS = (
    "elastune_testing.podworld",
    "operator_site",
    "serve_process",
    "local_run",
    "subprocess",
    "tiny_test_model",
    "elastune_worker.tuning",
    "elastune_worker.engine.llm_engine",
    "elastune_worker.engine.model_runner",
)
_module_is_slow: dict[str, bool] = {}


def _starts_processes(path: Any) -> bool:
    key = str(path)
    if key not in _module_is_slow:
        text = path.read_text(encoding="utf-8") if path.suffix == ".py" else ""
        _module_is_slow[key] = any(f"import {h}" in text or f"from {h} " in text or f"from {h}." in text
                                   for h in _SLOW_HELPERS)  # fmt: skip
    return _module_is_slow[key]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        in_pod_world = "tests/cluster/" in item.path.as_posix()
        if in_pod_world:
            item.add_marker(pytest.mark.root)
        if in_pod_world or _starts_processes(item.path):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    stop(server.proc)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called only when test.sh runs workers
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each test module is one unit of work, on one worker, its tests in their order (module fixtures
    are shared state: a gateway's usage test counts the requests the module's earlier tests made, a
    pod world test mounts the claim the one before it created); the pod world's modules (tests/cluster)
    are one unit together, so one world runs at a time (half a dozen pods on two cores, fault tests
    that wait on their timing). xdist's ``loadgroup`` mark did not do the second here (pytest 9.2,
    xdist 3.8: the marked tests ran on both workers, and their ids carried no group; why, not traced).
    An explicit ``--dist`` other than load is respected."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/cluster" if nodeid.startswith("tests/cluster/") else nodeid.split("::", 1)[0]

    return ModulesTogether(config, log)
