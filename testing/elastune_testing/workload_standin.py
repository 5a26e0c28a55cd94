"""A stand-in for the Deployment + ReplicaSet controllers, for tests and benchmarks without a cluster.

It watches the WarmPool Deployments the operator creates (through the Kubernetes API, e.g. the emulator),
keeps ``spec.replicas`` worker pods of each running — a Pod object in the API plus a local worker process
registered under the pod's name, exactly as a pod would; each pod gets an address of its own on the
loopback network (127.x.y.z, status.podIP, Running) where its worker serves on the pods' port 8080, so
the operator vouches for it as for a real pod — and, when replicas drop, removes pods the way the
ReplicaSet controller does among ready running pods: lowest ``controller.kubernetes.io/pod-deletion-cost``
first, then the newest (kubernetes/kubernetes pkg/controller/controller_utils.go ActivePodsWithRanks).
Every removal is recorded with the state its worker reported at that moment, so a test can prove that a
scale-down never took a busy worker. Template changes are not rolled here (the pod world's Deployments
controller does that, with real pods).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from dataclasses import dataclass, field

from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_common.bus import Bus
from elastune_contract.api.constants import LABEL_WARM_POOL
from elastune_contract.protocol import pod_worker_id
from elastune_operator.k8s.workload import DELETION_COST, WORKER_PORT
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
class WorkloadStandIn:
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
        self._thread = threading.Thread(target=self._loop, name="workload-standin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        apps, core = client.AppsV1Api(self.api_client), client.CoreV1Api(self.api_client)
        while not self._stop.wait(self.period):
            try:
                deployments = apps.list_deployment_for_all_namespaces(_preload_content=False)
                for dep in json.loads(deployments.data).get("items", []):
                    if LABEL_WARM_POOL in ((dep.get("metadata") or {}).get("labels") or {}):
                        self._reconcile(core, dep)
            except Exception as exc:  # keep going: the API may be briefly unavailable in tests
                log.warning("stand-in round failed: %s", exc)

    def _reconcile(self, core: client.CoreV1Api, dep: dict) -> None:
        meta, template = dep["metadata"], dep["spec"]["template"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        want = int(dep["spec"].get("replicas", 1))
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
            # Registered as POD_NAMESPACE/POD_NAME, as the pod template's downward API env makes it.
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
    127.0.0.1 so a worker on the pods' port cannot clash with anything else listening there."""
    return f"127.{secrets.randbelow(200) + 20}.{secrets.randbelow(256)}.{secrets.randbelow(253) + 2}"
