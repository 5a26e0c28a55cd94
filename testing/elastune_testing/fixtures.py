"""pytest fixtures for the Kubernetes API emulator.

Use them suite-wide with `pytest_plugins = ["elastune_testing.fixtures"]` in the top conftest.py,
or import the fixture into one test module (`from elastune_testing.fixtures import k8s_emulator`).
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastune_testing.emulator import EmulatorHandle, start_emulator


@pytest.fixture
def k8s_emulator(tmp_path: Path) -> Iterator[EmulatorHandle]:
    """A fresh emulator in a background thread: `.url`, `.kubeconfig_path`, `.env()` for subprocesses
    (kopf), `.emulator` for in-process assertions through `.call()`."""
    handle = start_emulator(tmp_path / "k8s-emulator")
    try:
        yield handle
    finally:
        handle.stop()
