"""Worker pod status read as the kubelet and the scheduler write it (elastune_operator.k8s.pod_status):
each failing shape gives its reason and a detail that says what happened; healthy pods, and pods still
inside their grace, give None. Pure: pods are the API's JSON."""

from __future__ import annotations

from typing import Any

import pytest

from elastune_contract.vocabulary import Reason
from elastune_operator.k8s.pod_status import DETAIL_MAX, PodFailureRules, pod_failure

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
CREATED = "2027-01-15T07:59:00Z"  # 60 s before NOW


def pod(phase: str = "Running", *, containers: list[dict[str, Any]] | None = None, **status: Any) -> dict:
    return {
        "metadata": {"name": "pool-abc12", "creationTimestamp": CREATED},
        "status": {"phase": phase, "containerStatuses": containers or [], **status},
    }


def container(state: dict[str, Any], restarts: int = 0, last: dict[str, Any] | None = None) -> dict:
    c: dict[str, Any] = {"name": "worker", "image": "elastune/worker:1", "restartCount": restarts}
    c["state"] = state
    c["lastState"] = {"terminated": last} if last else {}
    return c


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"waiting": {"reason": reason, "message": message}}


def unschedulable(since: str) -> dict[str, Any]:
    return {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        "lastTransitionTime": since,
    }


def test_a_healthy_running_pod_is_no_failure() -> None:
    ready = container({"running": {"startedAt": CREATED}})
    conditions = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]
    assert pod_failure(pod(containers=[ready], conditions=conditions), NOW) is None
    # Starting: scheduled, container creating (pulling a large image takes long and is no failure).
    creating = container(waiting("ContainerCreating"))
    assert pod_failure(pod("Pending", containers=[creating]), NOW) is None
    assert pod_failure({"metadata": {"name": "bare"}}, NOW) is None


@pytest.mark.parametrize(
    ("kubelet", "reason"),
    [
        ("ImagePullBackOff", Reason.IMAGE_PULL_BACK_OFF),
        ("ErrImagePull", Reason.IMAGE_PULL_BACK_OFF),
        ("InvalidImageName", Reason.INVALID_IMAGE_NAME),
        ("CreateContainerConfigError", Reason.CREATE_CONTAINER_CONFIG_ERROR),
        ("CreateContainerError", Reason.CREATE_CONTAINER_ERROR),
    ],
)
def test_a_container_that_cannot_start_fails_at_once(kubelet: str, reason: str) -> None:
    msg = 'Back-off pulling image "elastune/worker:nope"'
    got = pod_failure(pod("Pending", containers=[container(waiting(kubelet, msg))]), NOW)
    assert got is not None
    assert got[0] == reason
    assert got[1] == f"pod pool-abc12: {kubelet} (container worker, image elastune/worker:1): {msg}"


def test_a_crash_loop_names_the_exit_code_and_the_back_off() -> None:
    last = {"exitCode": 1, "reason": "Error", "finishedAt": CREATED}
    msg = "back-off 10s restarting failed container=worker pod=pool-abc12_ns(u-1)"
    c = container(waiting("CrashLoopBackOff", msg), restarts=1, last=last)
    assert pod_failure(pod(containers=[c]), NOW) == (
        Reason.CRASH_LOOP_BACK_OFF,
        "pod pool-abc12: CrashLoopBackOff (container worker, exit code 1, last termination Error, "
        f"1 restart): {msg}",
    )


def test_restarts_below_the_threshold_are_tolerated_when_asked() -> None:
    last = {"exitCode": 1, "reason": "Error"}
    c = container({"running": {}}, restarts=2, last=last)
    assert pod_failure(pod(containers=[c]), NOW, PodFailureRules(max_restarts=3)) is None
    c["restartCount"] = 3
    got = pod_failure(pod(containers=[c]), NOW, PodFailureRules(max_restarts=3))
    assert got is not None and got[0] == Reason.CRASH_LOOP_BACK_OFF and "restarted" in got[1]
    # By default any restart counts: the restarted worker lost whatever it ran.
    c["restartCount"] = 1
    assert pod_failure(pod(containers=[c]), NOW) is not None


def test_oom_killed_is_reported_with_that_reason_even_running_again() -> None:
    last = {"exitCode": 137, "reason": "OOMKilled"}
    got = pod_failure(pod(containers=[container({"running": {}}, restarts=1, last=last)]), NOW)
    assert got is not None
    assert got[0] == Reason.OOM_KILLED
    assert got[1].startswith("pod pool-abc12: OOMKilled (container worker, exit code 137")
    # Also a pod that has not restarted (yet): its container's current state is the termination.
    now_dead = container({"terminated": last}, restarts=0)
    assert pod_failure(pod(containers=[now_dead]), NOW, PodFailureRules(max_restarts=5)) == (
        Reason.OOM_KILLED,
        "pod pool-abc12: OOMKilled (container worker, exit code 137, last termination OOMKilled, 0 restarts)",
    )


def test_a_failed_pod_says_why() -> None:
    got = pod_failure(
        pod(
            "Failed",
            reason="Evicted",
            message="The node was low on resource: ephemeral-storage.",
            containers=[container({"terminated": {"exitCode": 137, "reason": "Error"}})],
        ),
        NOW,
    )
    assert got == (
        Reason.POD_FAILED,
        "pod pool-abc12: pod failed: Evicted, container exit code 137: "
        "The node was low on resource: ephemeral-storage.",
    )


def test_unschedulable_fails_only_after_its_grace() -> None:
    inside = pod("Pending", conditions=[unschedulable("2027-01-15T07:59:30Z")])  # 30 s ago
    assert pod_failure(inside, NOW) is None
    assert pod_failure(inside, NOW + 29) is None
    assert pod_failure(inside, NOW + 30) == (
        Reason.UNSCHEDULABLE,
        "pod pool-abc12: Unschedulable for 60 s: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    )
    assert pod_failure(inside, NOW, PodFailureRules(unschedulable_grace_s=10)) is not None
    # Without a transition time the pod's age counts; a scheduled pod is not judged by this rule.
    cond = unschedulable("")
    assert pod_failure(pod("Pending", conditions=[cond]), NOW) is not None
    assert pod_failure(pod("Pending", conditions=[{**cond, "status": "True"}]), NOW + 999) is None


def test_init_containers_count_and_long_messages_are_cut() -> None:
    status = {"initContainerStatuses": [container(waiting("ErrImagePull", "x" * 5000))]}
    got = pod_failure(pod("Pending", **status), NOW)
    assert got is not None and got[0] == Reason.IMAGE_PULL_BACK_OFF
    assert len(got[1]) == DETAIL_MAX and got[1].endswith("…")
