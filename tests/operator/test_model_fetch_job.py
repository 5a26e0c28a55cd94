"""The operator's side of model sources (operator/elastune_operator/k8s/model_fetch.py): the fetch Job it
writes, the ModelReady condition it reads from the Job and its pods, and the worker pod template's part
(cache mount, offline env, startupProbe)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from elastune_contract.api.constants import LABEL_WARM_POOL
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.vocabulary import Reason
from elastune_operator.k8s import model_fetch as mf
from elastune_operator.k8s.workload import worker_pod_template

KUBE_VERSION = "1.33.0"


def pool(model: str, **source: Any) -> WarmPool:
    spec: dict[str, Any] = {"model": model, "worker": {"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}}
    if source:
        spec["modelSource"] = source
    return WarmPool.model_validate(
        {"metadata": {"name": "llama", "namespace": "team-a", "uid": "u1"}, "spec": spec}
    )


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_fetch_job_of_an_hf_model_runs_the_fetcher_with_the_token_and_the_cache() -> None:
    job = mf.job_manifest(pool("hf://org/llama@v2", secretName="hub-token", cacheClaim="models"))
    kubernetes_validate.validate(job, KUBE_VERSION, strict=True)
    assert job["metadata"]["name"] == "llama-model-fetch"
    assert job["metadata"]["ownerReferences"][0]["kind"] == "WarmPool"
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["restartPolicy"] == "Never"
    assert c["command"] == ["python", "-m", "elastune_worker.model_fetch"]
    assert c["args"] == ["--source", "hf://org/llama@v2", "--cache", "/mnt/models"]
    env = env_of(c)
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hub-token", "key": "token"}}
    assert env["HF_HUB_OFFLINE"] == "0"  # the fetcher downloads; the pool's own env cannot stop it
    assert pod["volumes"][0] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}
    assert c["volumeMounts"][0] == {"name": "model-cache", "mountPath": "/mnt/models"}
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # A fetch pod is not a worker: the workload backend lists worker pods by this label.
    assert LABEL_WARM_POOL not in job["spec"]["template"]["metadata"]["labels"]


def test_the_fetch_job_of_an_s3_model_mounts_the_secret_as_lora_adapters_do() -> None:
    job = mf.job_manifest(pool("s3://weights/llama", secretName="s3-creds"))
    kubernetes_validate.validate(job, KUBE_VERSION, strict=True)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"][-2:] == ["--s3-secret", "s3-creds"]
    assert {"name": "s3-secret", "mountPath": "/var/run/elastune/s3/s3-creds", "readOnly": True} in c[
        "volumeMounts"
    ]
    assert "HF_TOKEN" not in env_of(c)


def test_the_fetch_job_of_a_pvc_model_mounts_the_source_claim_read_only() -> None:
    job = mf.job_manifest(pool("pvc://weights/llama"))
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert {"name": "source", "mountPath": "/mnt/pvc/weights", "readOnly": True} in c["volumeMounts"]


def _pod(message: str, finished: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    terminated = {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": finished}
    return {"status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": terminated}}]}}


def _job(*conditions: tuple[str, str]) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "llama-model-fetch",
            "annotations": {mf.SOURCE_ANNOTATION: "hf://org/llama@main"},
        },
        "status": {"conditions": [{"type": t, "status": "True", "reason": r} for t, r in conditions]},
    }


def test_a_failed_job_reports_the_reason_its_newest_pod_ended_with() -> None:
    said = "ModelAccessDenied: hf://org/llama@main: the hub refused the token (HTTP 401)"
    log = f"Traceback...\nsome warning\n{said}"
    pods = [_pod("ModelFetchFailed: blip", "2026-01-01T00:00:00Z"), _pod(log, "2026-01-01T00:01:00Z")]
    state = mf.job_outcome(_job(("Failed", "BackoffLimitExceeded")), pods)
    assert (state.status, state.reason) == ("False", Reason.MODEL_ACCESS_DENIED)
    assert state.message.endswith("(HTTP 401)")


def test_a_failed_job_without_a_reason_in_its_pods_is_model_fetch_failed() -> None:
    state = mf.job_outcome(_job(("Failed", "BackoffLimitExceeded")), [_pod("Killed")])
    assert (state.status, state.reason) == ("False", Reason.MODEL_FETCH_FAILED)
    assert "BackoffLimitExceeded" in state.message


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [((("Complete", ""),), ("True", Reason.MODEL_FETCHED)), ((), ("Unknown", Reason.MODEL_FETCHING))],
)
def test_complete_and_running_jobs(
    conditions: tuple[tuple[str, str], ...], expected: tuple[str, str]
) -> None:
    state = mf.job_outcome(_job(*conditions), [])
    assert (state.status, state.reason) == expected


def test_workers_of_a_fetched_model_mount_the_cache_read_only_and_load_offline() -> None:
    wp = pool("hf://org/llama", loadTimeout="15m")
    template = worker_pod_template(wp, "redis://redis:6379/0", None)
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": template["spec"]},
        KUBE_VERSION,
        strict=True,
    )
    (c,) = template["spec"]["containers"]
    env = env_of(c)
    assert env["HF_HUB_OFFLINE"] == "1" and env["ELASTUNE_MODEL_CACHE"] == "/mnt/models"
    assert [e["name"] for e in c["env"]].count("HF_HUB_OFFLINE") == 1  # the pool's "0" is replaced
    assert {"name": "model-cache", "mountPath": "/mnt/models", "readOnly": True} in c["volumeMounts"]
    claim = {"claimName": "elastune-models", "readOnly": True}
    assert {"name": "model-cache", "persistentVolumeClaim": claim} in template["spec"]["volumes"]
    probe = c["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 15 * 60
    assert probe["httpGet"]["port"] == c["livenessProbe"]["httpGet"]["port"]


def test_workers_of_a_built_in_model_get_no_cache_but_a_startup_probe() -> None:
    template = worker_pod_template(pool("elastune/tiny-llama"), "redis://redis:6379/0", None)
    (c,) = template["spec"]["containers"]
    assert all(v["name"] != "model-cache" for v in template["spec"].get("volumes", []))
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
