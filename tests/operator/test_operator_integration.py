"""The real operator process (`elastune operator`, kopf) against the Kubernetes API emulator over HTTP,
with local worker processes standing in for the pool pods (WorkloadStandIn), a real redis-server, and
real tuning of the small test model.

Scenario (issue 5): apply a WarmPool and two TuningJobs with different deadlines → the Deployment
appears with replicas → the jobs run on real workers → status carries the optimized prompt → delete
→ the finalizer releases everything; idle workers go back to the cold pool without a busy one ever
being picked; bad jobs fail with reasons without disturbing the others; killing the operator mid-job
and starting it again finishes the job exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kmock")

from kubernetes import client, config  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

from elastune_common.bus import Bus  # noqa: E402
from elastune_common.servers import free_port  # noqa: E402
from elastune_contract.api.constants import GROUP, PVC_ROOT_ENV, VERSION  # noqa: E402
from elastune_demo import build as tiny_build  # noqa: E402
from elastune_demo import tasks as tiny_tasks  # noqa: E402
from elastune_operator.local.backend import LocalBackend  # noqa: E402
from elastune_testing.emulator import start_emulator  # noqa: E402
from elastune_testing.nodes import add_gpu_node, remove_node  # noqa: E402
from elastune_testing.workload_standin import WorkloadStandIn  # noqa: E402
from tiny_test_model import TASK, TEST_SPEC  # noqa: E402 - the small model and task of the worker tests

NS = "default"


def wait_for(what: str, check: Callable[[], Any], timeout: float = 120.0, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Cluster:
    def __init__(self, tmp: Path, redis_url: str, gpus: int = 2) -> None:
        self.tmp = tmp
        self.redis_url = redis_url
        self.emulator = start_emulator(tmp / "emulator")
        self.api_client = config.new_client_from_config(config_file=str(self.emulator.kubeconfig_path))
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.namespace = f"it{time.time_ns()}"
        self.bus = Bus(redis_url, self.namespace)
        # The pool's claims (pvc://<claim>/...), shared by every "pod" as a ReadWriteMany volume would be.
        self.pvc_root = tmp / "pvc"
        self.backend = LocalBackend(
            tmp / "workers", redis_url, self.namespace, extra_env={PVC_ROOT_ENV: str(self.pvc_root)}
        )
        self.standin = WorkloadStandIn(self.api_client, self.bus, self.backend)
        self.standin.start()
        self.operator: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.starts = 0
        if gpus:  # the cold pool: the GPUs of the emulated nodes (k8s.node_capacity)
            add_gpu_node(self.api_client, "gpu-node-0", gpus)

    def start_operator(self) -> None:
        self.starts += 1
        self.metrics_port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.emulator.kubeconfig_path),
            "ELASTUNE_REDIS_URL": self.redis_url,
            "ELASTUNE_REDIS_SECRET": "",
            "ELASTUNE_NAMESPACE": self.namespace,
            "ELASTUNE_WORK_DIR": str(self.tmp / "work"),
            "ELASTUNE_METRICS_PORT": str(self.metrics_port),
            PVC_ROOT_ENV: str(self.pvc_root),  # the operator sees the claims too (artifact checks)
            # one proof key across restarts, as the chart's Secret gives: a restarted operator adopts
            "ELASTUNE_PROOF_KEY": f"proof-{self.namespace}",
            # No Job controller runs here: a deleted job's cleanup Job (spec.retention) never starts, and
            # the operator gives up after this many seconds (StorageLeft), as where its pod cannot run.
            "ELASTUNE_RECLAIM_TIMEOUT": "5",
        }
        log = (self.tmp / f"operator-{self.starts}.log").open("wb")
        cmd = [sys.executable, "-m", "elastune_cli", "operator", "--standalone", "--all-namespaces"]
        self.operator = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def operator_log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("operator-*.log")))

    def kill_operator(self) -> None:
        assert self.operator is not None
        self.operator.send_signal(signal.SIGKILL)
        self.operator.wait(10)

    def close(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(15)
            except subprocess.TimeoutExpired:
                self.operator.kill()
        self.standin.stop()
        self.backend.close()
        self.emulator.stop()

    # -- API helpers -------------------------------------------------------------------------------
    def create(self, plural: str, body: dict) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, plural, body)

    def get(self, plural: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def condition(self, name: str, ctype: str) -> dict | None:
        obj = self.get("tuningjobs", name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)

    def finished(self, name: str) -> dict | None:
        c = self.condition(name, "Succeeded")
        return c if c and c["status"] != "Unknown" else None

    def deployment(self, name: str) -> dict | None:
        """The WarmPool's Deployment as the API returns it (None until it exists)."""
        try:
            resp = client.AppsV1Api(self.api_client).read_namespaced_deployment(
                name, NS, _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        found: dict = json.loads(resp.data)
        return found

    def replicas(self, name: str) -> int | None:
        dep = self.deployment(name)
        return None if dep is None else int(dep["spec"]["replicas"])

    def metrics(self) -> str:
        return (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        )


@pytest.fixture(scope="module")
def small_model() -> Path:
    return tiny_build.ensure_tiny_model(spec=TEST_SPEC)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    task = tiny_tasks.make_task(TASK, n_train=40, n_eval=8, seed=1)
    return tiny_tasks.write_jsonl(
        list(task.train) + list(task.eval), tmp_path_factory.mktemp("data") / "d.jsonl"
    )


@pytest.fixture
def cluster(tmp_path: Path, redis_server: Any) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server.url)
    try:
        yield c
    finally:
        c.close()


