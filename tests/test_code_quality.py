"""Lint and architecture rules run with the tests, so the one test command checks them too."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def _tool(name: str) -> str | None:
    """The test interpreter's own console script first: one found earlier on PATH may belong to another
    Python (a pyenv shim) that does not have this checkout's packages installed."""
    own = Path(sys.executable).parent / name
    return str(own) if own.exists() else shutil.which(name)


def test_ruff_clean():
    ruff = _tool("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    res = _run(ruff, "check", "contract", "operator", "worker", "testing", "gateway", "ssjf", "batching",
               "bench", "tools", "tests")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


def test_import_contracts_hold():
    """The control plane never imports torch/transformers/peft; scheduling stays pure (pyproject)."""
    lint = _tool("lint-imports")
    if lint is None:
        pytest.fail("import-linter is not installed: pip install -e '.[dev]'")
    res = _run(lint)
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_clean():
    """The contract, scheduling, control, the serving engine and routing type-check ([tool.mypy])."""
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: pip install -e '.[dev]'")
    res = _run(sys.executable, "-m", "mypy")
    assert res.returncode == 0, res.stdout + res.stderr


def test_no_package_named_operator_at_top_level():
    # A top-level `operator` package would shadow the standard library (docs/design.md §2).
    assert not (ROOT / "operator" / "__init__.py").exists()
    import operator as stdlib_operator

    assert Path(stdlib_operator.__file__).parent == Path(sys.modules["os"].__file__).parent
