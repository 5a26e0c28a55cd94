"""Tune -> serve across pods: a TuningJob in a tenant's namespace runs on a worker pod of its WarmPool,
its checkpoints and artifact land on the pool's claim (not in the pod's /tmp), a different pod reads
the artifact afterwards, and the published prompt is answered through the gateway pod."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from kubernetes import client
from openai import OpenAI

from conftest import API_KEY, MODEL, TENANT, gateway_url, served, warm_pool
from elastune_testing.podworld import PodWorld

DATA = Path(__file__).resolve().parents[2] / "manifests" / "data" / "extract.jsonl"
CLAIM = "tuning"


def tuning_job(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "elastune.dev/v1alpha1",
        "kind": "TuningJob",
        "metadata": {"name": name, "namespace": TENANT},
        "spec": {
            "model": MODEL,
            "dataset": f"pvc://{CLAIM}/data/extract.jsonl",
            "initialPrompt": "Read the record and return one value.",
            "method": "promptTuning",
            "termination": {"maxIterations": 6},
            "deadline": "10m",
            "hyperparameters": {"batchSize": 4, "learningRate": "0.01", "virtualTokens": 8},
            **spec,
        },
    }


def claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": TENANT},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }


def custom_object(world: PodWorld, plural: str, name: str) -> dict[str, Any]:
    custom = client.CustomObjectsApi(world.api)
    return custom.get_namespaced_custom_object("elastune.dev", "v1alpha1", TENANT, plural, name)  # type: ignore[return-value]


def job_status(world: PodWorld, name: str) -> dict[str, Any]:
    return custom_object(world, "tuningjobs", name).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def wait_job(world: PodWorld, name: str, timeout: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = job_status(world, name)
        if (
            condition(status, "Succeeded").get("status") == "True"
            or condition(status, "Failed").get("status") == "True"
        ):
            return status
        assert time.monotonic() < deadline, f"job {name} did not finish: {json.dumps(status)}"
        time.sleep(1)


def test_a_tuning_job_on_a_worker_pod_publishes_an_artifact_other_pods_read(world: PodWorld) -> None:
    world.apply(claim(CLAIM))
    claim_dir = world.root / "kubelet" / "pvc" / TENANT / CLAIM
    (claim_dir / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA, claim_dir / "data" / "extract.jsonl")
    world.apply(warm_pool("tune-a", volumes=[{"claimName": CLAIM, "jobStorage": True}],
                          serving={"minReplicas": 1}))  # fmt: skip
    world.apply(tuning_job("author", output={"publish": "author-prompt"}))
    status = wait_job(world, "author")
    assert condition(status, "Succeeded").get("status") == "True", json.dumps(status)
    uri = status.get("artifactURI") or ""
    assert uri.startswith(f"pvc://{CLAIM}/"), f"the artifact is not on the pool's claim: {json.dumps(status)}"
    # Checkpoints and the artifact are on the claim's directory, which outlives every pod.
    files = {p.name for p in claim_dir.rglob("*")}
    assert "adapter_config.json" in files, sorted(files)

    # A different pod (fresh process, own /tmp) mounting the claim reads the artifact.
    rel = uri.removeprefix(f"pvc://{CLAIM}/")
    world.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reader", "namespace": TENANT},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "reader", "image": "ghcr.io/elastune/worker:test",
            "command": ["python", "-c", f"print(open('/data/{rel}/adapter_config.json').read())"],
            "volumeMounts": [{"name": "d", "mountPath": "/data"}]}],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": CLAIM}}]},
    })  # fmt: skip
    deadline = time.monotonic() + 60
    while "PROMPT_TUNING" not in world.kubelet.log_of(TENANT, "reader"):
        assert time.monotonic() < deadline, world.kubelet.log_of(TENANT, "reader")
        time.sleep(0.5)

    # The pod that tuned goes; the published prompt is answered by a worker pod that did not tune it
    # (it loads the artifact from the claim).
    tuned_on = {p["metadata"]["name"] for p in world.pods(TENANT, "elastune.dev/warmpool=tune-a")}
    core = client.CoreV1Api(world.api)
    for name in tuned_on:
        core.delete_namespaced_pod(name, TENANT)
    deadline = time.monotonic() + 120
    while (
        not {p["metadata"]["name"] for p in world.wait_ready(TENANT, "elastune.dev/warmpool=tune-a")}
        - tuned_on
    ):
        assert time.monotonic() < deadline, "no new worker pod"
        time.sleep(0.5)
    api = OpenAI(base_url=gateway_url(world), api_key=API_KEY, max_retries=0, timeout=60)
    deadline = time.monotonic() + 120
    while "author-prompt" not in served(api):
        assert time.monotonic() < deadline, (
            "the published prompt never reached the gateway: "
            + json.dumps(custom_object(world, "loraadapters", "author-prompt").get("status"))
            + "\n"
            + "\n".join(
                world.kubelet.log_of(TENANT, p["metadata"]["name"])[-3000:] for p in world.pods(TENANT)
            )
        )
        time.sleep(1)
    out = api.completions.create(
        model="author-prompt",
        prompt="year: 1987; author: atwood; title: beloved",
        max_tokens=4,
        temperature=0,
    )
    assert out.choices[0].text
