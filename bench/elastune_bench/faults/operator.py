"""The operator killed between its status write and its dispatch (ELASTUNE_FAILPOINT=dispatch-after-status):
restarted, it runs the job once more and the job ends Succeeded exactly once."""

from __future__ import annotations

import importlib
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from elastune_common.bus import Bus
from elastune_contract.api.constants import LABEL_WARM_POOL
from elastune_contract.protocol import Event, WorkerRecord, WorkerState, assign_key

from .stack import CLI, Outcome, Plan, RedisProcess, wait_until


def exp_operator_killed(root: Path, plan: Plan) -> Outcome:
    """The real `elastune operator` (kopf) against the Kubernetes API emulator (development extras), a
    real Redis, the worker played by the bench: ELASTUNE_FAILPOINT=dispatch-after-status ends the operator
    after the attempt's status write and before its dispatch; restarted, it runs the job once more and the
    job ends Succeeded exactly once."""
    try:
        emulator_mod = importlib.import_module("elastune_testing.emulator")
        k8s = importlib.import_module("kubernetes")
    except ImportError as exc:
        return Outcome(False, f"not run: needs the development extras ({exc}): pip install -e '.[dev]'")
    redis = RedisProcess(root / "op-redis")
    redis.start()
    emulator = emulator_mod.start_emulator(root / "emulator")
    bus = Bus(redis.url, f"chaos{time.time_ns()}")
    procs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    pod_name, pod_ip = "tiny-pod-1", "10.9.0.1"
    wid = f"default/{pod_name}"  # as a pod's worker registers: the operator counts only a pod it lists
    try:
        api = k8s.config.new_client_from_config(config_file=str(emulator.kubeconfig_path))
        custom = k8s.client.CustomObjectsApi(api)
        # The cold pool the operator counts: one emulated node with 2 GPUs (k8s.node_capacity).
        importlib.import_module("elastune_testing.nodes").add_gpu_node(api, "gpu-node-0", 2)
        grp, ver = "elastune.dev", "v1alpha1"

        def create(plural: str, kind: str, name: str, spec: dict[str, Any]) -> None:
            obj = {"apiVersion": f"{grp}/{ver}", "kind": kind, "metadata": {"name": name}, "spec": spec}
            custom.create_namespaced_custom_object(grp, ver, "default", plural, obj)

        def status() -> dict[str, Any]:
            obj = custom.get_namespaced_custom_object(grp, ver, "default", "tuningjobs", "once")
            return dict(obj.get("status") or {})

        def cond(ctype: str) -> str:
            return next((c["status"] for c in status().get("conditions", []) if c["type"] == ctype), "")

        def operator(failpoint: str | None) -> subprocess.Popen[bytes]:
            env = {**os.environ, "KUBECONFIG": str(emulator.kubeconfig_path), "ELASTUNE_REDIS_URL": redis.url,
                   "ELASTUNE_REDIS_SECRET": "", "ELASTUNE_NAMESPACE": bus.ns,
                   "ELASTUNE_WORK_DIR": str(root / "op-work"), "ELASTUNE_METRICS_PORT": "0",
                   "ELASTUNE_PROOF_KEY": f"proof-{bus.ns}"}  # fmt: skip
            env.pop("ELASTUNE_FAILPOINT", None)
            if failpoint:
                env["ELASTUNE_FAILPOINT"] = failpoint
            cmd = [*CLI, "operator", "--standalone", "--all-namespaces"]
            with (root / f"operator-{len(procs) + 1}.log").open("wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            return procs[-1]

        # The pool's pod (what its Deployment and the kubelet make) and its worker's record at the pod's
        # address, READY, refreshed as its heartbeat would (beat).
        labels = {LABEL_WARM_POOL: "tiny"}
        container = {"name": "worker", "image": "ghcr.io/elastune/worker:0.1.0"}
        pod = {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": [container]},
               "metadata": {"name": pod_name, "namespace": "default", "labels": labels}}  # fmt: skip
        core = k8s.client.CoreV1Api(api)
        core.create_namespaced_pod("default", pod)
        running = {"status": {"phase": "Running", "podIP": pod_ip}}
        core.patch_namespaced_pod_status(pod_name, "default", running)

        def beat() -> None:
            started = time.time()
            while not stop.is_set():
                rec = WorkerRecord(id=wid, pool="tiny", model="test/model", state=WorkerState.READY,
                                   started_at=started - 3, ready_at=started,
                                   url=f"http://{pod_ip}:8080")  # fmt: skip
                bus.publish_worker(rec)
                stop.wait(1.0)

        pool = {
            "model": "test/model",
            "maxWarmGPUs": 1,
            "volumes": [{"claimName": "shared", "jobStorage": True}],
        }
        create("warmpools", "WarmPool", "tiny", pool)
        create("tuningjobs", "TuningJob", "once", {
            "model": "test/model", "dataset": "/data/train.jsonl", "termination": {"maxIterations": 20},
            "deadline": "10m", "promptBank": "never"})  # fmt: skip
        first = operator("dispatch-after-status")
        threading.Thread(target=beat, daemon=True).start()
        if not wait_until(lambda: first.poll() is not None, 90):
            return Outcome(False, "the operator never reached the failpoint dispatch-after-status")
        st1 = status()
        pushed = bus.redis.llen(assign_key(bus.ns, wid))
        operator(None)
        assigns = []
        a = wait_until(lambda: bus.pop_assignment(wid, timeout=0.5), 120)
        if a is None:
            return Outcome(
                False, f"exit {first.returncode} at the failpoint; the restarted operator never dispatched"
            )
        assigns.append(a)
        bus.post(Event(type="started", job=a.job, attempt=a.attempt, rank=0, worker=wid, proof=a.proof))
        bus.post(Event(type="succeeded", job=a.job, attempt=a.attempt, rank=0, worker=wid, proof=a.proof,
                       iterations=20,
                       artifact=a.artifact_dir))  # fmt: skip
        done = wait_until(lambda: cond("Succeeded") == "True", 60)
        time.sleep(3)
        extra = bus.pop_assignment(wid, timeout=0.5)
        st = status()
        detail = (f"operator exited {first.returncode} at the failpoint with attempts={st1.get('attempts')}"
                  f" in status and {pushed} assignment(s) pushed; restarted: attempt {a.attempt} dispatched"
                  f" (attempt 1 cancelled: {bus.cancelled(a.job, 1)}), job Succeeded={bool(done)}, "
                  f"attempts {st.get('attempts')}, further dispatch after success: {extra is not None} "
                  f"(worker played by the bench)")  # fmt: skip
        held = first.returncode == 86 and pushed == 0 and bool(done) and extra is None
        return Outcome(held, detail)
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
        bus.close()
        emulator.stop()
        redis.stop()
