"""Worker pods that cannot start or stay up fail their attempt with the pod's reason (issue 23 item 3).

Against the Kubernetes API emulator over HTTP: the test plays the kubelet and the ReplicaSet controller
(it writes the pool's pods and their status), the real WorkloadBackend lists them, and in the core-level
tests the real ControlCore (with a real Redis) fails or retries the TuningJob with the reason the pod's
status gives.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")

import kmock
from kubernetes import client, config

from elastune_common.bus import Bus
from elastune_contract.api.constants import LABEL_WARM_POOL
from elastune_contract.api.resources import parse_resource
from elastune_contract.protocol import Event, WorkerRecord, WorkerState
from elastune_contract.vocabulary import Reason
from elastune_operator.control.core import ControlCore
from elastune_operator.control.records import CoreSettings, JobRecord, PoolConfig
from elastune_operator.k8s.workload import (
    COST_REMOVE,
    DELETION_COST,
    WorkloadBackend,
)
from elastune_testing.emulator import EmulatorHandle
from elastune_testing.fixtures import k8s_emulator  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
NS, POOL, MODEL = "team-a", "tiny-gpt2", "elastune/tiny-gpt2"
KEY = f"{NS}/{POOL}"  # how the core names the pool to the backend (protocol.pool_id)


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def kube(k8s_emulator: EmulatorHandle) -> client.ApiClient:  # noqa: F811
    return config.new_client_from_config(config_file=str(k8s_emulator.kubeconfig_path))


def warm_pool(namespace: str = NS, model: str = MODEL) -> Any:
    doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    doc["metadata"].update(namespace=namespace, uid=f"u-{namespace}")
    doc["spec"]["model"] = model
    return parse_resource(doc)


def cstatus(state: dict[str, Any], restarts: int = 0, last: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": "worker",
        "image": "ghcr.io/elastune/worker:0.1.0",
        "imageID": "",
        "ready": False,
        "restartCount": restarts,
        "state": state,
        "lastState": {"terminated": last} if last else {},
    }


IMAGE_PULL = {
    "phase": "Pending",
    "containerStatuses": [
        cstatus(
            {
                "waiting": {
                    "reason": "ImagePullBackOff",
                    "message": 'Back-off pulling image "ghcr.io/elastune/worker:0.1.0"',
                }
            }
        )
    ],
}
CRASH_LOOP = {
    "phase": "Running",
    "containerStatuses": [
        cstatus(
            {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": "back-off 20s restarting failed container",
                }
            },
            restarts=2,
            last={"exitCode": 1, "reason": "Error"},
        )
    ],
}
OOM = {
    "phase": "Running",
    "containerStatuses": [
        cstatus({"running": {}}, restarts=1, last={"exitCode": 137, "reason": "OOMKilled"}),
    ],
}
RUNNING = {"phase": "Running", "containerStatuses": [cstatus({"running": {}})]}


def unschedulable(since: float) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
    return {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
                "lastTransitionTime": stamp,
            }
        ],
    }


def put_pod(
    api: client.ApiClient, name: str, status: dict[str, Any], *, pool: str = POOL, **meta: Any
) -> None:
    """What the ReplicaSet controller and the kubelet would write: a pod of the pool, then its status."""
    core = client.CoreV1Api(api)
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL_WARM_POOL: pool}, **meta},
        "spec": {"containers": [{"name": "worker", "image": "ghcr.io/elastune/worker:0.1.0"}]},
    }
    core.create_namespaced_pod(NS, body)
    core.patch_namespaced_pod_status(name, NS, {"status": status})


def replicas(api: client.ApiClient, namespace: str = NS) -> str:
    dep = client.AppsV1Api(api).read_namespaced_deployment(POOL, namespace)
    return str(dep.spec.replicas)


def test_exited_reports_each_failing_pod_once_with_its_reason(
    kube: client.ApiClient,
    k8s_emulator: EmulatorHandle,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    backend = WorkloadBackend(kube, "redis://r:6379/0", clock=clock)
    backend.register(warm_pool(), 4)
    put_pod(kube, "tiny-gpt2-00001-deployment-ok", RUNNING)
    put_pod(kube, "tiny-gpt2-00001-deployment-pull", IMAGE_PULL)
    put_pod(kube, "tiny-gpt2-00001-deployment-crash", CRASH_LOOP)
    put_pod(kube, "tiny-gpt2-00001-deployment-oom", OOM)
    put_pod(kube, "tiny-gpt2-00001-deployment-wait", unschedulable(clock.t - 20))
    put_pod(kube, "other-pool-pod", IMAGE_PULL, pool="someone-elses")
    # A pod Knative is removing (scale-down) is not a failure, whatever its status says.
    put_pod(kube, "tiny-gpt2-00001-deployment-going", IMAGE_PULL, finalizers=["test.elastune.dev/hold"])
    client.CoreV1Api(kube).delete_namespaced_pod("tiny-gpt2-00001-deployment-going", NS)

    got = backend.exited()
    assert {w: e.reason for w, e in got.items()} == {
        f"{NS}/tiny-gpt2-00001-deployment-pull": Reason.IMAGE_PULL_BACK_OFF,
        f"{NS}/tiny-gpt2-00001-deployment-crash": Reason.CRASH_LOOP_BACK_OFF,
        f"{NS}/tiny-gpt2-00001-deployment-oom": Reason.OOM_KILLED,
    }
    assert all(e.model == MODEL for e in got.values())
    assert got[f"{NS}/tiny-gpt2-00001-deployment-crash"].detail == (
        "pod tiny-gpt2-00001-deployment-crash: CrashLoopBackOff (container worker, exit code 1, "
        "last termination Error, 2 restarts): back-off 20s restarting failed container"
    )
    assert got[f"{NS}/tiny-gpt2-00001-deployment-pull"].detail.startswith(
        "pod tiny-gpt2-00001-deployment-pull: ImagePullBackOff (container worker, image ghcr.io/"
    )

    # Rate-limited: asked every 50 ms round, it lists at most every 2 s; then each pod is told once.
    clock.t += 1
    assert backend.exited() == {}
    clock.t += 1
    assert backend.exited() == {}
    # The unschedulable pod after its 60 s grace (the cluster autoscaler added no node meanwhile).
    clock.t += 40
    late = backend.exited()
    assert list(late) == [f"{NS}/tiny-gpt2-00001-deployment-wait"]  # the id its worker registers under
    assert late[f"{NS}/tiny-gpt2-00001-deployment-wait"].reason == Reason.UNSCHEDULABLE
    assert "Insufficient nvidia.com/gpu" in late[f"{NS}/tiny-gpt2-00001-deployment-wait"].detail

    # The core releases a failed pod: replicas drop and the ReplicaSet removes that pod first.
    backend.shrink(KEY, [f"{NS}/tiny-gpt2-00001-deployment-pull"])
    assert replicas(kube) == "3"
    pod = client.CoreV1Api(kube).read_namespaced_pod("tiny-gpt2-00001-deployment-pull", NS)
    assert pod.metadata.annotations[DELETION_COST] == COST_REMOVE
    # A job still waiting grows the pool back at once: replicas stay down until the failed pod is
    # gone (else the ReplicaSet, at an unchanged size, would keep it and the job would wait forever) ...
    backend.grow(KEY, MODEL, 1)
    assert replicas(kube) == "3"
    clock.t += 2
    assert backend.exited() == {}
    assert replicas(kube) == "3"
    # ... and follows the pool again once the ReplicaSet removed it.
    client.CoreV1Api(kube).delete_namespaced_pod("tiny-gpt2-00001-deployment-pull", NS)
    clock.t += 2
    assert backend.exited() == {}
    assert replicas(kube) == "4"

    # An API error is logged and the round goes on; the next listing works again.
    k8s_emulator.call(lambda emu: emu[kmock.resource("", "v1", "pods")] << 500)
    clock.t += 2
    with caplog.at_level(logging.WARNING, logger="elastune.workload"):
        assert backend.exited() == {}
    assert "cannot list the worker pods of namespace team-a" in caplog.text


def test_two_namespaces_warm_pools_of_one_name_each_keep_their_own_service(kube: client.ApiClient) -> None:
    """Issue 25 item 1: WarmPools are namespace/name. Two namespaces' pools named alike (other models)
    are two pools of the backend: growing one scales its own Deployment only, and each vouches for
    its own namespace's pods."""
    backend = WorkloadBackend(kube, "redis://r:6379/0", clock=Clock())
    backend.register(warm_pool(), 0)
    backend.register(warm_pool("team-b", "elastune/other"), 0)
    assert set(backend.pools) == {KEY, f"team-b/{POOL}"}
    backend.grow(KEY, MODEL, 2)
    backend.grow(f"team-b/{POOL}", "elastune/other", 1)
    assert (replicas(kube), replicas(kube, "team-b")) == ("2", "1")
    dep_b = client.AppsV1Api(kube).read_namespaced_deployment(POOL, "team-b")
    env = {e.name: e.value for e in dep_b.spec.template.spec.containers[0].env}
    assert env["ELASTUNE_MODEL"] == "elastune/other"
    backend.shrink(KEY, [])
    assert (replicas(kube), replicas(kube, "team-b")) == ("2", "1")
    backend.unregister(KEY)
    assert set(backend.pools) == {f"team-b/{POOL}"}
    assert set(backend.vouched()) == {f"team-b/{POOL}"}


