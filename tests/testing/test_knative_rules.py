"""Knative Serving's own rules as the stand-ins enforce them (testing/elastune_testing/knative_rules.py,
derived from knative/serving's source; issue 37 item 1). They are why WarmPools are Deployments: the
operator's former Knative Service was refused by a stock install and every resize was a new Revision
(docs/operations/warm-pool-workload.md)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from elastune_testing import knative_rules as R


def service(**pod: Any) -> dict[str, Any]:
    container = {"name": "user", "image": "img", "ports": [{"containerPort": 8080}]}
    return {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {"name": "svc", "namespace": "ns"},
        "spec": {"template": {"metadata": {"annotations": {}}, "spec": {"containers": [container], **pod}}},
    }


def flags(**on: str) -> R.KnativeConfig:
    return R.KnativeConfig(features={**R.DEFAULT_FEATURES, **on})


def test_timeout_defaults_to_300_and_may_not_exceed_the_max_revision_timeout() -> None:
    assert R.admit(service())["spec"]["template"]["spec"]["timeoutSeconds"] == 300
    assert R.admit(service(timeoutSeconds=600))["spec"]["template"]["spec"]["timeoutSeconds"] == 600
    with pytest.raises(R.WebhookDenied) as denied:
        R.admit(service(timeoutSeconds=3600))
    assert denied.value.errors == ["expected 0 <= 3600 <= 600: spec.template.spec.timeoutSeconds"]
    R.admit(service(timeoutSeconds=3600), R.KnativeConfig(max_revision_timeout_seconds=3600))


def test_a_denial_is_the_apiservers_webhook_refusal() -> None:
    with pytest.raises(R.WebhookDenied) as denied:
        R.admit(service(timeoutSeconds=3600))
    status = denied.value.status
    assert (status["kind"], status["status"], status["code"]) == ("Status", "Failure", 400)
    assert status["message"].startswith(
        'admission webhook "validation.webhook.serving.knative.dev" denied the request: validation failed: '
    )
    exc = denied.value.as_api_exception()
    assert exc.status == 400 and json.loads(exc.body) == status


def test_fieldref_env_needs_the_fieldref_flag() -> None:
    svc = service()
    env = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    svc["spec"]["template"]["spec"]["containers"][0]["env"] = [env]
    assert R.validate_service(svc) == [
        "must not set the field(s): spec.template.spec.containers[0].env[0].valueFrom.fieldRef"
    ]
    assert R.validate_service(svc, flags(**{R.FIELDREF: R.ENABLED})) == []
    assert R.validate_service(svc, flags(**{R.FIELDREF: R.ALLOWED})) == []  # not Disabled is enough


def test_pvc_volumes_need_the_claim_flag_and_writes_the_write_flag() -> None:
    def with_claim(read_only: bool) -> dict[str, Any]:
        svc = service(
            volumes=[{"name": "v", "persistentVolumeClaim": {"claimName": "c", "readOnly": read_only}}]
        )
        svc["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = [
            {"name": "v", "mountPath": "/data", "readOnly": read_only}
        ]
        return svc

    assert len(R.validate_service(with_claim(True))) == 1
    assert R.validate_service(with_claim(True), flags(**{R.PVC: R.ENABLED})) == []
    # Volumes need Enabled, not merely Allowed (k8s_validation.go validatePersistentVolumeClaims).
    assert len(R.validate_service(with_claim(True), flags(**{R.PVC: R.ALLOWED}))) == 1
    (error,) = R.validate_service(with_claim(False), flags(**{R.PVC: R.ENABLED}))
    assert error.startswith("Persistent volume write support is disabled")
    assert R.validate_service(with_claim(False), flags(**{R.PVC: R.ENABLED, R.PVC_WRITE: R.ENABLED})) == []


@pytest.mark.parametrize("field,value", [
    ("nodeSelector", {"pool": "cold"}),
    ("tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists"}]),
    ("affinity", {"nodeAffinity": {}}),
])  # fmt: skip
def test_scheduling_fields_need_their_feature_flag(field: str, value: Any) -> None:
    svc = service(**{field: value})
    assert R.validate_service(svc) == [f"must not set the field(s): spec.template.spec.{field}"]
    assert R.validate_service(svc, flags(**{R.POD_SPEC_FEATURES[field]: R.ENABLED})) == []


def test_fields_knative_never_takes() -> None:
    errors = R.validate_service(service(terminationGracePeriodSeconds=30, automountServiceAccountToken=True))
    assert errors == [
        "must not set the field(s): spec.template.spec.automountServiceAccountToken, "
        "spec.template.spec.terminationGracePeriodSeconds"
    ]
    assert R.validate_service(service(automountServiceAccountToken=False)) == []  # false only
    svc = service()
    svc["spec"]["template"]["spec"]["containers"][0]["lifecycle"] = {}
    svc["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "PORT", "value": "1"}]
    assert sorted(R.validate_service(svc)) == [
        '"PORT" is a reserved environment variable: spec.template.spec.containers[0].env[0].name',
        "must not set the field(s): spec.template.spec.containers[0].lifecycle",
    ]


def test_secret_mounts_must_be_read_only() -> None:
    svc = service(volumes=[{"name": "s", "secret": {"secretName": "x"}}])
    svc["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = [{"name": "s", "mountPath": "/s"}]
    assert R.validate_service(svc) == [
        "volume mount should be readOnly for this type of volume: "
        "spec.template.spec.containers[0].volumeMounts[0].readOnly"
    ]


def test_min_and_max_scale_as_the_autoscaler_reads_them() -> None:
    assert R.scale_bounds({}) == (0, None)
    assert R.scale_bounds({R.MIN_SCALE: "2", R.MAX_SCALE: "0"}) == (2, None)  # 0: unbounded
    assert R.scale_bounds({R.MIN_SCALE: "2", R.MAX_SCALE: "5"}) == (2, 5)
    svc = service()
    svc["spec"]["template"]["metadata"]["annotations"] = {R.MIN_SCALE: "4", R.MAX_SCALE: "2"}
    (error,) = R.validate_service(svc)
    assert error.startswith("max-scale=2 is less than min-scale=4")
    svc["spec"]["template"]["metadata"]["annotations"] = {R.MIN_SCALE: "-1"}
    assert len(R.validate_service(svc)) == 1


def test_any_template_change_is_a_new_revision_and_a_metadata_change_is_not() -> None:
    old = service()
    resized = copy.deepcopy(old)
    resized["spec"]["template"]["metadata"]["annotations"][R.MIN_SCALE] = "3"
    assert R.makes_new_revision(old, resized)  # an annotation of the template: new Revision, new pods
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"team": "a"}
    assert not R.makes_new_revision(old, relabelled)


def test_the_stand_in_replaces_every_pod_on_a_min_scale_change_and_gives_refused_services_none(
    tmp_path: Any,
) -> None:
    """The pod world's KnativeServices controller against the API emulator (no kubelet needed)."""
    pytest.importorskip("kmock")
    from kubernetes import client, config

    from elastune_testing.emulator import start_emulator
    from elastune_testing.podworld.controllers import KnativeServices

    handle = start_emulator(tmp_path / "emu")
    try:
        api = config.new_client_from_config(config_file=str(handle.kubeconfig_path))
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        ksvc = ("serving.knative.dev", "v1", "ns", "services")
        svc = service()
        svc["spec"]["template"]["metadata"]["annotations"][R.MIN_SCALE] = "2"
        custom.create_namespaced_custom_object(*ksvc, svc)
        controller = KnativeServices(api)
        controller.round()

        def uids() -> set[str]:
            return {
                p.metadata.uid
                for p in core.list_namespaced_pod("ns").items
                if not p.metadata.deletion_timestamp
            }

        before = uids()
        assert len(before) == 2
        custom.patch_namespaced_custom_object(*ksvc, "svc", {"metadata": {"labels": {"team": "a"}}})
        controller.round()
        assert uids() == before  # outside the template: same Revision, same pods
        patch = {"spec": {"template": {"metadata": {"annotations": {R.MIN_SCALE: "3"}}}}}
        custom.patch_namespaced_custom_object(*ksvc, "svc", patch)
        controller.round()
        after = uids()
        assert len(after) == 3 and not before & after  # the new Revision's pods replaced every old one
        bad = service(timeoutSeconds=3600)
        bad["metadata"]["name"] = "bad"
        custom.create_namespaced_custom_object(*ksvc, bad)
        controller.round()
        assert ("ns", "bad") in controller.denials and len(uids()) == 3
    finally:
        handle.stop()
