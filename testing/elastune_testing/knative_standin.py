"""A stand-in for Knative Serving + the ReplicaSet controller, for tests and benchmarks without a cluster.

It watches the Knative Services the operator creates (through the Kubernetes API, e.g. the emulator),
keeps ``min-scale`` worker pods of each running — a Pod object in the API plus a local worker process
registered under the pod's name, exactly as a pod would; each pod gets an address of its own on the
loopback network (127.x.y.z, status.podIP, Running) where its worker serves on Knative's port 8080, so
the operator vouches for it as for a real pod — and, when min-scale drops, removes pods the
way the ReplicaSet controller does: lowest ``controller.kubernetes.io/pod-deletion-cost`` first, then
the newest. Every removal is recorded with the state its worker reported at that moment, so a test can
prove that a scale-down never took a busy worker.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field

from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_common.bus import Bus
from elastune_contract.protocol import pod_worker_id
from elastune_operator.k8s.knative import (
    DELETION_COST,
    KNATIVE_GROUP,
    KNATIVE_PLURAL,
    KNATIVE_VERSION,
    MIN_SCALE,
    WORKER_PORT,
)
from elastune_operator.local.backend import LocalBackend

log = logging.getLogger("elastune.standin")


@dataclass
class Removal:
    pod: str
    worker_state: str | None
    """The worker's registry state when it was picked (None: never registered)."""
    deletion_cost: int


@dataclass
class _Pod:
    name: str
    namespace: str
    service: str
    order: int
    removed: bool = False


@dataclass
class KnativeStandIn:
    api_client: client.ApiClient
    bus: Bus
    backend: LocalBackend
    period: float = 0.2
    removals: list[Removal] = field(default_factory=list)
    pods: dict[str, _Pod] = field(default_factory=dict)
    _order: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="knative-standin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        custom, core = client.CustomObjectsApi(self.api_client), client.CoreV1Api(self.api_client)
        while not self._stop.wait(self.period):
            try:
                services = custom.list_cluster_custom_object(KNATIVE_GROUP, KNATIVE_VERSION, KNATIVE_PLURAL)
                for svc in services.get("items", []):
                    self._reconcile(core, svc)
            except Exception as exc:  # keep going: the API may be briefly unavailable in tests
                log.warning("stand-in round failed: %s", exc)

    def _reconcile(self, core: client.CoreV1Api, svc: dict) -> None:
        meta, template = svc["metadata"], svc["spec"]["template"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        want = int((template.get("metadata") or {}).get("annotations", {}).get(MIN_SCALE, "0"))
        mine = [p for p in self.pods.values() if p.service == name and p.namespace == ns and not p.removed]
        container = template["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        pool = env.get("ELASTUNE_POOL") or name
        # The container's args after the `serve` subcommand: the pool's engine flags, as a pod gets them.
        self.backend.pool_args[pool] = list(container.get("args") or [])[1:]
        for _ in range(want - len(mine)):
            self._order += 1
            pod = f"{name}-{secrets.token_hex(3)}"
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod,
                    "namespace": ns,
                    "labels": dict(template["metadata"].get("labels", {})),
                },
                "spec": {
                    "containers": [{"name": "worker", "image": template["spec"]["containers"][0]["image"]}]
                },
            }
            core.create_namespaced_pod(ns, body)
            ip = _pod_ip()
            core.patch_namespaced_pod_status(pod, ns, {"status": {"phase": "Running", "podIP": ip}})
            self.pods[pod] = _Pod(pod, ns, name, self._order)
            # Registered as POD_NAMESPACE/POD_NAME, as the Knative Service's downward API env makes it.
            wid = pod_worker_id(ns, pod)
            self.backend.start_worker(wid, pool, env["ELASTUNE_MODEL"], host=ip, port=WORKER_PORT)
        if len(mine) > want:
            costs = {p.name: self._cost(core, p) for p in mine}
            # ReplicaSet controller: lower deletion cost first, then the newest pod.
            victims = sorted(mine, key=lambda p: (costs[p.name], -p.order))[: len(mine) - want]
            records = self.bus.workers()
            for p in victims:
                rec = records.get(pod_worker_id(p.namespace, p.name))
                self.removals.append(Removal(p.name, rec.state.value if rec else None, costs[p.name]))
                p.removed = True
                try:
                    core.delete_namespaced_pod(p.name, p.namespace)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                self.backend.shrink(name, [pod_worker_id(p.namespace, p.name)])

    @staticmethod
    def _cost(core: client.CoreV1Api, pod: _Pod) -> int:
        try:
            obj = core.read_namespaced_pod(pod.name, pod.namespace)
        except ApiException:
            return 0
        raw = (obj.metadata.annotations or {}).get(DELETION_COST)
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0


def _pod_ip() -> str:
    """A loopback address of its own for a pod (all of 127.0.0.0/8 reaches this host), away from
    127.0.0.1 so a worker on Knative's port cannot clash with anything else listening there."""
    return f"127.{secrets.randbelow(200) + 20}.{secrets.randbelow(256)}.{secrets.randbelow(253) + 2}"
