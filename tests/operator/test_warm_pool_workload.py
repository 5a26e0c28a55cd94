"""A WarmPool's pods as the operator writes them (issue 37 items 1-2): a resize never replaces a pod.

Against the Kubernetes API emulator over HTTP with the pod world's Deployments controller (ReplicaSet
semantics; no kubelet: the controller only writes Pod objects, this test writes their status): the real
WorkloadBackend registers a pool and resizes it. Before this change the operator wrote a Knative Service
with min-scale in its template; held to Knative's rules (``knative_rules``) that Service was refused
(timeoutSeconds 3600 > 600, fieldRef env, PVCs, nodeSelector, tolerations) and every resize was a new
Revision replacing every pod — see tests/testing/test_knative_rules.py and
docs/operations/warm-pool-workload.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")

from kubernetes import client, config

from elastune_contract.api.resources import parse_resource
from elastune_contract.protocol import pod_worker_id
from elastune_operator.k8s.workload import COST_BUSY, COST_REMOVE, DELETION_COST, WorkloadBackend
from elastune_testing.emulator import EmulatorHandle
from elastune_testing.fixtures import k8s_emulator  # noqa: F401  (fixture)
from elastune_testing.podworld.controllers import Deployments, deletion_order

REPO = Path(__file__).resolve().parents[2]
NS, POOL, MODEL = "team-a", "tiny-gpt2", "elastune/tiny-gpt2"
KEY = f"{NS}/{POOL}"
STAMP = "2026-01-01T00:00:00Z"


def warm_pool() -> Any:
    doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    doc["metadata"].update(namespace=NS, uid="u-pool")
    return parse_resource(doc)


def pods(api: client.ApiClient) -> dict[str, str]:
    """name -> uid of the pool's pods that are not going."""
    items = client.CoreV1Api(api).list_namespaced_pod(NS).items
    return {p.metadata.name: p.metadata.uid for p in items if not p.metadata.deletion_timestamp}


def run_pods(api: client.ApiClient) -> None:
    """The kubelet's part: every pod Running and Ready (scale-down ranks ready running pods by cost)."""
    core = client.CoreV1Api(api)
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": STAMP}
    for name in pods(api):
        core.patch_namespaced_pod_status(name, NS, {"status": {"phase": "Running", "conditions": [ready]}})


@pytest.fixture
def world(k8s_emulator: EmulatorHandle) -> tuple[client.ApiClient, WorkloadBackend, Deployments]:  # noqa: F811
    api = config.new_client_from_config(config_file=str(k8s_emulator.kubeconfig_path))
    return api, WorkloadBackend(api, "redis://r:6379/0"), Deployments(api)


def test_resizing_a_pool_keeps_its_pods(world: tuple[client.ApiClient, WorkloadBackend, Deployments]) -> None:
    api, backend, controller = world
    backend.register(warm_pool(), 2)
    controller.round()
    before = pods(api)
    assert len(before) == 2
    template = client.AppsV1Api(api).read_namespaced_deployment(POOL, NS).spec.template.to_dict()
    backend.grow(KEY, MODEL, 2)
    controller.round()
    grown = pods(api)
    assert len(grown) == 4 and before.items() <= grown.items(), "growing the pool replaced its pods"
    assert client.AppsV1Api(api).read_namespaced_deployment(POOL, NS).spec.template.to_dict() == template
    run_pods(api)
    # The core releases two idle pods it picked (one of the first two, one of the new ones).
    released = [sorted(before)[0], sorted(set(grown) - set(before))[0]]
    kept = set(grown) - set(released)
    backend.mark_busy(KEY, [pod_worker_id(NS, p) for p in kept], True)
    backend.shrink(KEY, [pod_worker_id(NS, p) for p in released])
    controller.round()
    assert set(pods(api)) == kept, "the shrink removed other pods than the ones the scheduler released"
    assert {r.pod for r in controller.removals} == set(released)
    assert {r.deletion_cost for r in controller.removals} == {int(COST_REMOVE)}
    assert {p: grown[p] for p in kept} == pods(api)  # same UIDs


def test_a_template_change_rolls_the_pool_and_a_replicas_change_does_not(
    world: tuple[client.ApiClient, WorkloadBackend, Deployments],
) -> None:
    """The ReplicaSet semantics the pod world enforces: the whole template (annotations too) is hashed."""
    api, backend, controller = world
    backend.register(warm_pool(), 2)
    controller.round()
    before = pods(api)
    apps = client.AppsV1Api(api)
    apps.patch_namespaced_deployment(POOL, NS, {"spec": {"replicas": 3}})
    controller.round()
    assert before.items() <= pods(api).items()
    apps.patch_namespaced_deployment(
        POOL, NS, {"spec": {"template": {"metadata": {"annotations": {"x": "1"}}}}}
    )
    controller.round()
    after = pods(api)
    assert len(after) == 3 and not set(before.values()) & set(after.values())


def pod(name: str, cost: int | None = None, phase: str = "Running", ready: bool = True,
        created: str = STAMP, node: str = "n1", restarts: int = 0) -> dict[str, Any]:  # fmt: skip
    ann = {DELETION_COST: str(cost)} if cost is not None else {}
    return {
        "metadata": {"name": name, "annotations": ann, "creationTimestamp": created},
        "spec": {"nodeName": node},
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": str(ready), "lastTransitionTime": created}],
            "containerStatuses": [{"restartCount": restarts}],
        },
    }


def test_scale_down_order_is_the_replicaset_controllers() -> None:
    """controller_utils.go ActivePodsWithRanks: unassigned, Pending, not ready, then the lowest cost,
    then ready for less time, then more restarts, then the newest."""
    order = [p["metadata"]["name"] for p in deletion_order([
        pod("busy", int(COST_BUSY)),
        pod("idle"),
        pod("released", int(COST_REMOVE)),
        pod("newer", created="2026-01-02T00:00:00Z"),
        pod("crashy", restarts=3),
        pod("pending", int(COST_BUSY), phase="Pending", ready=False),
        pod("unready", int(COST_BUSY), ready=False),
        pod("unassigned", int(COST_BUSY), node=""),
    ])]  # fmt: skip
    assert order == ["unassigned", "pending", "unready", "released", "newer", "crashy", "idle", "busy"]
