"""The controllers a cluster runs besides the kubelet, as far as Elastune's objects need them.

- `Deployments`: a Deployment keeps ``replicas`` Pods from its template (owned by it, so deleting the
  Deployment removes them); a changed template (its whole hash) replaces them (Recreate, what the
  chart's Deployments and the operator's WarmPool Deployments ask for); a replicas change scales in place
  and a scale-down removes pods in the ReplicaSet controller's order (`deletion_order`).
- `KnativeServices`: a Knative Service held to Knative's rules (``knative_rules``: webhook validation, a
  new Revision for any template change, min-/max-scale), with what Knative adds to the user container
  (``PORT``, ``K_SERVICE``, ``K_REVISION``). Not emulated: the activator and the request-driven
  autoscaler. Elastune no longer writes Knative Services; the rules' tests show why.
- `Services`: a ClusterIP Service gets a stable address on the node and a TCP proxy there that forwards
  each connection to a Ready Pod its selector matches (kube-proxy's job); pods resolve its name through
  their /etc/hosts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_testing.knative_rules import KnativeConfig, WebhookDenied, admit, revision_hash, scale_bounds
from elastune_testing.podworld.kubelet import Kubelet
from elastune_testing.podworld.network import PodNetwork

log = logging.getLogger("elastune.podworld.controllers")
KNATIVE = ("serving.knative.dev", "v1", "services")
MIN_SCALE = "autoscaling.knative.dev/min-scale"
MAX_SCALE = "autoscaling.knative.dev/max-scale"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
TEMPLATE_HASH = "pod-template-hash"


def _raw(resp: Any) -> Any:
    return json.loads(resp.data)


def _hash(template_spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template_spec, sort_keys=True).encode()).hexdigest()[:10]


def _owner(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


@dataclass
class _Controller:
    api: client.ApiClient
    period_s: float = 0.3
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.apps = client.AppsV1Api(self.api)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.round()
            except Exception:  # level-triggered: the next round retries
                log.exception("%s round failed", type(self).__name__)

    def round(self) -> None:
        raise NotImplementedError

    def _pods(self, namespace: str, owner_uid: str) -> list[dict[str, Any]]:
        pods = _raw(self.core.list_namespaced_pod(namespace, _preload_content=False))["items"]
        return [
            p for p in pods
            if any(o.get("uid") == owner_uid for o in p["metadata"].get("ownerReferences") or [])
            and not p["metadata"].get("deletionTimestamp")
        ]  # fmt: skip

    def _create_pod(
        self, owner: dict[str, Any], name: str, template: dict[str, Any], extra_labels: dict[str, str]
    ) -> None:
        meta = template.get("metadata") or {}
        body: Any = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": owner["metadata"].get("namespace", "default"),
                "labels": {**(meta.get("labels") or {}), **extra_labels},
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [_owner(owner)],
            },
            "spec": template["spec"],
        }
        self.core.create_namespaced_pod(body["metadata"]["namespace"], body)

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        try:
            self.core.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"])
        except ApiException as exc:
            if exc.status != 404:
                raise


@dataclass
class Removal:
    pod: str
    deletion_cost: int


class Deployments(_Controller):
    """apps/v1 Deployments as the Deployment and ReplicaSet controllers keep them: the pods' template is
    named by a hash of the whole ``spec.template`` (labels and annotations included, as
    ``pod-template-hash`` is), so a changed template rolls to new pods (Recreate: the old go first); a
    ``replicas`` change scales the current pods in place, and a scale-down removes them in
    `deletion_order`. ``removals`` records each pod a scale-down took, with its deletion cost."""

    removals: list[Removal]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.removals = []

    def round(self) -> None:
        for dep in _raw(self.apps.list_deployment_for_all_namespaces(_preload_content=False))["items"]:
            dep.setdefault("apiVersion", "apps/v1")
            dep.setdefault("kind", "Deployment")
            ns, name = dep["metadata"].get("namespace", "default"), dep["metadata"]["name"]
            template = dep["spec"]["template"]
            h = _hash(template)
            pods = self._pods(ns, dep["metadata"]["uid"])
            stale = [p for p in pods if p["metadata"].get("labels", {}).get(TEMPLATE_HASH) != h]
            for p in stale:  # Recreate: the old template's pods go before new ones start
                self._delete_pod(p)
            current = [p for p in pods if p not in stale]
            want = int(dep["spec"].get("replicas", 1))
            for _ in range(want - len(current)):
                self._create_pod(dep, f"{name}-{h[:8]}-{secrets.token_hex(3)}", template, {TEMPLATE_HASH: h})
            if len(current) > want:  # a replicas change scales in place: no pod of the template is replaced
                for p in deletion_order(current)[: len(current) - want]:
                    self.removals.append(Removal(p["metadata"]["name"], _cost(p)))
                    self._delete_pod(p)


class KnativeServices(_Controller):
    """Knative Serving held to its own rules (``knative_rules``): a Service its webhook would refuse gets
    no pods (the denial is kept in ``denials``); a Revision is the whole ``spec.template``, so any change
    there (an annotation too) replaces every pod with the new Revision's; ``min-scale``/``max-scale``
    read as the autoscaler reads them. Elastune no longer writes Knative Services (its WarmPools are
    Deployments: docs/operations/warm-pool-workload.md); this stays to show why."""

    removals: list[Removal]
    config: KnativeConfig

    def __post_init__(self) -> None:
        super().__post_init__()
        self.removals = []
        self.config = KnativeConfig()
        self.denials: dict[tuple[str, str], WebhookDenied] = {}

    def round(self) -> None:
        services = _raw(self.custom.list_cluster_custom_object(*KNATIVE, _preload_content=False))["items"]
        for svc in services:
            self._reconcile(svc)

    def _reconcile(self, svc: dict[str, Any]) -> None:
        ns, name = svc["metadata"].get("namespace", "default"), svc["metadata"]["name"]
        try:
            svc = admit(svc, self.config)
        except WebhookDenied as denied:
            self.denials[(ns, name)] = denied
            return
        self.denials.pop((ns, name), None)
        template = svc["spec"]["template"]
        low, high = scale_bounds((template.get("metadata") or {}).get("annotations") or {})
        want = low if high is None else min(low, high)
        pod_template = self._pod_template(name, template)
        revision = revision_hash(template)  # the whole template: annotations make Revisions too
        pods = self._pods(ns, svc["metadata"]["uid"])
        stale = [p for p in pods if p["metadata"]["labels"].get("serving.knative.dev/revision") != revision]
        for p in stale:  # the old Revision scales to zero: its pods go, whatever they were doing
            self._delete_pod(p)
        current = [p for p in pods if p not in stale]
        labels = {"serving.knative.dev/service": name, "serving.knative.dev/revision": revision}
        for _ in range(want - len(current)):
            self._create_pod(svc, f"{name}-{revision[:5]}-deployment-{secrets.token_hex(3)}",
                             pod_template, labels)  # fmt: skip
        if len(current) > want:
            for p in deletion_order(current)[: len(current) - want]:
                self.removals.append(Removal(p["metadata"]["name"], _cost(p)))
                self._delete_pod(p)

    @staticmethod
    def _pod_template(name: str, template: dict[str, Any]) -> dict[str, Any]:
        spec = json.loads(json.dumps(template["spec"]))
        timeout = spec.pop("timeoutSeconds", None)
        if timeout is not None:  # Knative: the revision's timeout bounds the pod's grace period
            spec.setdefault("terminationGracePeriodSeconds", int(timeout))
        for c in spec["containers"]:
            port = (c.get("ports") or [{"containerPort": 8080}])[0]["containerPort"]
            own = {"PORT": str(port), "K_SERVICE": name, "K_CONFIGURATION": name, "K_REVISION": name}
            c["env"] = [e for e in c.get("env") or [] if e["name"] not in own] + [
                {"name": k, "value": v} for k, v in own.items()
            ]
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                get = (c.get(probe) or {}).get("httpGet")
                if get is not None:  # Knative probes the user container's port when none is given
                    get.setdefault("port", port)
        return {"metadata": template.get("metadata") or {}, "spec": spec}


def _cost(pod: dict[str, Any]) -> int:
    try:
        return int((pod["metadata"].get("annotations") or {}).get(DELETION_COST, "0"))
    except ValueError:
        return 0


_PHASE_ORDINAL = {"Pending": 0, "Unknown": 1, "Running": 2}


def _ready_since(pod: dict[str, Any]) -> tuple[bool, str]:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True", str(cond.get("lastTransitionTime") or "")
    return False, ""


def deletion_order(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods in the order the ReplicaSet controller deletes them on a scale-down (kubernetes/kubernetes
    pkg/controller/replicaset/replica_set.go ``getPodsToDelete`` sorts ``ActivePodsWithRanks`` of
    pkg/controller/controller_utils.go): unassigned before assigned; Pending < Unknown < Running; not
    ready before ready; lower ``controller.kubernetes.io/pod-deletion-cost`` first; more of the
    ReplicaSet's pods on the same node first; ready for less time first; more restarts first; newer
    first. Not emulated: LogarithmicScaleDown's log2 age buckets and their UID tie-break."""
    on_node: dict[str, int] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName") or ""
        on_node[node] = on_node.get(node, 0) + 1

    def key(p: dict[str, Any]) -> tuple[Any, ...]:
        node = (p.get("spec") or {}).get("nodeName") or ""
        status = p.get("status") or {}
        ready, since = _ready_since(p)
        restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
        return (
            bool(node),
            _PHASE_ORDINAL.get(status.get("phase", ""), 0),
            ready,
            _cost(p),
            -on_node[node] if node else 0,
            _neg_time(since) if ready else "",
            -restarts,
            _neg_time(p["metadata"].get("creationTimestamp") or ""),
        )

    return sorted(pods, key=key)


