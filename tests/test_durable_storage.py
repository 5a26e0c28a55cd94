"""Nothing a user needs lives in a pod's filesystem (DESIGN.md §6, issue 23): on the Kubernetes backend
a TuningJob's checkpoints and artifact go to a claim every pod of its WarmPool mounts, the status
publishes the pvc:// URI a reader can use, and a job whose output could only land in a pod's ephemeral
storage is refused with a reason.

The operator's runtime (the control core and the Knative backend) runs in this process against the
Kubernetes API emulator over HTTP and a real Redis; the test plays the worker side of the protocol, so no
torch is needed. What a worker pod does with the assignment (writing where the adapter loader reads) is
in tests/worker/test_pvc_artifacts.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from elastune_contract.api.constants import GROUP, PLURAL_TUNING_JOBS, PLURAL_WARM_POOLS, VERSION
from elastune_contract.api.resources import parse_resource
from elastune_contract.protocol import Bus, Event, WorkerRecord, WorkerState
from elastune_contract.vocabulary import Reason
from elastune_operator.k8s.runtime import Runtime
from elastune_operator.k8s.settings import OperatorSettings
from elastune_testing.emulator import start_emulator

NS = "default"
MODEL = "test/model"


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Operator:
    """Runtime (core thread + Knative backend) on the emulator; the test creates objects and hands them
    to it as kopf's handlers would."""

    def __init__(self, tmp: Path, redis_url: str, model: str = MODEL) -> None:
        self.model = model
        self.emulator = start_emulator(tmp / "emulator")
        api = config.new_client_from_config(config_file=str(self.emulator.kubeconfig_path))
        self.custom = client.CustomObjectsApi(api)
        self.bus = Bus(redis_url, f"durable{time.time_ns()}")
        settings = OperatorSettings(
            redis_url=redis_url,
            redis_secret=None,
            work_dir=tmp / "pod-tmp",  # the pods' /tmp: what must never hold a user's artifact
            metrics_port=0,
            namespace=self.bus.ns,
            cold_pool_gpus=2,
        )
        self.runtime = Runtime(settings, api, bus=self.bus)
        self.runtime.start()

    def close(self) -> None:
        self.runtime.stop()
        self.emulator.stop()

    def pool(self, name: str, volumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "WarmPool",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": self.model, "maxWarmGPUs": 2, **({"volumes": volumes} if volumes else {})},
        }
        created = self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, body)
        self.runtime.upsert_pool(created)
        return created

    def job(self, name: str, output: str | None = None, **extra: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "model": self.model,
            "dataset": "/data/train.jsonl",
            "termination": {"maxIterations": 20},
            "deadline": "10m",
            "promptBank": "never",
            **extra,
        }
        if output:
            spec["output"] = {"uri": output}
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TuningJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": spec,
        }
        created = self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_TUNING_JOBS, body)
        self.runtime.submit_job(created)
        return created

    def conditions(self, name: str) -> dict[str, dict[str, Any]]:
        try:
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_TUNING_JOBS, name)
        except ApiException:
            return {}
        return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}

    def status(self, name: str) -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_TUNING_JOBS, name)
        return obj.get("status") or {}

    def worker(self, wid: str, pool: str) -> None:
        now = time.time()
        self.bus.publish_worker(
            WorkerRecord(
                id=wid, pool=pool, model=self.model, state=WorkerState.READY, started_at=now - 3,
                ready_at=now, heartbeat=now,
            )
        )  # fmt: skip


@pytest.fixture
def operator(tmp_path: Path, redis_server: Any) -> Iterator[Operator]:
    op = Operator(tmp_path, redis_server.url)
    try:
        yield op
    finally:
        op.close()


