"""The real operator as a process for tests (`kopf run -m elastune_operator.k8s.handlers`, standalone, all
namespaces) against the API emulator: the environment every such test starts from, and its stop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

OPERATOR = [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces"]
OPERATOR += ["-m", "elastune_operator.k8s.handlers"]


def start_operator(
    kubeconfig: Path,
    redis_url: str,
    bus: str,
    work_dir: Path,
    log: Path,
    *,
    without_aws: bool = False,
    **env: str,
) -> subprocess.Popen[bytes]:
    """The operator on ``bus``'s keys, its metrics on a free port and no API-key watch; ``env`` adds or
    overrides variables (ELASTUNE_...). ``without_aws``: no AWS_* variable of this process reaches it (the
    tests that hold it to a named Secret)."""
    base = {k: v for k, v in os.environ.items() if not (without_aws and k.startswith("AWS_"))}
    full = {
        **base,
        "KUBECONFIG": str(kubeconfig),
        "ELASTUNE_REDIS_URL": redis_url,
        "ELASTUNE_NAMESPACE": bus,
        "ELASTUNE_WORK_DIR": str(work_dir),
        "ELASTUNE_METRICS_PORT": "0",
        "ELASTUNE_API_KEYS": "false",
        **env,
    }
    with log.open("wb") as out:
        return subprocess.Popen(OPERATOR, env=full, stdout=out, stderr=subprocess.STDOUT)


def stop_operator(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (kopf's own shutdown), SIGKILL after 15 s."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
