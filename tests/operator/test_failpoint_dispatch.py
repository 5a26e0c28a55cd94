"""The operator killed between an attempt's status write and its dispatch (issue 24 item 4): the real
`elastune operator` process (kopf) against the Kubernetes API emulator and a real Redis, the test playing
the worker's registry record (no torch). ELASTUNE_FAILPOINT=dispatch-after-status ends the operator at
that moment: the attempt is in the job's status and no worker was told; the restarted operator recovers
it (its grace over, the attempt is cancelled and re-run once) and the job finishes exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")
pytest.importorskip("kopf")

from kubernetes import client, config

from elastune_common.bus import Bus
from elastune_contract.api.constants import (
    GROUP,
    LABEL_WARM_POOL,
    PLURAL_TUNING_JOBS,
    PLURAL_WARM_POOLS,
    VERSION,
)
from elastune_contract.protocol import Event, WorkerRecord, WorkerState, assign_key
from elastune_operator.failpoints import DISPATCH_AFTER_STATUS, EXIT_CODE, FAILPOINT_ENV
from elastune_testing.emulator import start_emulator
from elastune_testing.nodes import add_gpu_node
from operator_site import MODEL, NS, wait_for

V = f"{GROUP}/{VERSION}"
POD = "tiny-pod-1"
WORKER = f"{NS}/{POD}"  # as a pod's worker registers; the operator counts only a pod it lists
POD_IP = "10.9.0.1"


class Stack:
    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.tmp, self.redis_url = tmp, redis_url
        self.emulator = start_emulator(tmp / "emulator")
        api = config.new_client_from_config(config_file=str(self.emulator.kubeconfig_path))
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        add_gpu_node(api, "gpu-node-0", 2)  # the cold pool the operator counts (k8s.node_capacity)
        self.bus = Bus(redis_url, f"fp{time.time_ns()}")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def start_operator(self, failpoint: str | None = None) -> subprocess.Popen[bytes]:
        self.starts += 1
        env = {
            **os.environ,
            "KUBECONFIG": str(self.emulator.kubeconfig_path),
            "ELASTUNE_REDIS_URL": self.redis_url,
            "ELASTUNE_REDIS_SECRET": "",
            "ELASTUNE_NAMESPACE": self.bus.ns,
            "ELASTUNE_WORK_DIR": str(self.tmp / "work"),
            "ELASTUNE_METRICS_PORT": "0",
            "ELASTUNE_PROOF_KEY": f"proof-{self.bus.ns}",  # stable across restarts, as the chart's Secret
        }
        env.pop(FAILPOINT_ENV, None)
        if failpoint:
            env[FAILPOINT_ENV] = failpoint
        log = (self.tmp / f"operator-{self.starts}.log").open("wb")
        cmd = [sys.executable, "-m", "elastune_cli", "operator", "--standalone", "--all-namespaces"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self.proc

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("operator-*.log")))

    def heartbeat(self) -> None:
        """The pool's pod (what its Deployment and the kubelet make) and its worker's registry record at the
        pod's address, READY, refreshed as its heartbeat would."""
        core = client.CoreV1Api(self.api)
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": POD, "namespace": NS, "labels": {LABEL_WARM_POOL: "tiny"}},
            "spec": {"containers": [{"name": "worker", "image": "ghcr.io/elastune/worker:0.1.0"}]},
        }  # fmt: skip
        core.create_namespaced_pod(NS, pod)
        core.patch_namespaced_pod_status(POD, NS, {"status": {"phase": "Running", "podIP": POD_IP}})

        def beat() -> None:
            started = time.time()
            while not self._stop.is_set():
                rec = WorkerRecord(
                    id=WORKER, pool="tiny", model=MODEL, state=WorkerState.READY, started_at=started - 3,
                    ready_at=started, url=f"http://{POD_IP}:8080",
                )  # fmt: skip
                self.bus.publish_worker(rec)
                self._stop.wait(1.0)

        self._beat = threading.Thread(target=beat, daemon=True)
        self._beat.start()

    def status(self, name: str) -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_TUNING_JOBS, name)
        return obj.get("status") or {}

    def condition(self, name: str, ctype: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == ctype), {})

    def close(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.emulator.stop()


@pytest.fixture
def stack(tmp_path: Path, redis_server: Any) -> Iterator[Stack]:
    s = Stack(tmp_path, redis_server.url)
    try:
        yield s
    finally:
        s.close()


def test_operator_killed_between_status_and_dispatch_runs_the_job_exactly_once(stack: Stack) -> None:
    pool = {"model": MODEL, "maxWarmGPUs": 1, "volumes": [{"claimName": "shared", "jobStorage": True}]}
    spec = {
        "model": MODEL, "dataset": "/data/train.jsonl", "termination": {"maxIterations": 20},
        "deadline": "10m", "promptBank": "never",
    }  # fmt: skip
    stack.custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL_WARM_POOLS,
        {"apiVersion": V, "kind": "WarmPool", "metadata": {"name": "tiny"}, "spec": pool},
    )
    stack.custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL_TUNING_JOBS,
        {"apiVersion": V, "kind": "TuningJob", "metadata": {"name": "once"}, "spec": spec},
    )
    proc = stack.start_operator(failpoint=DISPATCH_AFTER_STATUS)
    stack.heartbeat()
    wait_for("the operator to stop at the failpoint", lambda: proc.poll() is not None, 90)
    assert proc.returncode == EXIT_CODE, stack.log()[-3000:]
    # The attempt is in status; no worker was told to start it.
    st = stack.status("once")
    assert st.get("attempts") == 1 and stack.condition("once", "Running").get("status") == "True", st
    assert stack.bus.redis.llen(assign_key(stack.bus.ns, WORKER)) == 0

    stack.start_operator()
    a = wait_for("the re-run's assignment", lambda: stack.bus.pop_assignment(WORKER, timeout=0.5), 90)
    assert a.attempt == 2 and stack.bus.cancelled(a.job, 1), stack.log()[-3000:]
    stack.bus.post(
        Event(
            type="succeeded",
            job=a.job,
            attempt=2,
            rank=0,
            worker=WORKER,
            proof=a.proof,
            iterations=20,
            artifact=a.artifact_dir,
        )
    )
    wait_for("Succeeded", lambda: stack.condition("once", "Succeeded").get("status") == "True", 30)
    time.sleep(1.0)
    assert stack.status("once")["attempts"] == 2
    assert stack.bus.redis.llen(assign_key(stack.bus.ns, WORKER)) == 0  # nothing else was dispatched
    assert "Traceback" not in stack.log()