def test_a_job_whose_output_could_only_land_in_a_pod_is_refused_with_the_reason(operator: Operator) -> None:
    operator.pool("tiny", volumes=[{"claimName": "adapters", "readOnly": True}, {"claimName": "out"}])
    operator.job("no-output")  # the default artifact would go to the pods' /tmp
    operator.job("pod-path", output="/tmp/prompts/x")
    operator.job("file-pod-path", output="file:///var/prompts/x")
    operator.job("unmounted-claim", output="pvc://elsewhere/prompts/x")
    operator.job("on-the-claim", output="pvc://out/prompts/x")
    operator.job("on-the-mount", output="/mnt/pvc/out/prompts/y")

    for name in ("no-output", "pod-path", "file-pod-path", "unmounted-claim"):
        conds = wait_for(f"{name} refused", lambda n=name: operator.conditions(n).get("Failed"))
        assert conds["reason"] == Reason.OUTPUT_NOT_DURABLE, (name, conds)
        accepted = operator.conditions(name)["Accepted"]
        assert (accepted["status"], accepted["reason"]) == ("False", Reason.OUTPUT_NOT_DURABLE), name
        assert operator.conditions(name)["Succeeded"]["status"] == "False"
    assert "jobStorage" in operator.conditions("no-output")["Failed"]["message"]
    assert "ephemeral" in operator.conditions("unmounted-claim")["Failed"]["message"]
    # Outputs on a claim the pool mounts are accepted (and wait for GPUs).
    for name in ("on-the-claim", "on-the-mount"):
        accepted = wait_for(f"{name} accepted", lambda n=name: operator.conditions(n).get("Accepted"))
        assert (accepted["status"], accepted["reason"]) == ("True", Reason.VALIDATED), name
        assert "Failed" not in operator.conditions(name)


def test_checkpoints_and_default_artifacts_go_to_the_pools_durable_claim_and_succeeded_names_it(
    operator: Operator,
) -> None:
    volumes = [{"claimName": "adapters", "readOnly": True}, {"claimName": "shared", "jobStorage": True}]
    operator.pool("tiny", volumes=volumes)
    job = operator.job("tuned")
    uid = wait_for("the job in the core", lambda: operator.runtime.core.jobs.get(f"{NS}/tuned")).uid
    wait_for("the pool to grow", lambda: operator.runtime.backend.pools["tiny"][1] >= 1)
    operator.worker("tiny-pod-1", "tiny")
    a = wait_for("an assignment", lambda: operator.bus.pop_assignment("tiny-pod-1", timeout=0.2))
    # Under the claim every pod of the pool mounts, not under the pod's own /tmp (ELASTUNE_WORK_DIR).
    assert a.checkpoint_dir == f"pvc://shared/elastune/checkpoints/{NS}/tuned/{uid}"
    assert a.artifact_dir == f"pvc://shared/elastune/artifacts/{NS}/tuned"
    operator.bus.post(
        Event(
            type="succeeded", job=a.job, attempt=a.attempt, rank=0, worker="tiny-pod-1", iterations=20,
            checkpointed=20, artifact=a.artifact_dir,
        )
    )  # fmt: skip
    done = wait_for(
        "Succeeded", lambda: operator.conditions("tuned").get("Succeeded", {}).get("status") == "True"
    )
    assert done and operator.status("tuned")["artifactURI"] == "pvc://shared/elastune/artifacts/default/tuned"
    assert job["metadata"]["uid"]


def test_durable_storage_maps_pod_paths_on_a_mount_to_the_claim_and_keeps_checkpoints_on_it() -> None:
    """The pure rule: without a jobStorage volume, checkpoints go to the output's claim."""
    from elastune_operator.control.resources import OutputNotDurable, durable_storage

    pool = parse_resource(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "WarmPool",
            "metadata": {"name": "p", "namespace": "team"},
            "spec": {"model": MODEL, "volumes": [{"claimName": "out", "mountPath": "/models"}]},
        }
    )

    def job(uri: str | None) -> Any:
        spec: dict[str, Any] = {"model": MODEL, "dataset": "/d.jsonl", "termination": {"maxIterations": 5}}
        spec["deadline"] = "10m"
        if uri:
            spec["output"] = {"uri": uri}
        meta = {"name": "j", "namespace": "team"}
        return parse_resource(
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TuningJob", "metadata": meta, "spec": spec}
        )

    placed = durable_storage(job("file:///models/tuned/a"), pool)  # type: ignore[arg-type]
    assert placed.artifact == "pvc://out/tuned/a"
    assert placed.checkpoints == "pvc://out/elastune/checkpoints/team/j"
    assert durable_storage(job("/mnt/pvc/out/b"), pool).artifact == "pvc://out/b"  # type: ignore[arg-type]
    for uri in (None, "/mnt/pvc/outside/x", "/models/../etc/x"):
        with pytest.raises(OutputNotDurable):
            durable_storage(job(uri), pool)  # type: ignore[arg-type]
