"""What the operator sends to Kubernetes: the Knative Service of a WarmPool, settings from the
environment, and the status merge patch."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from elastune_contract.api.resources import parse_resource
from elastune_contract.api.tuningjob import TuningJobStatus
from elastune_operator.control.records import JobRecord
from elastune_operator.k8s.knative import COST_BUSY, COST_REMOVE, MAX_SCALE, MIN_SCALE, service_manifest
from elastune_operator.k8s.runtime import status_patch
from elastune_operator.k8s.settings import OperatorSettings, SettingsError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pool():
    doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    doc["metadata"]["uid"] = "u-123"
    return parse_resource(doc)


def test_knative_service_follows_the_warm_pool(pool) -> None:
    svc = service_manifest(pool, 3, "redis://r:6379/0", "elastune-redis")
    tmpl = svc["spec"]["template"]
    assert (svc["apiVersion"], svc["kind"]) == ("serving.knative.dev/v1", "Service")
    assert tmpl["metadata"]["annotations"][MIN_SCALE] == "3"
    assert tmpl["metadata"]["annotations"][MAX_SCALE] == str(pool.spec.max_warm_gpus)
    owner = svc["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("WarmPool", "u-123", True)
    pod = tmpl["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"elastune.dev/pool": "cold"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"  # ready = weights loaded = warm
    env = {e["name"]: e for e in container["env"]}
    assert env["ELASTUNE_MODEL"]["value"] == pool.spec.model
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["ELASTUNE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "elastune-redis"
    assert [e["name"] for e in container["env"]].count(
        "ELASTUNE_REDIS_PASSWORD"
    ) == 1  # not doubled by spec.env
    assert container["securityContext"]["runAsNonRoot"] is True
    other = service_manifest(pool, 0, "redis://r:6379/0", "release-redis", "redis-password")
    env = {e["name"]: e for e in other["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ELASTUNE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "release-redis",
        "key": "redis-password",
    }
    assert int(COST_BUSY) > 0 > int(COST_REMOVE)


def test_settings_come_from_the_environment_and_errors_name_the_variable() -> None:
    s = OperatorSettings.from_env({"ELASTUNE_REDIS_URL": "redis://r:6379/0", "ELASTUNE_COLD_POOL_GPUS": "16"})
    assert s.cold_pool_gpus == 16 and s.redis_secret == "elastune-redis" and s.metrics_port == 9090
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
    with pytest.raises(SettingsError, match="ELASTUNE_COLD_POOL_GPUS='many'"):
        OperatorSettings.from_env({"ELASTUNE_REDIS_URL": "redis://r", "ELASTUNE_COLD_POOL_GPUS": "many"})
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
