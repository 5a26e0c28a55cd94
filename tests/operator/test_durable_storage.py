"""Nothing a user needs lives in a pod's filesystem (docs/design.md §6, issue 23): on the Kubernetes backend
a TuningJob's checkpoints and artifact go to a claim every pod of its WarmPool mounts, the status
publishes the pvc:// URI a reader can use, and a job whose output could only land in a pod's ephemeral
storage is refused with a reason.

The operator's runtime (the control core and the workload backend) runs in this process against the
Kubernetes API emulator over HTTP and a real Redis; the test plays the worker side of the protocol, so no
torch is needed. What a worker pod does with the assignment (writing where the adapter loader reads) is
in tests/worker/test_pvc_artifacts.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from elastune_contract.api.constants import GROUP, VERSION
from elastune_contract.api.resources import parse_resource
from elastune_contract.protocol import Event
from elastune_contract.vocabulary import Reason
from operator_site import MODEL, NS, OperatorSite, wait_for


@pytest.fixture
def operator(tmp_path: Path, redis_server: Any) -> Iterator[OperatorSite]:
    site = OperatorSite(tmp_path, redis_server.url, "durable")
    try:
        yield site
    finally:
        site.close()


def test_a_job_whose_output_could_only_land_in_a_pod_is_refused_with_the_reason(
    operator: OperatorSite,
) -> None:
    operator.pool("tiny", volumes=[{"claimName": "adapters", "readOnly": True}, {"claimName": "out"}])
    operator.job("no-output")  # the default artifact would go to the pods' /tmp
    operator.job("pod-path", output={"uri": "/tmp/prompts/x"})
    operator.job("file-pod-path", output={"uri": "file:///var/prompts/x"})
    operator.job("unmounted-claim", output={"uri": "pvc://elsewhere/prompts/x"})
    operator.job("on-the-claim", output={"uri": "pvc://out/prompts/x"})
    operator.job("on-the-mount", output={"uri": "/mnt/pvc/out/prompts/y"})

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
    operator: OperatorSite,
) -> None:
    volumes = [{"claimName": "adapters", "readOnly": True}, {"claimName": "shared", "jobStorage": True}]
    operator.pool("tiny", volumes=volumes)
    job = operator.job("tuned")
    uid = wait_for("the job in the core", lambda: operator.runtime.core.jobs.get(f"{NS}/tuned")).uid
    wait_for("the pool to grow", lambda: operator.runtime.backend.pools[f"{NS}/tiny"][1] >= 1)
    wid = operator.ready_worker("tiny-pod-1", "tiny")
    a = wait_for("an assignment", lambda: operator.bus.pop_assignment(wid, timeout=0.2))
    # Under the claim every pod of the pool mounts, not under the pod's own /tmp (ELASTUNE_WORK_DIR).
    assert a.checkpoint_dir == f"pvc://shared/elastune/checkpoints/{NS}/tuned/{uid}"
    assert a.artifact_dir == f"pvc://shared/elastune/artifacts/{NS}/tuned"
    operator.bus.post(
        Event(
            type="succeeded", job=a.job, attempt=a.attempt, rank=0, worker="tiny-pod-1", proof=a.proof,
            iterations=20,
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
