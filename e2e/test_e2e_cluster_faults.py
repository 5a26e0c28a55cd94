"""Issue 23's pod-world scenarios on a real cluster (kind, e2e/setup-kind.sh): durable artifacts read
from another pod, a worker pod and the operator pod killed mid-job, and a pool whose image cannot start.
The same cases run on every CI build in tests/cluster/ (the pod world); here the real apiserver, kubelet,
Deployment and ReplicaSet controllers and CSI volumes decide. Skipped unless ELASTUNE_E2E_KUBECONFIG is
set."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
from test_e2e import (
    JOB_TIMEOUT_S,
    KUBECONFIG,
    LABEL_WARM_POOL,
    NAMESPACE,
    apply,
    condition,
    cpu_warm_pool,
    get_json,
    kubectl,
    manifest,
    wait_for,
)

pytestmark = pytest.mark.skipif(
    not KUBECONFIG, reason="set ELASTUNE_E2E_KUBECONFIG to a cluster prepared by e2e/setup-kind.sh"
)
CLAIM = "elastune-artifacts"  # the chart creates it (setup-kind.sh: storage.namespaces, ReadWriteOnce)


def job_doc(name: str, iterations: int) -> dict[str, Any]:
    job = copy.deepcopy(manifest("tuningjob.yaml"))
    job["metadata"]["name"] = name
    job["spec"]["termination"]["maxIterations"] = iterations
    job["spec"].pop("output", None)  # default artifact: the pool's jobStorage claim
    return job


def job_state(name: str) -> dict[str, Any]:
    return get_json("tuningjob", name, "-n", NAMESPACE) or {}


def finished(name: str) -> dict[str, Any] | None:
    obj = job_state(name)
    for kind in ("Succeeded", "Failed"):
        c = condition(obj, kind)
        if c and c["status"] == "True":
            return obj
    return None


def pool_pods(pool: str) -> list[dict[str, Any]]:
    return (get_json("pods", "-n", NAMESPACE, "-l", f"{LABEL_WARM_POOL}={pool}") or {}).get("items", [])


def cleanup(*objects: tuple[str, str]) -> None:
    for kind, name in objects:
        kubectl("delete", kind, name, "-n", NAMESPACE, "--ignore-not-found", "--timeout=180s", check=False)


def test_the_artifact_outlives_its_pod_and_a_worker_killed_mid_job_resumes_from_its_checkpoint() -> None:
    pool, job = cpu_warm_pool(), job_doc("e2e-resume", 200)
    try:
        apply(pool)
        apply(job)
        wait_for("the job to reach iteration 20",
                 lambda: (job_state("e2e-resume").get("status", {}).get("iterations", 0) >= 20) or None,
                 JOB_TIMEOUT_S)  # fmt: skip
        running = [p for p in pool_pods(pool["metadata"]["name"]) if p["status"].get("phase") == "Running"]
        kubectl(
            "delete", "pod", running[0]["metadata"]["name"], "-n", NAMESPACE, "--grace-period=0", "--force"
        )
        done = wait_for("the job to finish", lambda: finished("e2e-resume"), JOB_TIMEOUT_S)
        assert condition(done, "Succeeded")["status"] == "True", json.dumps(done["status"])
        assert done["status"]["iterations"] == 200
        assert "resuming at iteration" in json.dumps(done["status"]), done["status"]
        uri = done["status"]["artifactURI"]
        assert uri.startswith(f"pvc://{CLAIM}/"), uri
        # A pod that never ran the job reads the artifact from the claim.
        reader = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "e2e-reader", "namespace": NAMESPACE},
            "spec": {"restartPolicy": "Never", "containers": [{
                "name": "reader", "image": "busybox:1.36",
                "command": ["cat", f"/data/{uri.removeprefix(f'pvc://{CLAIM}/')}/adapter_config.json"],
                "volumeMounts": [{"name": "d", "mountPath": "/data"}]}],
                "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": CLAIM}}]},
        }  # fmt: skip
        apply(reader)
        wait_for("the reader pod", lambda: (get_json("pod", "e2e-reader", "-n", NAMESPACE) or {})
                 .get("status", {}).get("phase") == "Succeeded" or None, 180)  # fmt: skip
        assert "PROMPT_TUNING" in kubectl("logs", "e2e-reader", "-n", NAMESPACE).stdout
    finally:
        cleanup(("pod", "e2e-reader"), ("tuningjob", "e2e-resume"), ("warmpool", pool["metadata"]["name"]))


def test_the_operator_pod_killed_mid_job_ends_it_succeeded_exactly_once() -> None:
    pool, job = cpu_warm_pool(), job_doc("e2e-operator-restart", 120)
    try:
        apply(pool)
        apply(job)
        wait_for("the job to run", lambda: (job_state("e2e-operator-restart").get("status", {})
                                            .get("iterations", 0) >= 5) or None, JOB_TIMEOUT_S)  # fmt: skip
        kubectl("delete", "pod", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator")
        done = wait_for("the job to finish", lambda: finished("e2e-operator-restart"), JOB_TIMEOUT_S)
        assert condition(done, "Succeeded")["status"] == "True", json.dumps(done["status"])
        events = kubectl("get", "events", "-n", NAMESPACE, "--field-selector",
                         "involvedObject.name=e2e-operator-restart", "-o", "json").stdout  # fmt: skip
        succeeded = [e for e in json.loads(events)["items"] if e.get("reason") == "Succeeded"]
        assert len(succeeded) <= 1, succeeded
    finally:
        cleanup(("tuningjob", "e2e-operator-restart"), ("warmpool", pool["metadata"]["name"]))


def test_a_pool_whose_image_cannot_start_fails_its_job_with_the_pods_reason() -> None:
    pool, job = cpu_warm_pool(), job_doc("e2e-bad-image", 10)
    pool["spec"]["worker"]["image"] = "ghcr.io/elastune/no-such-image:0"
    try:
        apply(pool)
        apply(job)
        done = wait_for("the job to fail", lambda: finished("e2e-bad-image"), 600)
        failed = condition(done, "Failed")
        assert failed and failed["status"] == "True", json.dumps(done["status"])
        assert failed["reason"] in ("ImagePullBackOff", "InvalidImageName"), failed
        time.sleep(1)
        operator = get_json("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator") or {}
        assert all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in operator["items"])
    finally:
        cleanup(("tuningjob", "e2e-bad-image"), ("warmpool", pool["metadata"]["name"]))
