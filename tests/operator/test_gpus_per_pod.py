"""gpusPerPod > 1 is refused with a reason, never requested and left idle (issue 42 item 2).

Elastune's engine uses one GPU per worker pod (contract: ENGINE_GPUS_PER_POD). The apiserver refuses a
new WarmPool asking for more through the CRD's CEL rule; a WarmPool stored under an older CRD (helm
upgrade leaves crds/ alone) reaches the real operator (kopf over our handlers, against the Kubernetes API
emulator over HTTP and a real redis-server), which refuses it: Ready=False GPUsPerPodUnsupported, naming
vLLM pools, and no Deployment. A pool of one GPU per pod beside it is configured as before, and the
refused one comes up once its spec asks for one. `elastune validate` and local mode, which check
manifests as the apiserver would, refuse it with the apiserver's words.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from elastune_contract.api import manifests
from elastune_contract.api.constants import GROUP, PLURAL_WARM_POOLS, VERSION
from elastune_contract.api.crds import build_crd
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.vocabulary import Reason
from elastune_testing.emulator import default_crds, start_emulator
from operator_process import start_operator, stop_operator
from operator_site import wait_for
from real_servers import start_redis, stop

NS = "default"


def body(name: str, model: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "WarmPool", "metadata": {"name": name, "namespace": NS},
        "spec": {"model": model, "maxWarmGPUs": 2, "gpusPerPod": gpus},
    }  # fmt: skip


def crd_without_gpu_rule() -> dict[str, Any]:
    """The WarmPool CRD as shipped before the rule: what an upgraded operator may meet in a cluster."""
    crd = copy.deepcopy(build_crd(WarmPool))
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"] = [
        r for r in spec["x-kubernetes-validations"] if "gpusPerPod" not in r["rule"]
    ]
    return crd


@pytest.fixture
def world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    server = start_redis(tmp_path)
    crds = [c for c in default_crds() if c["spec"]["names"]["kind"] != "WarmPool"]
    emulator = start_emulator(tmp_path / "emulator", crds=[*crds, crd_without_gpu_rule()])
    proc = start_operator(
        emulator.kubeconfig_path,
        server.url,
        "gpus",
        tmp_path / "work",
        tmp_path / "operator.log",
    )
    api = config.new_client_from_config(config_file=str(emulator.kubeconfig_path))
    try:
        yield {"api": api, "log": tmp_path / "operator.log", "proc": proc}
    finally:
        stop_operator(proc)
        emulator.stop()
        stop(server.proc)


def deployment(api: client.ApiClient, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = api.sanitize_for_serialization(
            client.AppsV1Api(api).read_namespaced_deployment(name, NS)
        )
        return found
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_the_operator_refuses_a_stored_pool_of_two_gpus_per_pod_and_configures_one(
    world: dict[str, Any],
) -> None:
    api, custom = world["api"], client.CustomObjectsApi(world["api"])
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, body("wide", "test/a", 2))
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, body("narrow", "test/b", 1))

    def ready(name: str) -> dict[str, Any] | None:
        assert world["proc"].poll() is None, world["log"].read_text()
        pool: Any = custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, name)
        conditions = (pool.get("status") or {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "Ready"), None)

    cond = wait_for("the wide pool's Ready condition", lambda: ready("wide"), timeout=60)
    assert (cond["status"], cond["reason"]) == ("False", Reason.GPUS_PER_POD_UNSUPPORTED), cond
    assert "gpusPerPod is 2" in cond["message"] and "vLLM pool" in cond["message"], cond
    assert "not available yet" in cond["message"], cond
    narrow = wait_for("the narrow pool's Ready condition", lambda: ready("narrow"), timeout=30)
    assert (narrow["status"], narrow["reason"]) == ("True", Reason.POOL_CONFIGURED), narrow
    made = wait_for("the narrow pool's Deployment", lambda: deployment(api, "narrow"))
    limits = made["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1", limits
    assert deployment(api, "wide") is None  # no pod ever asks for GPUs it would leave idle

    # Level-triggered: asking for one GPU per pod brings the refused pool up.
    patch = {"spec": {"gpusPerPod": 1}}
    custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, "wide", patch)
    wait_for("the wide pool configured", lambda: (ready("wide") or {}).get("status") == "True")
    assert wait_for("the wide pool's Deployment", lambda: deployment(api, "wide"))


def test_the_apiserver_refuses_two_gpus_per_pod_with_the_reason_and_admits_one(tmp_path: Path) -> None:
    emulator = start_emulator(tmp_path / "emulator")  # the CRDs as shipped, their CEL rules enforced
    try:
        api = config.new_client_from_config(config_file=str(emulator.kubeconfig_path))
        custom = client.CustomObjectsApi(api)
        with pytest.raises(ApiException) as refused:
            custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, body("w", "m/a", 2))
        assert refused.value.status == 422, refused.value.body
        causes = str(refused.value.body)
        assert "spec.gpusPerPod" in causes and "gpusPerPod must be 1" in causes, causes
        assert "vLLM pool" in causes, causes
        created: Any = custom.create_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL_WARM_POOLS, body("n", "m/a", 1)
        )
        assert created["spec"]["gpusPerPod"] == 1
        # An update to two is refused too (a rule is checked on every write, not only on create).
        with pytest.raises(ApiException) as update:
            patch = {"spec": {"gpusPerPod": 2}}
            custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, "n", patch)
        assert update.value.status == 422, update.value.body
    finally:
        emulator.stop()


def test_manifest_checks_refuse_two_gpus_per_pod_as_the_apiserver_does() -> None:
    # What `elastune validate`, `elastune run` and `elastune serve` read manifests with.
    wide = manifests.check(body("w", "m/a", 2), Path("pool.yaml"))
    assert wide.resource is None, wide
    assert [p for p in wide.problems if p.startswith("spec.gpusPerPod: gpusPerPod must be 1")], wide.problems
    assert any("vLLM pool" in p for p in wide.problems), wide.problems
    narrow = manifests.check(body("n", "m/a", 1), Path("pool.yaml"))
    assert narrow.problems == [] and isinstance(narrow.resource, WarmPool), narrow
