"""`helm template` of the chart, parsed: what the pod world installs (a chart change that breaks the
operator's or gateway's args, env or volumes breaks the cluster tests)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "elastune"


def helm_binary() -> str:
    spec = importlib.util.spec_from_file_location("k8s_binaries", REPO / "tools" / "k8s_binaries.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.find_binary("helm"))


def template(release: str, namespace: str, *sets: str, strings: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``sets`` as --set, ``strings`` as --set-string (an env value of digits stays a string)."""
    argv = [helm_binary(), "template", release, str(CHART), "--namespace", namespace]
    for s in sets:
        argv += ["--set", s]
    for s in strings:
        argv += ["--set-string", s]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]