def warm_pool(model: Path, idle: str = "60s") -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WarmPool",
        "metadata": {"name": "tiny", "namespace": NS},
        "spec": {
            "model": str(model),
            "maxWarmGPUs": 2,
            "idleWindow": idle,
            "profile": {"coldStartSeconds": 10, "secondsPerIteration": "0.2"},
            # Checkpoints and default artifacts on a claim every pod mounts, not in a pod's /tmp.
            "volumes": [{"claimName": "work", "jobStorage": True}],
        },
    }


def tuning_job(name: str, model: Path, dataset: str, deadline: str, iterations: int = 30) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TuningJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": str(model),
            "dataset": dataset,
            "initialPrompt": tiny_tasks.family_instructions(TASK.family)[0],
            "termination": {"maxIterations": iterations},
            "deadline": deadline,
            "hyperparameters": {"batchSize": 4, "virtualTokens": 4},
            "promptBank": "never",
        },
    }


def test_pool_and_jobs_run_on_workers_delete_releases_and_scale_down_spares_busy_workers(
    cluster: Cluster, small_model: Path, dataset: Path
) -> None:
    cluster.start_operator()
    cluster.create("warmpools", warm_pool(small_model, idle="6s"))
    cluster.create("tuningjobs", tuning_job("late", small_model, str(dataset), "5m"))
    cluster.create("tuningjobs", tuning_job("early", small_model, str(dataset), "3m"))
    cluster.create("tuningjobs", tuning_job("nodata", small_model, "/no/such/data.jsonl", "4m"))
    cluster.create("tuningjobs", tuning_job("nopool", Path("/other/model"), str(dataset), "4m"))

    wait_for("the Deployment with replicas >= 1", lambda: (cluster.replicas("tiny") or 0) >= 1, 60)
    svc = cluster.deployment("tiny")
    assert svc is not None and svc["metadata"]["ownerReferences"][0]["kind"] == "WarmPool"
    for name in ("late", "early", "nodata", "nopool"):
        wait_for(f"{name} to finish", lambda n=name: cluster.finished(n), 240)

    for name in ("late", "early"):
        job = cluster.get("tuningjobs", name)
        assert job is not None
        st = job["status"]
        assert cluster.condition(name, "Succeeded")["status"] == "True", (st, cluster.operator_log()[-3000:])
        assert st["iterations"] == 30 and st["optimizedPrompt"]
        assert st["artifactURI"] == f"pvc://work/elastune/artifacts/{NS}/{name}"
        assert (cluster.pvc_root / "work/elastune/artifacts" / NS / name / "adapter_config.json").is_file()
        types = {c["type"]: c for c in st["conditions"]}
        assert {"Accepted", "Scheduled", "Running", "Succeeded"} <= set(types)
        assert all(c["observedGeneration"] == 1 for c in st["conditions"])
        assert st["sloMet"] is True and "predictedCompletionTime" not in st
    assert cluster.condition("nodata", "Failed")["reason"] == "DatasetNotFound"
    assert cluster.condition("nopool", "Failed")["reason"] == "UnknownModel"
    assert 'elastune_tuningjobs_finished_total{model="' in cluster.metrics()

    # Pool status is written once a second: wait for the one carrying the jobs' measured iteration times.
    def pool_status() -> dict | None:
        st = (cluster.get("warmpools", "tiny") or {}).get("status") or {}
        return st if st.get("iterationSeconds") else None

    pool = wait_for("WarmPool status with measured iteration times", pool_status, 30)
    assert float(pool["coldStartSeconds"]) > 0 and all(
        float(v) > 0 for v in pool["iterationSeconds"].values()
    )

    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "tuningjobs", "late")
    wait_for("the deleted job to be gone", lambda: cluster.get("tuningjobs", "late") is None, 30)

    # Idle window 6 s: the pool shrinks back to zero; every removed pod was an idle worker.
    wait_for("replicas back to 0", lambda: cluster.replicas("tiny") == 0, 60)
    wait_for("pods removed", lambda: len(cluster.standin.removals) >= 1, 30)
    assert all(r.worker_state != "busy" for r in cluster.standin.removals), cluster.standin.removals
    assert "Traceback" not in cluster.operator_log()


