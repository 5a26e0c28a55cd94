"""What the operator sends to Kubernetes: the Knative Service of a WarmPool, settings from the
environment, and the status merge patch."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from elastune_contract.api.resources import parse_resource
from elastune_contract.api.tuningjob import TuningJobStatus
from elastune_operator.control.records import JobRecord
from elastune_operator.k8s.runtime import status_patch
from elastune_operator.k8s.settings import OperatorSettings, SettingsError
from elastune_operator.k8s.workload import COST_BUSY, COST_REMOVE, WORKER_PORT, worker_deployment

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pool():
    doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    doc["metadata"]["uid"] = "u-123"
    return parse_resource(doc)


def test_the_deployment_follows_the_warm_pool(pool) -> None:
    svc = worker_deployment(pool, 3, "redis://r:6379/0", "elastune-redis")
    tmpl = svc["spec"]["template"]
    assert (svc["apiVersion"], svc["kind"]) == ("apps/v1", "Deployment")
    assert svc["spec"]["replicas"] == 3
    assert (
        worker_deployment(pool, 99, "redis://r:6379/0", None)["spec"]["replicas"] == pool.spec.max_warm_gpus
    )
    # The size is not in the template: a resize changes only spec.replicas, so no pod is replaced.
    assert worker_deployment(pool, 1, "redis://r:6379/0", "elastune-redis")["spec"]["template"] == tmpl
    assert svc["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    assert "timeoutSeconds" not in tmpl["spec"] and tmpl["spec"]["terminationGracePeriodSeconds"] == 120
    # the worker drains (issue 38 item 1) for the grace period less a margin, so it exits before SIGKILL
    env = {e["name"]: e.get("value") for e in tmpl["spec"]["containers"][0]["env"]}
    assert env["ELASTUNE_DRAIN_SECONDS"] == "115"
    owner = svc["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("WarmPool", "u-123", True)
    pod = tmpl["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"elastune.dev/pool": "cold"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": WORKER_PORT}  # warm
    env = {e["name"]: e for e in container["env"]}
    assert env["ELASTUNE_MODEL"]["value"] == pool.spec.model
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # The worker registers as POD_NAMESPACE/POD_NAME: pod names repeat across namespaces (issue 25).
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["ELASTUNE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "elastune-redis"
    assert [e["name"] for e in container["env"]].count(
        "ELASTUNE_REDIS_PASSWORD"
    ) == 1  # not doubled by spec.env
    assert container["securityContext"]["runAsNonRoot"] is True
    other = worker_deployment(pool, 0, "redis://r:6379/0", "release-redis", "redis-password")
    env = {e["name"]: e for e in other["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ELASTUNE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "release-redis",
        "key": "redis-password",
    }
    assert int(COST_BUSY) > 0 > int(COST_REMOVE)


def test_settings_come_from_the_environment_and_errors_name_the_variable() -> None:
    s = OperatorSettings.from_env(
        {"ELASTUNE_REDIS_URL": "redis://r:6379/0", "ELASTUNE_COLD_POOL_NODE_SELECTOR": "pool=gpu"}
    )
    assert s.cold_pool_node_selector == "pool=gpu" and s.redis_secret == "elastune-redis"
    assert s.metrics_port == 9090
    assert s.redis_secret_key == "password"
    keyed = OperatorSettings.from_env({"ELASTUNE_REDIS_URL": "redis://r", "ELASTUNE_REDIS_SECRET_KEY": "pw"})
    assert keyed.redis_secret_key == "pw"
    assert (
        OperatorSettings.from_env(
            {"ELASTUNE_REDIS_URL": "redis://r", "ELASTUNE_REDIS_SECRET": ""}
        ).redis_secret
        is None
    )
    with pytest.raises(SettingsError, match="ELASTUNE_REDIS_URL is required"):
        OperatorSettings.from_env({})
    with pytest.raises(SettingsError, match="ELASTUNE_METRICS_PORT='many'"):
        OperatorSettings.from_env({"ELASTUNE_REDIS_URL": "redis://r", "ELASTUNE_METRICS_PORT": "many"})
    with pytest.raises(SettingsError, match="must start with redis://"):
        OperatorSettings.from_env({"ELASTUNE_REDIS_URL": "http://r"})


def test_status_patch_removes_stale_fields_without_nulls_inside_lists() -> None:
    job = parse_resource(yaml.safe_load((REPO / "manifests" / "tuningjob.yaml").read_text()))
    rec = JobRecord("default/x", job.spec, 0.0, "d", "/a")
    rec.status = TuningJobStatus.model_validate(
        {
            "conditions": [
                {
                    "type": "Succeeded",
                    "status": "True",
                    "reason": "MaxIterations",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
            "iterations": 5,
        }
    )
    patch = status_patch(rec)
    assert patch["iterations"] == 5
    assert patch["predictedCompletionTime"] is None  # merge patch: null deletes a stale value
    assert "observedGeneration" not in patch["conditions"][0]  # no nulls inside list items


def test_serving_section_becomes_engine_flags_and_claims_become_mounts() -> None:
    doc = yaml.safe_load((REPO / "manifests" / "serving" / "warmpool.yaml").read_text())
    doc["spec"]["volumes"] = [
        {"claimName": "adapters", "readOnly": True},
        {"claimName": "checkpoints", "mountPath": "/tmp/elastune"},
    ]
    pool = parse_resource(doc)
    pod = worker_deployment(pool, 0, "redis://r:6379/0", None)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[0] == "serve"
    assert args[args.index("--max-loras") + 1] == "4" and args[args.index("--max-cpu-loras") + 1] == "16"
    assert args[args.index("--max-lora-rank") + 1] == "64" and "--enable-lora" in args
    claims = [v for v in pod["volumes"] if v["name"] != "control-token"]  # the control token: security tests
    assert claims == [
        {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}},
        {"name": "pvc-1", "persistentVolumeClaim": {"claimName": "checkpoints", "readOnly": False}},
    ]
    # pvc://<claim>/<path> resolves under /mnt/pvc/<claim> in the worker: every claim is mounted there,
    # and a mountPath only adds a second mount of it.
    assert [m for m in container["volumeMounts"] if m["name"] != "control-token"] == [
        {"name": "pvc-0", "mountPath": "/mnt/pvc/adapters", "readOnly": True},
        {"name": "pvc-1", "mountPath": "/mnt/pvc/checkpoints", "readOnly": False},
        {"name": "pvc-1", "mountPath": "/tmp/elastune", "readOnly": False},
    ]
    assert {"name": "ELASTUNE_PVC_ROOT", "value": "/mnt/pvc"} in container["env"]
    plain = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    bare = worker_deployment(parse_resource(plain), 0, "redis://r:6379/0", None)["spec"]["template"]["spec"]
    assert bare["containers"][0]["args"] == ["serve"]
    # The example pool keeps checkpoints and tuned prompts on its jobStorage claim, where pvc:// resolves.
    assert [m for m in bare["containers"][0]["volumeMounts"] if m["name"] != "control-token"] == [
        {"name": "pvc-0", "mountPath": "/mnt/pvc/elastune-artifacts", "readOnly": False}
    ]


def test_the_redis_secret_is_copied_into_each_pool_namespace(tmp_path: Path) -> None:
    """Against the API emulator over HTTP: a pod can only read a Secret of its own namespace."""
    pytest.importorskip("kmock")
    import base64

    from kubernetes import client, config

    from elastune_operator.k8s.workload import WorkloadBackend
    from elastune_testing.emulator import start_emulator

    emu = start_emulator(tmp_path / "emulator")
    try:
        api = config.new_client_from_config(config_file=str(emu.kubeconfig_path))
        core = client.CoreV1Api(api)
        doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
        doc["metadata"].update(namespace="team-a", uid="u-1")
        pool = parse_resource(doc)
        url, name = "redis://r:6379/0", "elastune-redis"
        WorkloadBackend(api, url, name, "password", redis_password="s3cret").register(pool, 0)
        secret = core.read_namespaced_secret("elastune-redis", "team-a")
        assert base64.b64decode(secret.data["password"]).decode() == "s3cret"
        # A secret of that name already there (e.g. a stale copy) is brought up to date, not duplicated.
        core.patch_namespaced_secret(
            "elastune-redis", "team-a", {"data": {"password": base64.b64encode(b"old").decode()}}
        )
        WorkloadBackend(api, url, name, "password", redis_password="s3cret").register(pool, 0)
        secret = core.read_namespaced_secret("elastune-redis", "team-a")
        assert base64.b64decode(secret.data["password"]).decode() == "s3cret"
        # Without a password (Redis without auth) nothing is written.
        doc["metadata"]["namespace"] = "team-b"
        WorkloadBackend(api, "redis://r:6379/0", "elastune-redis").register(parse_resource(doc), 0)
        assert not [
            s for s in core.list_namespaced_secret("team-b").items if s.metadata.name == "elastune-redis"
        ]
    finally:
        emu.stop()


def test_a_pool_can_share_its_pods_queues_fairly_by_tenant_and_bound_them() -> None:
    """serving.queuePolicy: fair and serving.maxQueuedRequests (issue 25 item 3) reach the worker as its
    flags, the worker's own parser accepts them, and the CRD admits fair; an unknown policy is refused."""
    from elastune_contract.api.crds import render_crds
    from elastune_contract.api.resources import InvalidResource

    doc = yaml.safe_load((REPO / "manifests" / "serving" / "warmpool.yaml").read_text())
    doc["spec"]["serving"]["queuePolicy"] = "fair"
    doc["spec"]["serving"]["maxQueuedRequests"] = 256  # the bound on each pod's queue (503 past it)
    pool = parse_resource(doc)
    args = worker_deployment(pool, 0, "redis://r:6379/0", None)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--queue-policy") + 1] == "fair"
    server = pytest.importorskip("elastune_worker.engine.server")  # the worker's engine flags
    engine_flags = argparse.ArgumentParser()
    server.add_engine_args(engine_flags)
    parsed = engine_flags.parse_known_args(args)[0]
    assert parsed.queue_policy == "fair" and parsed.max_queued_requests == 256
    crd = yaml.safe_load(render_crds()["elastune.dev_warmpools.yaml"])
    serving = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "serving"
    ]
    assert "fair" in serving["properties"]["queuePolicy"]["enum"]
    doc["spec"]["serving"]["queuePolicy"] = "lottery"
    with pytest.raises(InvalidResource, match="queuePolicy"):
        parse_resource(doc)


def test_a_pools_job_limits_reach_the_core_and_the_crd_bounds_them() -> None:
    from elastune_contract.api.resources import InvalidResource
    from elastune_operator.control.resources import pool_config

    doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    doc["spec"]["jobLimits"] = {"maxBatchSize": 32, "maxIterations": 2000}
    cfg = pool_config(parse_resource(doc))
    assert (cfg.max_batch_size, cfg.max_iterations) == (32, 2000)
    doc["spec"]["jobLimits"] = {"maxBatchSize": 0}
    with pytest.raises(InvalidResource, match=r"jobLimits\.maxBatchSize"):
        parse_resource(doc)
