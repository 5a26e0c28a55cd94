"""`elastune run -f` as the tests drive it: the CLI in a subprocess, the manifests it reads and the
status files it writes. Used by the local-mode tests (tests/operator/test_local_mode.py) and the S3
output test of the worker (tests/worker/test_s3_storage.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from elastune_demo import tasks as tiny_tasks
from tiny_test_model import TASK


def elastune(
    *args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    cmd = [sys.executable, "-m", "elastune_cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def tuning_job(name: str, dataset: str, *, deadline: str = "10m", iterations: int = 20, **spec: Any) -> dict:
    return {
        "apiVersion": "elastune.dev/v1alpha1",
        "kind": "TuningJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": spec.pop("model", "test-tiny"),
            "dataset": dataset,
            "initialPrompt": tiny_tasks.family_instructions(TASK.family)[0],
            "termination": {"maxIterations": iterations},
            "deadline": deadline,
            "hyperparameters": {"batchSize": 4, "virtualTokens": 4},
            "promptBank": "never",
            **spec,
        },
    }


def warm_pool(model: str, name: str = "test-pool", **spec: Any) -> dict:
    return {
        "apiVersion": "elastune.dev/v1alpha1",
        "kind": "WarmPool",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"model": model, "maxWarmGPUs": 2, "idleWindow": "60s", **spec},
    }


def write(path: Path, *docs: dict) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def status_of(state_dir: Path, name: str) -> dict:
    return yaml.safe_load((state_dir / "status" / "default" / f"{name}.yaml").read_text())["status"]


def condition(status: dict, ctype: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == ctype)
