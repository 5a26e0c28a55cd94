"""Why a worker pod will not become, or stay, a worker: one pod's status read the way
``kubectl describe pod`` shows it, as ``(reason, detail)`` or None while the pod may still come up.

Pure (the pod as the API's JSON, the time passed in) so that every status shape is tested without a
cluster; the Knative backend lists the pools' pods and reports what this finds through
``ClusterBackend.exited()``, and the control core fails or retries the attempt with that reason.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastune_contract.vocabulary import Reason

DETAIL_MAX = 1000
"""Condition messages stay readable (an image pull error can carry a registry's whole answer)."""

_CANNOT_START: Mapping[str, str] = {
    # The kubelet alternates between the two while it backs off: one reason for both.
    Reason.IMAGE_PULL_BACK_OFF: Reason.IMAGE_PULL_BACK_OFF,
    "ErrImagePull": Reason.IMAGE_PULL_BACK_OFF,
    Reason.INVALID_IMAGE_NAME: Reason.INVALID_IMAGE_NAME,
    Reason.CREATE_CONTAINER_CONFIG_ERROR: Reason.CREATE_CONTAINER_CONFIG_ERROR,
    Reason.CREATE_CONTAINER_ERROR: Reason.CREATE_CONTAINER_ERROR,
}
"""Waiting reasons of a container that cannot be started: reported at once. A registry outage is
retried too, but as a fresh pod counted against the core's max_attempts, not as a silent wait."""


@dataclass(frozen=True)
class PodFailureRules:
    unschedulable_grace_s: float = 60.0
    """A pod the scheduler cannot place fails after this long (from its PodScheduled=False
    transition): the cluster autoscaler may add a node meanwhile."""
    max_restarts: int = 1
    """Container restarts after which the pod is failing. One: a worker whose process restarted has
    lost its registration and any attempt it ran, so there is no harmless restart to wait out."""


def pod_failure(
    pod: Mapping[str, Any], now: float, rules: PodFailureRules = PodFailureRules()
) -> tuple[str, str] | None:
    """The reason (vocabulary constant) and a detail naming the pod, or None for a healthy pod or one
    still inside its grace. A pod being deleted is not judged here (the caller skips it)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name", "?")
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for c in containers:
        waiting = (c.get("state") or {}).get("waiting") or {}
        reason = _CANNOT_START.get(waiting.get("reason") or "")
        if reason is not None:
            image = f", image {c['image']}" if c.get("image") else ""
            what = f"{waiting['reason']} (container {c.get('name', '?')}{image})"
            return reason, _detail(name, what, waiting.get("message"))
    for c in containers:
        last = (c.get("lastState") or {}).get("terminated") or (c.get("state") or {}).get("terminated") or {}
        if last.get("reason") == Reason.OOM_KILLED:
            what = f"OOMKilled (container {c.get('name', '?')}, {_termination(last, c)})"
            return Reason.OOM_KILLED, _detail(name, what, last.get("message"))
    if status.get("phase") == "Failed":
        ended = next((t for c in containers if (t := (c.get("state") or {}).get("terminated"))), None)
        why = status.get("reason") or (ended or {}).get("reason") or "Failed"
        tail = f", container exit code {ended.get('exitCode')}" if ended else ""
        return Reason.POD_FAILED, _detail(name, f"pod failed: {why}{tail}", status.get("message"))
    for c in containers:
        state = c.get("state") or {}
        waiting = state.get("waiting") or {}
        last = (c.get("lastState") or {}).get("terminated") or state.get("terminated") or {}
        # A container that exited now, or backs off before its next start, counts as a restart already.
        restarts = int(c.get("restartCount") or 0)
        if state.get("terminated") or waiting.get("reason") == Reason.CRASH_LOOP_BACK_OFF:
            restarts = max(restarts, 1)
        if restarts >= rules.max_restarts and (last or waiting.get("reason") == Reason.CRASH_LOOP_BACK_OFF):
            doing = waiting.get("reason") or ("exited" if state.get("terminated") else "restarted")
            what = f"{doing} (container {c.get('name', '?')}, {_termination(last, c)})"
            message = waiting.get("message") or last.get("message")
            return Reason.CRASH_LOOP_BACK_OFF, _detail(name, what, message)
    for cond in status.get("conditions") or []:
        if cond.get("type") != "PodScheduled" or cond.get("status") != "False":
            continue
        if cond.get("reason") != Reason.UNSCHEDULABLE:
            continue
        since = _time(cond.get("lastTransitionTime")) or _time(meta.get("creationTimestamp")) or now
        if now - since >= rules.unschedulable_grace_s:
            what = f"Unschedulable for {now - since:.0f} s"
            return Reason.UNSCHEDULABLE, _detail(name, what, cond.get("message"))
    return None


def _termination(last: Mapping[str, Any], container: Mapping[str, Any]) -> str:
    n = int(container.get("restartCount") or 0)
    return (
        f"exit code {last.get('exitCode', '?')}, last termination {last.get('reason') or '?'}, "
        f"{n} restart{'' if n == 1 else 's'}"
    )


def _detail(pod: str, what: str, message: str | None) -> str:
    text = f"pod {pod}: {what}" + (f": {message.strip()}" if message and message.strip() else "")
    return text if len(text) <= DETAIL_MAX else text[: DETAIL_MAX - 1] + "…"


def _time(value: Any) -> float | None:
    """An RFC 3339 timestamp of the API (``2026-11-26T10:00:00Z``) as epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()