# -- the control core with the real backend -----------------------------------------------------------


def job(name: str) -> JobRecord:
    res = parse_resource(
        {
            "apiVersion": "elastune.dev/v1alpha1",
            "kind": "TuningJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "model": MODEL,
                "dataset": "/d.jsonl",
                "termination": {"maxIterations": 50},
                "deadline": "10m",
            },
        }
    )
    return JobRecord(f"{NS}/{name}", res.spec, time.time(), "/d.jsonl", f"/out/{name}", generation=1)


def cond(rec: JobRecord, ctype: str) -> tuple[str, str, str]:
    c = next(c for c in rec.status.conditions if c.type == ctype)
    return c.status, c.reason, c.message


@pytest.fixture
def world(kube: client.ApiClient, redis_server: Any, tmp_path: Path) -> dict[str, Any]:
    clock = Clock()
    backend = WorkloadBackend(kube, redis_server.url, clock=clock)
    backend.register(warm_pool(), 0)
    bus = Bus(redis_server.url, namespace=f"podfail{time.time_ns()}")
    settings = CoreSettings(cold_capacity=4, channel_url=redis_server.url, work_dir=tmp_path, max_attempts=2)
    pool = PoolConfig(POOL, MODEL, max_warm=4, cold_start_seconds=5, seconds_per_iteration=0.1, namespace=NS)
    core = ControlCore(backend, bus, settings, [pool], clock=clock)
    return {"core": core, "bus": bus, "clock": clock, "kube": kube}


