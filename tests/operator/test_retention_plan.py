"""What a deletion plans to remove (operator k8s/retention.py) and the owner markers that bound it
(worker storage/ownership.py): pure functions and a temporary directory, no operator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from elastune_contract.api.loraadapter import LoRAAdapter
from elastune_contract.api.tuningjob import TuningJob
from elastune_contract.api.warmpool import WarmPool
from elastune_operator.k8s import retention
from elastune_worker.storage import ownership

UID = "0b7c-uid"
POOL = WarmPool.model_validate(
    {
        "metadata": {"name": "pool", "namespace": "team-a"},
        "spec": {"model": "m", "volumes": [{"claimName": "jobs", "jobStorage": True}]},
    }
)


def job(**spec: Any) -> TuningJob:
    base = {"model": "m", "dataset": "d.jsonl", "termination": {"maxIterations": 5}, "deadline": "5m"}
    return TuningJob.model_validate(
        {"metadata": {"name": "tj", "namespace": "team-a", "uid": UID}, "spec": {**base, **spec}}
    )


def test_by_default_a_job_leaves_its_artifact_and_removes_its_checkpoints_and_staging_copy() -> None:
    plan = retention.tuning_job_plan(job(output={"uri": "s3://b/out/tj", "secretName": "creds"}), POOL)
    assert plan.targets == [
        "pvc://jobs/elastune/artifacts/team-a/tj",  # the staging copy of the s3:// output
        f"pvc://jobs/elastune/checkpoints/team-a/tj/{UID}",
    ]
    assert plan.owner_uid == UID and plan.secret == "creds"


def test_artifact_delete_adds_the_output_and_retain_everywhere_plans_nothing() -> None:
    s3 = retention.tuning_job_plan(
        job(output={"uri": "s3://b/out/tj"}, retention={"artifact": "Delete", "checkpoints": "Retain"}), POOL
    )
    assert s3.targets == ["s3://b/out/tj"]
    pvc = retention.tuning_job_plan(job(retention={"artifact": "Delete"}), POOL)
    assert "pvc://jobs/elastune/artifacts/team-a/tj" in pvc.targets
    kept = retention.tuning_job_plan(job(retention={"checkpoints": "Retain"}), POOL)
    assert kept.targets == []


def test_a_path_in_a_pod_is_no_target() -> None:
    # No jobStorage claim: checkpoints and staging were in the pod's /tmp and went with it.
    bare = WarmPool.model_validate({"metadata": {"name": "p", "namespace": "team-a"}, "spec": {"model": "m"}})
    plan = retention.tuning_job_plan(
        job(output={"uri": "s3://b/out/tj"}, retention={"artifact": "Delete"}), bare
    )
    assert plan.targets == ["s3://b/out/tj"]


def adapter(owner_kind: str | None, policy: str = "Delete") -> LoRAAdapter:
    meta: dict[str, Any] = {"name": "a", "namespace": "team-a", "uid": "adapter-uid"}
    if owner_kind:
        meta["ownerReferences"] = [
            {"apiVersion": "elastune.dev/v1alpha1", "kind": owner_kind, "name": "tj", "uid": UID}
        ]
    spec = {"baseModel": "m", "artifactURL": "s3://b/out/tj", "type": "promptTuning"}
    return LoRAAdapter.model_validate({"metadata": meta, "spec": {**spec, "retention": {"artifact": policy}}})


def test_an_adapter_deletes_only_an_artifact_its_publishing_job_wrote() -> None:
    published = retention.adapter_plan(adapter("TuningJob"), POOL)
    assert published.targets == ["s3://b/out/tj"] and published.owner_uid == UID
    assert retention.adapter_plan(adapter(None), POOL).targets == []  # a user's own artifact
    assert retention.adapter_plan(adapter("TuningJob", "Retain"), POOL).targets == []
    assert (
        LoRAAdapter.model_validate(
            {"metadata": {"name": "a"}, "spec": {"baseModel": "m", "artifactURL": "/a"}}
        ).spec.retention.artifact
        == "Retain"
    )


def test_the_cleanup_job_mounts_only_the_targets_claims_and_the_secret() -> None:
    plan = retention.tuning_job_plan(
        job(output={"uri": "s3://b/out/tj", "secretName": "creds"}, retention={"artifact": "Delete"}), POOL
    )
    manifest = retention.job_manifest(plan, "TuningJob", {"namespace": "team-a", "name": "tj", "uid": UID})
    kubernetes_validate.validate(manifest, "1.33.0", strict=True)
    pod = manifest["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "elastune_worker.storage.cleanup"]
    assert c["args"][:4] == ["--namespace", "team-a", "--owner-uid", UID]
    assert {"name": "claim-0", "mountPath": "/mnt/pvc/jobs"} in c["volumeMounts"]
    assert {"name": "s3-secret", "secret": {"secretName": "creds", "optional": True}} in pod["volumes"]
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == UID
    assert retention.Plan.recorded({retention.PLAN_ANNOTATION: plan.to_json()}) == plan


OWNER = ownership.Owner("team-a", "tj", UID)


def test_a_marker_is_written_beside_a_new_location_and_deletion_needs_it(tmp_path: Path) -> None:
    mine, similar = tmp_path / "tj", tmp_path / "tj-2"
    assert ownership.claim_local(mine, OWNER)
    mine.mkdir()
    (mine / "adapter_config.json").write_text("{}")
    similar.mkdir()
    (similar / "adapter_config.json").write_text("{}")
    assert ownership.delete_local(similar, "team-a", UID) == "not-owned"  # no marker of its own
    assert ownership.delete_local(mine, "team-b", UID) == "not-owned"  # the namespace must match too
    assert ownership.delete_local(mine, "team-a", "other-uid") == "not-owned"
    assert ownership.delete_local(mine, "team-a", UID) == "deleted"
    assert not mine.exists() and not ownership.marker_of(mine).exists() and similar.exists()
    assert ownership.delete_local(mine, "team-a", UID) == "absent"  # a retried pod finds it done


@pytest.mark.parametrize("other_namespace", [False, True])
def test_content_written_by_someone_else_is_never_claimed(tmp_path: Path, other_namespace: bool) -> None:
    users = tmp_path / "out"
    users.mkdir()
    if other_namespace:  # written by a job of another namespace: marked as theirs
        assert ownership.claim_local(users, ownership.Owner("team-b", "x", "b-uid"))
    (users / "weights.bin").write_bytes(b"user")
    assert not ownership.claim_local(users, OWNER)
    expected = ownership.Owner("team-b", "x", "b-uid") if other_namespace else None
    assert ownership.read_local(users) == expected
    assert ownership.delete_local(users, "team-a", UID) == "not-owned"
    assert (users / "weights.bin").exists()
