"""The cold pool's capacity, read from the cluster's Node objects (DESIGN.md §6: "the cold pool is the
GPUs the cluster's nodes report, not a constant").

The cold pool is the sum of ``status.allocatable["nvidia.com/gpu"]`` over the nodes a label selector
names (the chart's ``operator.coldPool.nodeSelector``; default ``elastune.dev/pool=cold``, the label
e2e/setup-kind.sh puts on the GPU node), counting only nodes a pod could be placed on now. Which nodes
those are follows kubernetes/autoscaler, cluster-autoscaler/utils/kubernetes/ready.go
(``IsNodeReadyAndSchedulable`` / ``GetReadinessState``): a node counts when it has a ``Ready``
condition with status True, no ``NetworkUnavailable`` condition that is True, and ``spec.unschedulable``
unset (cordoned nodes take no new pods: kube-scheduler's NodeUnschedulable plugin). Allocatable, not
capacity: it is what the scheduler fits pod requests against (capacity minus what the kubelet reserves).

Followed level-triggered, as an informer does: one list, then a watch from the list's resourceVersion;
the watch is re-opened every ``watch_s`` and the whole set is listed again every ``relist_s`` (a missed
deletion cannot survive a relist), or at once after a 410 Gone. An API error keeps the last known
capacity (an unreachable apiserver does not mean the nodes left) and retries with back-off.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity

log = logging.getLogger("elastune.operator.nodes")

GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource NVIDIA's device plugin advertises; the worker pods request it (values.yaml)."""


class NodeSelectorError(ValueError):
    """The apiserver refused the label selector (400): a setting to fix, not something to retry."""


def node_gpus(node: Mapping[str, Any], resource: str = GPU_RESOURCE) -> int:
    """GPUs ``node`` (a Node as the API serves it) adds to the cold pool: its allocatable ``resource``
    when it is Ready and schedulable, else 0."""
    if (node.get("spec") or {}).get("unschedulable"):
        return 0
    status = node.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if conditions.get("Ready") != "True" or conditions.get("NetworkUnavailable") == "True":
        return 0  # no Ready condition at all counts as not ready (GetReadinessState)
    raw = (status.get("allocatable") or {}).get(resource)
    if raw is None:
        return 0
    try:
        # Extended resources are whole numbers (the apiserver refuses fractions); floor to be safe.
        return max(0, math.floor(parse_quantity(str(raw))))
    except ValueError:
        log.warning("node %s: %s=%r is not a quantity; counted as 0", _name(node), resource, raw)
        return 0


def _name(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name", ""))


class NodeCapacity:
    """Follows the selected nodes and calls ``on_change(total_gpus)`` whenever the total changes (and
    once after the first list)."""

    def __init__(
        self,
        api_client: client.ApiClient,
        selector: str,
        on_change: Callable[[int], None],
        *,
        resource: str = GPU_RESOURCE,
        watch_s: int = 10,
        relist_s: float = 60.0,
    ) -> None:
        self.core = client.CoreV1Api(api_client)
        self.selector, self.resource = selector, resource
        self.on_change = on_change
        self.watch_s, self.relist_s = watch_s, relist_s
        self.nodes: dict[str, int] = {}  # node name -> GPUs it counts for now
        self.total: int | None = None  # None until the first list succeeded
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """List once now, so the first scheduling round plans on the nodes there are; a selector the
        apiserver refuses raises NodeSelectorError. Any other error is retried in the background."""
        rv: str | None = None
        try:
            rv = self._list()
        except NodeSelectorError:
            raise
        except Exception as exc:  # ApiException (403: RBAC), or the apiserver unreachable
            log.error("cannot list nodes (%s): the cold pool counts 0 GPUs until it can", _why(exc))
        self._thread = threading.Thread(target=self._run, args=(rv,), name="elastune-nodes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()  # takes effect at the next event; the watch times out within watch_s
        if self._thread is not None:
            self._thread.join(0.5)

    # -- reading ------------------------------------------------------------------------------------
    def _list(self) -> str:
        try:
            resp: Any = self.core.list_node(label_selector=self.selector, _preload_content=False)
        except ApiException as exc:
            if exc.status == 400:
                raise NodeSelectorError(
                    f"cold pool node selector {self.selector!r} refused by the apiserver: {exc.body or exc}"
                ) from exc
            raise
        body = json.loads(resp.data)
        self.nodes = {_name(n): node_gpus(n, self.resource) for n in body.get("items") or []}
        self._publish()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _apply(self, event: Mapping[str, Any]) -> str | None:
        """One watch event (its ``raw_object``: the Node as the API serves it); returns the
        resourceVersion to resume from."""
        kind, obj = event.get("type"), event.get("raw_object") or {}
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "DELETED":
            self.nodes.pop(_name(obj), None)
        elif kind in ("ADDED", "MODIFIED"):
            self.nodes[_name(obj)] = node_gpus(obj, self.resource)
        # BOOKMARK: only moves the resourceVersion on.
        self._publish()
        return str(rv) if rv else None

    def _publish(self) -> None:
        total = sum(self.nodes.values())
        if total != self.total and not self._stop.is_set():
            log.info(
                "cold pool: %d %s on %d of %d nodes selected by %r",
                total,
                self.resource,
                sum(1 for g in self.nodes.values() if g),
                len(self.nodes),
                self.selector,
            )
            self.total = total
            self.on_change(total)

    def _run(self, rv: str | None) -> None:
        backoff = 1.0
        next_list = 0.0 if not rv else _now() + self.relist_s
        while not self._stop.is_set():
            try:
                if not rv or _now() >= next_list:
                    rv = self._list()
                    next_list = _now() + self.relist_s
                self._watch = watch.Watch()
                stream = self._watch.stream(
                    self.core.list_node,
                    label_selector=self.selector,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=self.watch_s,
                )
                for event in stream:
                    if self._stop.is_set():
                        break
                    rv = self._apply(event) or rv
                backoff = 1.0
            except Exception as exc:  # ApiException, connection errors: keep the last total, retry
                rv = None
                if isinstance(exc, ApiException) and exc.status == 410:
                    continue  # our resourceVersion left the apiserver's window: list again now
                log.warning("watching nodes failed (%s); keeping %s GPUs, retrying", _why(exc), self.total)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)


def _now() -> float:
    return time.monotonic()


def _why(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"