def test_operator_killed_mid_job_restarts_and_the_job_finishes_exactly_once(
    cluster: Cluster, small_model: Path, dataset: Path
) -> None:
    cluster.start_operator()
    cluster.create("warmpools", warm_pool(small_model))
    cluster.create("tuningjobs", tuning_job("survivor", small_model, str(dataset), "5m", iterations=2000))

    def running() -> bool:
        st = (cluster.get("tuningjobs", "survivor") or {}).get("status") or {}
        return (st.get("iterations") or 0) >= 10

    wait_for("the job to be running", running, 180)
    cluster.kill_operator()
    time.sleep(1.0)
    cluster.start_operator()
    done = wait_for("the job to finish after the restart", lambda: cluster.finished("survivor"), 300)
    assert done["status"] == "True", cluster.operator_log()[-3000:]
    st = cluster.get("tuningjobs", "survivor")["status"]
    second = (cluster.tmp / "operator-2.log").read_text(errors="replace")
    assert st["iterations"] == 2000
    assert st["attempts"] == 1, "\n".join(ln for ln in second.splitlines() if "elastune" in ln)[-4000:]
    assert "adopted attempt 1 running on" in second, second[-4000:]
    results = [e for _, e in cluster.bus.events(f"{NS}/survivor") if e.type == "succeeded"]
    assert len(results) == 1


def test_the_cold_pool_is_the_gpus_of_the_nodes_there_are(
    tmp_path: Path, redis_server: Any, small_model: Path, dataset: Path
) -> None:
    """No GPU node: nothing is planned and the job waits; a node with one GPU joins: the pool grows onto
    it; the node leaves: no GPU beyond what remains is planned, and the running job's worker stays."""
    cluster = Cluster(tmp_path, redis_server.url, gpus=0)
    try:
        cluster.start_operator()
        cluster.create("warmpools", warm_pool(small_model))
        cluster.create("tuningjobs", tuning_job("first", small_model, str(dataset), "5m", iterations=2000))

        def running() -> bool:
            return (cluster.condition("first", "Running") or {}).get("status") == "True"

        def planned() -> int:  # the scheduler's warm pool: GPUs taken from the cold pool
            st = (cluster.get("warmpools", "tiny") or {}).get("status") or {}
            return int(st.get("warmGPUs") or 0) + int(st.get("startingGPUs") or 0)

        wait_for("the pool's status", lambda: (cluster.get("warmpools", "tiny") or {}).get("status"), 30)
        time.sleep(3.0)  # many scheduling rounds (50 ms each) with the job waiting
        assert planned() == 0 and not running(), cluster.operator_log()[-3000:]
        assert not cluster.core.list_namespaced_pod(NS).items, "a worker pod with no GPU node"

        add_gpu_node(cluster.api_client, "gpu-node-a", 1)
        wait_for("the job to run on the new node's GPU", running, 120)
        assert planned() == 1
        worker = cluster.core.list_namespaced_pod(NS).items
        assert len(worker) == 1

        remove_node(cluster.api_client, "gpu-node-a")
        time.sleep(1.0)  # the watch carries the deletion within a round or two
        # A job with a tight deadline wants more GPUs now; the cold pool has none left to give.
        cluster.create("tuningjobs", tuning_job("second", small_model, str(dataset), "90s", iterations=200))
        for _ in range(15):
            time.sleep(0.3)
            assert planned() <= 1, "planned GPUs on a node that left"
        pods = cluster.core.list_namespaced_pod(NS).items
        assert [p.metadata.uid for p in pods] == [p.metadata.uid for p in worker], "a running pod was touched"
        assert running()
        assert "Traceback" not in cluster.operator_log()
    finally:
        cluster.close()