def rounds(world: dict[str, Any], seconds: float = 2.0) -> None:
    """Control rounds over ``seconds`` (at least one pod listing)."""
    world["clock"].t += seconds
    world["core"].tick()


def test_a_pool_whose_image_cannot_be_pulled_fails_its_job_with_that_reason(world: dict[str, Any]) -> None:
    core, kube = world["core"], world["kube"]
    rec = job("pull")
    core.submit(rec)
    core.tick()
    assert replicas(kube) == "1" and cond(rec, "Scheduled")[1] == Reason.POOL_GROWING
    put_pod(kube, "tiny-gpt2-00001-deployment-a1", IMAGE_PULL)  # Knative starts the pod; it cannot pull
    rounds(world)
    assert not rec.terminal  # one start failure of max_attempts 2: the pool tries another pod
    # The failed pod leaves the pool (-1) and a fresh one is asked for (+1): replicas stay down until
    # Knative removed the failed pod (at an unchanged size it would keep it, and the job wait forever).
    assert replicas(kube) == "0"
    client.CoreV1Api(kube).delete_namespaced_pod("tiny-gpt2-00001-deployment-a1", NS)
    rounds(world)
    assert replicas(kube) == "1" and not rec.terminal
    put_pod(kube, "tiny-gpt2-00001-deployment-a2", IMAGE_PULL)
    rounds(world)
    status, reason, message = cond(rec, "Succeeded")
    assert (status, reason) == ("False", Reason.IMAGE_PULL_BACK_OFF)
    assert "pod tiny-gpt2-00001-deployment-a2: ImagePullBackOff" in message
    assert 'Back-off pulling image "ghcr.io/elastune/worker:0.1.0"' in message
    assert replicas(kube) == "0"  # no pod is left holding a GPU node for the failed job


def test_a_bound_worker_whose_pod_crash_loops_is_lost_and_retried_then_fails(world: dict[str, Any]) -> None:
    core, bus, clock, kube = world["core"], world["bus"], world["clock"], world["kube"]
    rec = job("crash")
    core.submit(rec)
    core.tick()

    def warm(pod: str) -> Any:
        ip = f"10.1.0.{len(pod)}"  # the pod's IP, which its worker registers (the control plane vouches)
        put_pod(kube, pod, {**RUNNING, "podIP": ip})
        rounds(world)  # a pod listing: the backend vouches for the pod's id and address
        bus.publish_worker(
            WorkerRecord(
                id=f"{NS}/{pod}",  # as the pod's worker registers (POD_NAMESPACE/POD_NAME)
                pool=POOL,
                model=MODEL,
                state=WorkerState.READY,
                url=f"http://{ip}:8080",
                started_at=clock.t - 3,
                ready_at=clock.t,
            )
        )
        rounds(world, 0.05)
        a = bus.pop_assignment(f"{NS}/{pod}", timeout=0.5)
        assert a is not None, f"no assignment for {pod}"
        return a

    a = warm("tiny-gpt2-00001-deployment-b1")
    bus.post(
        Event(
            type="progress", job=a.job, attempt=1, rank=0, worker="w", proof=a.proof, iterations=20,
            checkpointed=20,
        )
    )  # fmt: skip
    rounds(world, 0.05)
    # The worker's container crashes and restarts (its registry record may well outlive it).
    client.CoreV1Api(kube).patch_namespaced_pod_status(
        "tiny-gpt2-00001-deployment-b1", NS, {"status": CRASH_LOOP}
    )
    rounds(world)
    status, reason, message = cond(rec, "Running")
    assert (status, reason) == ("False", Reason.CRASH_LOOP_BACK_OFF)
    assert "pod tiny-gpt2-00001-deployment-b1: CrashLoopBackOff" in message and "iteration 20" in message
    assert bus.cancelled(rec.key, 1) and core.state.jobs[rec.key].done_iterations == 20

    b = warm("tiny-gpt2-00001-deployment-b2")  # the retry, from the checkpoint, on a fresh pod
    assert b.attempt == 2
    client.CoreV1Api(kube).patch_namespaced_pod_status("tiny-gpt2-00001-deployment-b2", NS, {"status": OOM})
    rounds(world)
    status, reason, message = cond(rec, "Succeeded")
    assert (status, reason) == ("False", Reason.OOM_KILLED)  # max_attempts 2
    assert "pod tiny-gpt2-00001-deployment-b2: OOMKilled" in message
