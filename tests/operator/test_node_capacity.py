"""The cold pool's capacity from the cluster's Node objects (issue 37 item 4; k8s.node_capacity).

The reader runs against the Kubernetes API emulator over HTTP, with Node objects written as a kubelet
writes them: the Node first, then its status (allocatable, conditions) through the status subresource.
Which nodes count follows cluster-autoscaler's IsNodeReadyAndSchedulable (see the module docstring).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from elastune_operator.k8s.node_capacity import NodeCapacity, NodeSelectorError, node_gpus
from elastune_operator.k8s.settings import DEFAULT_COLD_POOL_SELECTOR, OperatorSettings
from elastune_operator.scheduling.factory import make_policy
from elastune_operator.scheduling.policy import POLICY_NAMES
from elastune_operator.scheduling.prompttuner import PromptTunerPolicy
from elastune_operator.scheduling.state import Launch
from elastune_testing.emulator import start_emulator
from scheduling_helpers import LLM, apply, make_estimator, make_jobs, make_state

COLD = {"elastune.dev/pool": "cold"}
READY = {"type": "Ready", "status": "True"}


def node(gpus: Any = 4, *, ready: str | None = "True", unschedulable: bool = False, **extra: Any) -> dict:
    conditions = [] if ready is None else [{"type": "Ready", "status": ready}]
    return {
        "metadata": {"name": "n", "labels": COLD},
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {"allocatable": {"nvidia.com/gpu": gpus}, "conditions": conditions, **extra},
    }


@pytest.mark.parametrize(
    ("body", "gpus"),
    [
        (node(4), 4),
        (node("8"), 8),
        (node(4, unschedulable=True), 0),  # cordoned: takes no new pods
        (node(4, ready="False"), 0),
        (node(4, ready="Unknown"), 0),  # the node controller's mark for a kubelet that stopped posting
        (node(4, ready=None), 0),  # no Ready condition at all: not ready (GetReadinessState)
        (node(4, conditions=[READY, {"type": "NetworkUnavailable", "status": "True"}]), 0),
        ({"metadata": {"name": "cpu"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}, 0),
        (node("many"), 0),
    ],
)
def test_a_node_counts_its_allocatable_gpus_only_when_ready_and_schedulable(body: dict, gpus: int) -> None:
    assert node_gpus(body) == gpus


def test_the_default_selector_is_the_cold_pool_label_and_the_constant_is_gone() -> None:
    assert DEFAULT_COLD_POOL_SELECTOR == "elastune.dev/pool=cold"
    s = OperatorSettings.from_env({"ELASTUNE_REDIS_URL": "redis://r"})
    assert s.cold_pool_node_selector == "elastune.dev/pool=cold"
    s = OperatorSettings.from_env(
        {"ELASTUNE_REDIS_URL": "redis://r", "ELASTUNE_COLD_POOL_NODE_SELECTOR": "gpu in (a100,h100)"}
    )
    assert s.cold_pool_node_selector == "gpu in (a100,h100)"


# -- against the API emulator --------------------------------------------------------------------------


class Nodes:
    """kubectl-like helpers over Node objects, written the way a kubelet registers its node."""

    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)

    def add(self, name: str, gpus: int, labels: dict[str, str] | None = None, ready: str = "True") -> None:
        self.core.create_node({"metadata": {"name": name, "labels": COLD if labels is None else labels}})
        self.status(name, gpus=gpus, ready=ready)

    def status(self, name: str, *, gpus: int | None = None, ready: str | None = None) -> None:
        patch: dict[str, Any] = {}
        if gpus is not None:
            patch["allocatable"] = {"nvidia.com/gpu": str(gpus), "cpu": "8"}
        if ready is not None:
            patch["conditions"] = [{"type": "Ready", "status": ready}]
        self.core.patch_node_status(name, {"status": patch})

    def cordon(self, name: str, unschedulable: bool = True) -> None:
        self.core.patch_node(name, {"spec": {"unschedulable": unschedulable}})

    def label(self, name: str, labels: dict[str, str | None]) -> None:
        self.core.patch_node(name, {"metadata": {"labels": labels}})

    def delete(self, name: str) -> None:
        self.core.delete_node(name)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[client.ApiClient]:
    handle = start_emulator(tmp_path / "emulator")
    try:
        yield config.new_client_from_config(config_file=str(handle.kubeconfig_path))
    finally:
        handle.stop()


class Seen:
    def __init__(self) -> None:
        self.values: list[int] = []
        self.changed = threading.Condition()

    def __call__(self, gpus: int) -> None:
        with self.changed:
            self.values.append(gpus)
            self.changed.notify_all()

    def wait(self, gpus: int, timeout: float = 10.0) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: self.values and self.values[-1] == gpus, timeout):
                raise AssertionError(f"cold pool never reached {gpus} GPUs; saw {self.values}")


def reader(api: client.ApiClient, seen: Callable[[int], None], **kw: Any) -> NodeCapacity:
    cap = NodeCapacity(api, DEFAULT_COLD_POOL_SELECTOR, seen, watch_s=2, **kw)
    cap.start()
    return cap


def test_capacity_follows_nodes_as_they_come_go_and_change(api: client.ApiClient) -> None:
    nodes = Nodes(api)
    nodes.add("gpu-a", 4)
    nodes.add("gpu-b", 2)
    nodes.add("cpu-0", 8, labels={"kubernetes.io/os": "linux"})  # GPUs, but not in the cold pool
    nodes.add("gpu-new", 2, ready="False")  # registered, not Ready yet
    seen = Seen()
    cap = reader(api, seen)
    try:
        assert seen.values == [6], "the first list happens in start(), before any round is planned"
        nodes.cordon("gpu-b")
        seen.wait(4)
        nodes.status("gpu-new", ready="True")
        seen.wait(6)
        nodes.status("gpu-a", ready="Unknown")  # the kubelet stopped posting
        seen.wait(2)
        nodes.status("gpu-a", ready="True", gpus=3)  # back, with one GPU gone bad
        seen.wait(5)
        nodes.cordon("gpu-b", False)
        seen.wait(7)
        nodes.delete("gpu-a")
        seen.wait(4)
        nodes.label("cpu-0", {"elastune.dev/pool": "cold"})  # joins the pool: its GPUs count
        seen.wait(12)
        nodes.label("gpu-new", {"elastune.dev/pool": None})  # leaves the selection: as if deleted
        seen.wait(10)
        assert cap.total == 10 and cap.nodes == {"gpu-b": 2, "cpu-0": 8}
    finally:
        cap.stop()


def test_a_relist_corrects_what_the_watch_did_not_say(api: client.ApiClient) -> None:
    """Level-triggered: the state is listed again periodically, so the total is right even when an
    event was never applied (here: the reader's own view is corrupted behind its back)."""
    nodes = Nodes(api)
    nodes.add("gpu-a", 4)
    seen = Seen()
    cap = reader(api, seen, relist_s=1.0)
    try:
        cap.nodes["ghost"] = 8  # as if a DELETED event had been lost
        cap.total = 12
        seen.wait(4, timeout=15)
    finally:
        cap.stop()


def test_a_selector_the_apiserver_refuses_stops_the_start(api: client.ApiClient) -> None:
    cap = NodeCapacity(api, "elastune.dev/pool in (cold", lambda _: None)
    with pytest.raises(NodeSelectorError, match="refused by the apiserver"):
        cap.start()


def test_an_unreachable_apiserver_keeps_the_last_capacity(tmp_path: Path) -> None:
    handle = start_emulator(tmp_path / "emulator")
    api = config.new_client_from_config(config_file=str(handle.kubeconfig_path))
    Nodes(api).add("gpu-a", 4)
    seen = Seen()
    cap = reader(api, seen)
    try:
        assert cap.total == 4
        handle.stop()  # the apiserver goes away: that does not mean the nodes did
        time.sleep(3.0)
        assert cap.total == 4 and seen.values == [4]
    finally:
        cap.stop()


# -- the scheduler's plan never exceeds what the nodes give ---------------------------------------


def test_when_nodes_leave_nothing_more_is_planned_and_running_gpus_stay() -> None:
    # Both jobs need 24/A + 10 <= 22 -> A = 2 GPUs each.
    state = make_state(capacity=4, jobs=make_jobs(("a", 0, 22, 24)))
    pol = PromptTunerPolicy(make_estimator())
    d = pol.round(state, 0.0)
    assert d.launches == [Launch(LLM, 2)]
    apply(state, d, 0.0)
    state.set_capacity(1)  # three GPUs' nodes left: 2 are out, 1 in all
    assert state.cold_free == -1 and len(state.gpus) == 2  # the launched GPUs are not taken back
    state.submit(make_jobs(("b", 0, 22, 24))[0])
    assert pol.round(state, 0.0).launches == [], "planned GPUs the nodes do not have"
    state.set_capacity(4)  # the nodes came back
    assert pol.round(state, 0.0).launches == [Launch(LLM, 2)]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_policy_launches_beyond_a_shrunk_cold_pool(name: str) -> None:
    state = make_state(capacity=4)
    pol = make_policy(name, make_estimator())
    pol.admit(state, make_jobs(("a", 0, 22, 24))[0], 0.0)  # admit: INFless learns demand to pre-warm for
    apply(state, pol.round(state, 0.0), 0.0)
    out = len(state.gpus)
    assert out >= 1
    state.set_capacity(0)  # every node of the pool left
    for t, job in enumerate(("b", "c", "d")):
        pol.admit(state, make_jobs((job, float(t), 22, 24))[0], float(t))
        d = pol.round(state, float(t))
        assert not d.launches, f"{name} planned {d.launches} with no node left"
        apply(state, d, float(t))
    assert len(state.gpus) <= out
