"""Lint and architecture rules run with the tests, so the one test command checks them too."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    res = _run(ruff, "check", "contract", "operator", "worker", "testing", "gateway", "ssjf",
               "bench", "demo", "cli", "tools", "tests")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


def test_import_contracts_hold():
    """The control plane never imports torch/transformers/peft; scheduling stays pure (pyproject)."""
    lint = _tool("lint-imports")
    if lint is None:
        pytest.fail("import-linter is not installed: pip install -e '.[dev]'")
    res = _run(lint)
    assert res.returncode == 0, res.stdout + res.stderr


#: (module to add, its source, the contract that must break): each contract shown to fail on a
#: deliberate violation in a copy of the source tree (issue 41). Add a case per contract.
VIOLATIONS = [
    pytest.param(
        "worker/elastune_worker/violation.py",
        "import elastune_demo.build\n",
        "No product package imports the demo fixtures (workers find the demo models by entry point)",
        id="worker-imports-demo",
    ),
    pytest.param(
        "cli/elastune_cli/violation.py",
        "import elastune_bench.cli\n",
        "The CLI imports the product and the demo fixtures, never the benchmarks or the test support "
        "(entry points)",
        id="cli-imports-bench",
    ),
    pytest.param(
        "operator/elastune_operator/violation.py",
        "import elastune_cli.main\n",
        "No product package imports the CLI (it sits above them)",
        id="operator-imports-cli",
    ),
    pytest.param(
        "worker/elastune_worker/engine/core/violation.py",
        "import torch\n",
        "The engine core is pure: no torch, no model libraries, no HTTP, no Redis, no Kubernetes, no other "
        "project package (the simulators step it without them)",
        id="engine-core-imports-torch",
    ),
    pytest.param(
        "worker/elastune_worker/coserve/planner.py",  # the planner itself, replaced by one import
        "import torch\n",
        "The co-serving planner is pure: no torch, no engine, no trainer",
        id="coserve-planner-imports-torch",
    ),
    pytest.param(
        "worker/elastune_worker/engine/violation.py",
        "import elastune_worker.coserve.hook\n",
        "The engine knows co-serving only through its step hook: it imports no co-serving, tuning, worker "
        "server or Prompt Bank",
        id="engine-imports-coserve",
    ),
    pytest.param(
        "worker/elastune_worker/tuning/violation.py",
        "import elastune_worker.engine.core.sampling\n",
        "Serving and tuning are independent: what both need is in elastune_worker.modeling",
        id="tuning-imports-engine",
    ),
    pytest.param(
        "worker/elastune_worker/engine/api/violation.py",
        "import elastune_worker.engine.frontend.streams\n",
        "The worker's HTTP API knows the engine only through EngineClient: of the engine, it imports its "
        "client and core only",
        id="engine-api-imports-frontend",
    ),
]


def _source_copy(dest: Path) -> list[Path]:
    """pyproject.toml and the import packages' folders (pyproject's packages.find.where) under dest."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = project["tool"]["setuptools"]["packages"]["find"]["where"]
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for folder in folders:
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return [dest / f for f in folders]


@pytest.mark.parametrize(("module", "source", "contract"), VIOLATIONS)
def test_an_import_contract_breaks_on_a_deliberate_violation(tmp_path, module, source, contract):
    lint = _tool("lint-imports")
    if lint is None:
        pytest.fail("import-linter is not installed: pip install -e '.[dev]'")
    folders = _source_copy(tmp_path)
    (tmp_path / module).write_text(source)
    # The copy comes first on sys.path (the editable install's finder runs after the path finder).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, folders))}
    res = subprocess.run(
        [lint, "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    said = " ".join(res.stdout.split())
    assert res.returncode == 1, said
    assert f"{contract} BROKEN" in said, said
    assert said.count("BROKEN") == 1, said  # the violation breaks that contract and no other


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