def _neg_time(ts: str) -> str:
    """Sort key for 'newest first' on RFC 3339 timestamps (same length, so string order works)."""
    return "".join(chr(0x10FFFF - ord(c)) for c in ts)


@dataclass
class _Listener:
    server: asyncio.AbstractServer
    target: Callable[[], tuple[str, int] | None]


class Services(_Controller):
    """ClusterIP Services: an address each on the node, a proxy per port to a Ready pod."""

    kubelet: Kubelet
    network: PodNetwork
    on_change: Callable[[], None]

    def __init__(self, api: client.ApiClient, kubelet: Kubelet, network: PodNetwork,
                 on_change: Callable[[], None]) -> None:  # fmt: skip
        super().__init__(api)
        self.kubelet, self.network, self.on_change = kubelet, network, on_change
        self.addresses: dict[tuple[str, str], str] = {}  # (namespace, name) -> clusterIP
        self._listeners: dict[tuple[str, str, int], _Listener] = {}
        self._specs: dict[tuple[str, str], dict[str, Any]] = {}
        self._next: dict[tuple[str, str], int] = {}
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="podworld-proxy", daemon=True)
        self._loop_thread.start()

    def stop(self) -> None:
        super().stop()

        async def close() -> None:
            for listener in self._listeners.values():
                listener.server.close()
            # Connections still forwarding end here, on their own loop: left pending, their cleanup
            # (closing each stream) would run at garbage collection, on a closed loop.
            conns = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in conns:
                task.cancel()
            await asyncio.gather(*conns, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(5)
        if not self._loop_thread.is_alive():
            self.loop.close()

    def hosts(self, namespace: str) -> str:
        lines = []
        for (ns, name), addr in sorted(self.addresses.items()):
            names = [f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}.svc", f"{name}.{ns}"]
            if ns == namespace:
                names.append(name)
            lines.append(f"{addr}\t{' '.join(names)}\n")
        return "".join(lines)

    def round(self) -> None:
        changed = False
        for svc in _raw(self.core.list_service_for_all_namespaces(_preload_content=False))["items"]:
            key = (svc["metadata"].get("namespace", "default"), svc["metadata"]["name"])
            spec = svc.get("spec") or {}
            if spec.get("clusterIP") == "None" or not spec.get("selector"):
                continue  # headless or selector-less: nothing to proxy
            self._specs[key] = svc
            if key not in self.addresses:
                self.addresses[key] = self.network.service_address()
                changed = True
            for port in spec.get("ports") or []:
                lkey = (*key, int(port["port"]))
                if lkey not in self._listeners:
                    self._listen(key, port)
        if changed:
            self.on_change()

    def _listen(self, key: tuple[str, str], port: dict[str, Any]) -> None:
        addr = self.addresses[key]

        def target() -> tuple[str, int] | None:
            svc = self._specs[key]
            selector = svc["spec"]["selector"]
            ready = [
                p for p in list(self.kubelet.pods.values())
                if p.namespace == key[0] and p.ready and p.ip and not p.stopping
                and all((p.obj["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            ]  # fmt: skip
            if not ready:
                return None
            n = self._next.get(key, 0)
            self._next[key] = n + 1
            pod = ready[n % len(ready)]
            want = port.get("targetPort", port["port"])
            container = pod.obj["spec"]["containers"][0]
            if isinstance(want, str) and not want.isdigit():
                named = [p["containerPort"] for p in container.get("ports") or [] if p.get("name") == want]
                if not named:
                    return None
                want = named[0]
            return pod.ip, int(want)

        async def start() -> asyncio.AbstractServer:
            return await asyncio.start_server(lambda r, w: _pipe(r, w, target), addr, int(port["port"]))

        server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self._listeners[(*key, int(port["port"]))] = _Listener(server, target)
        log.info("service %s/%s at %s:%s", key[0], key[1], addr, port["port"])


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: Callable[[], tuple[str, int] | None]
) -> None:
    """Forward one connection (no Ready endpoint: refused, as kube-proxy's REJECT rule does)."""
    dest = target()
    if dest is None:
        writer.close()
        return
    try:
        up_r, up_w = await asyncio.open_connection(*dest)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_copy(reader, up_w), _copy(up_r, writer), return_exceptions=True)


async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while chunk := await src.read(65536):
            dst.write(chunk)
            await dst.drain()
    finally:
        dst.close()
