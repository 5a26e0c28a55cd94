"""The workload backend: one apps/v1 Deployment per WarmPool, owned by it (DESIGN.md §5, §6).

- ``spec.replicas`` is the warm pool size Algorithm 2 decides (growing takes GPUs from the cold pool: the
  GPU nodes labelled ``elastune.dev/pool=cold``), bounded by ``maxWarmGPUs``. A resize patches only
  ``spec.replicas``: the pod template never changes on a resize, so the ReplicaSet scales in place and
  no existing pod (warm weights, a busy tuning job, loaded adapters) is replaced. Why a Deployment and
  not a Knative Service (a min-scale change there is a template change, i.e. a new Revision that replaces
  every pod): docs/operations/warm-pool-workload.md.
- One GPU per pod (``nvidia.com/gpu``), readiness = ``/readyz`` (runtime and weights loaded = warm).
- The ReplicaSet controller picks which pods go when replicas drop, and it does not know which are busy.
  Before lowering replicas the backend marks the pods the core chose (always idle) with a low
  ``controller.kubernetes.io/pod-deletion-cost`` and keeps busy pods at a high one; the ReplicaSet
  controller deletes the lowest cost first among ready running pods (kubernetes/kubernetes
  pkg/controller/controller_utils.go ``ActivePodsWithRanks``, used by
  pkg/controller/replicaset/replica_set.go ``getPodsToDelete``), so it removes exactly the idle ones.

Pods are named by Kubernetes; workers register under ``<namespace>/<pod name>`` (POD_NAMESPACE and
POD_NAME from the downward API: ``protocol.pod_worker_id``, since pod names repeat across namespaces), so
the core binds them like local workers; this backend speaks to the API by the pod name in that id. A
pod that cannot start or stay up (ImagePullBackOff, CrashLoopBackOff, OOMKilled, Unschedulable past its
grace: ``pod_status.py``) is reported through ``exited()`` under that id, from one list of the pools'
pods per namespace every few seconds. Workers take no traffic through a Service: the gateway reaches
them pod-direct at the addresses this backend vouches for, and holds requests while a pool scales from
zero.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_contract.api.constants import (
    DEFAULT_PVC_ROOT,
    DEFAULT_S3_SECRETS_ROOT,
    GROUP,
    LABEL_MODEL,
    LABEL_WARM_POOL,
    PVC_ROOT_ENV,
)
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.protocol import (
    pod_worker_id,
    pool_id,
    split_adapter_id,
    split_worker_id,
    vouched_address,
)
from elastune_operator.control.backend import WorkerExit
from elastune_operator.control.resources import worker_serving_args
from elastune_operator.k8s import model_fetch, request_key, worker_tls
from elastune_operator.k8s.pod_status import PodFailureRules, pod_failure
from elastune_operator.k8s.redis_users import PASSWORD_KEY, USERNAME_KEY, pool_secret_name

log = logging.getLogger("elastune.workload")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
COST_REMOVE = "-1000"
"""Pods the core released: removed first when replicas drop."""
COST_BUSY = "1000"
"""Pods running a job: removed last (never, as long as idle pods are released instead)."""
WORKER_PORT = 8080
WORKER_METRICS_PORT = 9091
"""The worker's /metrics (container port ``metrics``): apart from WORKER_PORT (``http``, the gateway's and
the operator's), as its series name every namespace's adapters on the pod; the NetworkPolicy admits only
Prometheus to it."""
DRAIN_MARGIN_S = 5
"""The worker's drain ends this long before the pod's grace period (ELASTUNE_DRAIN_SECONDS), so it exits
on its own before the kubelet's SIGKILL."""
WORKER_CONTROL_SECRET = "elastune-worker-control"
"""The Secret (key ``token``) the operator writes into each WarmPool namespace: the bearer token the
worker's control endpoints (adapter load/unload, /status) need. Distinct from any Redis credential."""
WORKER_CONTROL_KEY = "token"
WORKER_CONTROL_DIR = "/var/run/elastune/control"
POD_POLL_S = 2.0
"""At most one list of a namespace's pool pods this often (exited() is asked every 50 ms round)."""


@dataclass
class PoolRef:
    name: str
    namespace: str
    model: str
    uid: str = ""
    desired: int = 0
    spec: dict[str, Any] = field(default_factory=dict)


def worker_deployment(
    pool: WarmPool,
    desired: int,
    redis_url: str,
    redis_secret: str | None,
    secret_key: str = "password",
    s3_secrets: Collection[str] = (),
    redis_username: str | None = None,
    redis_user_secret: str | None = None,
) -> dict[str, Any]:
    """The Deployment of a WarmPool with ``desired`` warm GPUs (pods, bounded by maxWarmGPUs);
    ``s3_secrets``: the Secrets the pool's LoRAAdapters and TuningJobs name for s3:// artifacts;
    ``redis_user_secret``: the pool's own Redis user (k8s.redis_users), instead of ``redis_secret``."""
    name, ns = pool.metadata.name, pool.metadata.namespace or "default"
    template = worker_pod_template(
        pool, redis_url, redis_secret, secret_key, s3_secrets, redis_username, redis_user_secret
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": dict(template["metadata"]["labels"]),
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/v1alpha1",
                    "kind": "WarmPool",
                    "name": name,
                    "uid": pool.metadata.uid or "",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "replicas": min(desired, pool.spec.max_warm_gpus),
            "selector": {"matchLabels": {LABEL_WARM_POOL: name}},
            # A template change (image, serving flags, a new s3 Secret) restarts the pool: the old pods
            # release their GPUs before new ones ask for them (a surge would need GPUs the pool lacks).
            "strategy": {"type": "Recreate"},
            "template": template,
        },
    }


def worker_pod_template(
    pool: WarmPool,
    redis_url: str,
    redis_secret: str | None,
    secret_key: str = "password",
    s3_secrets: Collection[str] = (),
    redis_username: str | None = None,
    redis_user_secret: str | None = None,
) -> dict[str, Any]:
    """The worker pods of a WarmPool (the Deployment's ``spec.template``): independent of the pool's
    size, so a resize never changes it."""
    spec = pool.spec
    name = pool.metadata.name or ""
    given = (
        spec.worker.resources.model_dump(by_alias=True, exclude_none=True) if spec.worker.resources else {}
    )
    # Quantities as strings, as the apiserver returns them (YAML may give 1 or "1").
    resources = {part: {k: str(v) for k, v in values.items()} for part, values in given.items()}
    gpus = str(spec.gpus_per_pod)
    resources.setdefault("limits", {}).setdefault("nvidia.com/gpu", gpus)
    resources.setdefault("requests", {}).setdefault("nvidia.com/gpu", gpus)
    grace = spec.worker.termination_grace_period_seconds
    env: list[dict[str, Any]] = [
        {"name": "ELASTUNE_POOL", "value": name},
        {"name": "ELASTUNE_MODEL", "value": spec.model},
        {"name": "ELASTUNE_REDIS_URL", "value": redis_url},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        # The address the gateway and peers reach this pod at: the worker registers it (DESIGN §6).
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # Where pod_volumes mounts the claims; fixed so worker.env cannot move pvc:// elsewhere.
        {"name": PVC_ROOT_ENV, "value": DEFAULT_PVC_ROOT},
        {"name": "ELASTUNE_CONTROL_TOKEN_FILE", "value": f"{WORKER_CONTROL_DIR}/{WORKER_CONTROL_KEY}"},
        {"name": "PORT", "value": str(WORKER_PORT)},  # the port the worker binds (worker/server/app.py)
        {"name": "ELASTUNE_METRICS_PORT", "value": str(WORKER_METRICS_PORT)},  # its /metrics, only there
        # SIGTERM drains (worker/server/drain.py) within the pod's grace period, less a margin.
        {"name": "ELASTUNE_DRAIN_SECONDS", "value": str(grace - DRAIN_MARGIN_S)},
    ]
    if redis_user_secret:
        # The pool's own Redis user, confined to its keys; read at container start, so a rotation reaches
        # a pod when it restarts (its old password stays valid until then: k8s.redis_users).
        for var, key in (
            ("ELASTUNE_REDIS_USERNAME", USERNAME_KEY),
            ("ELASTUNE_REDIS_PASSWORD", PASSWORD_KEY),
        ):
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": redis_user_secret, "key": key}}})
    elif redis_secret:
        env.append(
            {
                "name": "ELASTUNE_REDIS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": redis_secret, "key": secret_key}},
            }
        )
    if (
        redis_username and not redis_user_secret
    ):  # the worker's Redis ACL user (the chart's bundled Redis: elastune-worker)
        env.append({"name": "ELASTUNE_REDIS_USERNAME", "value": redis_username})
    names = {e["name"] for e in env}
    env += [
        e.model_dump(by_alias=True, exclude_none=True) for e in spec.worker.env or [] if e.name not in names
    ]
    labels = {LABEL_WARM_POOL: name, LABEL_MODEL: _label_value(spec.model)}
    volumes, mounts = pod_volumes(pool)
    control = {"secretName": WORKER_CONTROL_SECRET, "items": [{"key": WORKER_CONTROL_KEY, "path": "token"}]}
    volumes.append({"name": "control-token", "secret": control})
    mounts.append({"name": "control-token", "mountPath": WORKER_CONTROL_DIR, "readOnly": True})
    for i, secret in enumerate(sorted(s3_secrets)):
        # optional: a Secret named wrong or not created yet must not keep the pool's pods from starting;
        # the worker reports StorageSecretNotFound on the resource instead.
        volumes.append({"name": f"s3-{i}", "secret": {"secretName": secret, "optional": True}})
        path = f"{DEFAULT_S3_SECRETS_ROOT}/{secret}"
        mounts.append({"name": f"s3-{i}", "mountPath": path, "readOnly": True})
    pod_spec: dict[str, Any] = {
        "containers": [
            {
                "name": "worker",
                "image": spec.worker.image,
                # The serving section as the engine's flags (vLLM's names), the same as `elastune serve`.
                "args": ["serve", *worker_serving_args(spec.serving)],
                "ports": [  # http first: the port Knative and the pod world take as the serving one
                    {"name": "http", "containerPort": WORKER_PORT},
                    {"name": "metrics", "containerPort": WORKER_METRICS_PORT},
                ],
                "env": env,
                "resources": resources,
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": WORKER_PORT}, "periodSeconds": 2},
                "livenessProbe": {"httpGet": {"path": "/healthz", "port": WORKER_PORT}, "periodSeconds": 10},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "runAsNonRoot": True,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        ],
        "terminationGracePeriodSeconds": grace,
        # A worker talks to Redis, never to the Kubernetes API: no ServiceAccount token in its pods.
        "automountServiceAccountToken": False,
    }
    if volumes:
        pod_spec["volumes"] = volumes
        pod_spec["containers"][0]["volumeMounts"] = mounts
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    model_fetch.add_to_worker(pod_spec, pool, WORKER_PORT)  # the model cache, offline load, startupProbe
    worker_tls.add_to_worker(pod_spec, WORKER_PORT, redis_url)  # Redis CA, HTTPS serving (k8s/worker_tls.py)
    return {"metadata": {"labels": labels}, "spec": pod_spec}


def pod_volumes(pool: WarmPool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The WarmPool's PersistentVolumeClaims as pod volumes and the worker container's mounts."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for i, v in enumerate(pool.spec.volumes or []):
        # Volume names are DNS labels of at most 63 characters; a claim name may be longer.
        vol = f"pvc-{i}"
        volumes.append(
            {"name": vol, "persistentVolumeClaim": {"claimName": v.claim_name, "readOnly": v.read_only}}
        )
        # Always where pvc://<claim>/... resolves; mountPath only adds a second mount of the claim.
        for path in dict.fromkeys([f"{DEFAULT_PVC_ROOT}/{v.claim_name}", v.mount_path or ""]):
            if path:
                mounts.append({"name": vol, "mountPath": path, "readOnly": v.read_only})
    return volumes, mounts


def _label_value(model: str) -> str:
    """A model name as a label value (63 chars of [A-Za-z0-9-_.])."""
    out = "".join(c if c.isalnum() or c in "-_." else "-" for c in model)[:63].strip("-_.")
    return out or "model"


class WorkloadBackend:
    """ClusterBackend over the Kubernetes API (sync client; runs in the control core's thread)."""

    def __init__(
        self,
        api_client: client.ApiClient,
        redis_url: str,
        redis_secret: str | None = None,
        secret_key: str = "password",
        redis_password: str | None = None,
        pod_rules: PodFailureRules | None = None,
        clock: Callable[[], float] = time.time,
        network_policy: dict[str, Any] | None = None,
        redis_username: str | None = None,
        pool_users: bool = False,
        request_secret: bytes | None = None,
    ) -> None:
        self.request_secret = request_secret
        """The gateway's request secret (request_key.py): each pool namespace gets its derived key."""
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.network_policy = network_policy
        self.redis_username = redis_username
        """The workers' Redis ACL user (ELASTUNE_REDIS_WORKER_USERNAME); ``redis_password`` is then its."""
        self.pool_users = pool_users
        """Each pool's pods use its own Redis user's Secret (k8s.redis_users): nothing shared is copied."""
        """``{"name", "ingress"}`` (ELASTUNE_WORKER_NETWORK_POLICY): written into each pool namespace."""
        self.redis_url = redis_url
        self.redis_secret = redis_secret
        self.secret_key = secret_key
        self.redis_password = redis_password
        self._secret_in: set[str] = set()  # namespaces whose Secret copy is written
        self._control_in: set[str] = set()  # namespaces whose worker control Secret exists
        self._request_key_in: set[str] = set()  # namespaces whose worker request key Secret exists
        self._redis_ca = worker_tls.redis_ca() if redis_url.startswith("rediss://") else None
        self._redis_ca_in: set[str] = set()  # namespaces whose Redis CA copy is written
        self._policy_in: set[str] = set()  # namespaces whose worker NetworkPolicy is written
        # Pools by ``protocol.pool_id`` (namespace/name: two namespaces may each have a WarmPool "tiny"),
        # the id the core names them by.
        self.pools: dict[str, tuple[WarmPool, int]] = {}  # pool id -> (resource, desired size)
        self.s3_secrets: dict[str, set[str]] = {}  # pool id -> Secrets its resources name for s3://
        self.pod_rules = pod_rules or PodFailureRules()
        self.clock = clock
        self._polled = float("-inf")  # clock of the last pod listing
        self._done: set[tuple[str, str]] = set()  # (namespace, pod) reported or released: not again
        self._failed: set[tuple[str, str]] = set()  # pods exited() reported
        self._releasing: dict[str, set[str]] = {}  # pool id -> failed pods released, still listed
        self._cap: dict[str, int] = {}  # pool id -> highest replicas while those pods are still there
        self._addresses: dict[str, dict[str, dict[str, str]]] = {}
        """namespace -> pool -> pod -> vouched address, from the last good listing of the namespace."""

    def register(self, pool: WarmPool, desired: int | None = None) -> int:
        """Create or update the pool's Deployment; returns the desired size in force (kept across
        operator restarts: it is read back from the Deployment's replicas)."""
        name, ns = pool.metadata.name or "", pool.metadata.namespace or "default"
        if desired is None:
            desired = self._current_replicas(name, ns)
        # Not raised to minWarmGPUs here: the core's scheduler launches the pool's minimum itself
        # (grow), so counting it here too started a pod nobody planned, and a later shrink by what the
        # scheduler knew took the Deployment below its busy pods.
        key = pool_id(ns, name)
        self.pools[key] = (pool, desired)
        if not self.pool_users:
            self.copy_redis_secret(ns)
        self.write_control_secret(ns)
        if self.request_secret is not None and ns not in self._request_key_in:
            request_key.write_secret(self.core, ns, self.request_secret)
            self._request_key_in.add(ns)
        if self._redis_ca is not None and ns not in self._redis_ca_in:
            worker_tls.write_redis_ca(self.core, ns, self._redis_ca)
            self._redis_ca_in.add(ns)
        self.write_network_policy(ns)
        self._apply(key)
        return desired

    def copy_redis_secret(self, ns: str) -> None:
        """Worker pods read the Redis password from a Secret in their own namespace (a pod cannot
        reference another namespace's Secret): write the operator's password under the Secret name the
        pods reference. Create, or patch when it exists (the chart's RBAC grants exactly create and
        get/patch of that one name); written once per namespace per operator run."""
        if not self.redis_secret or not self.redis_password or ns in self._secret_in:
            return
        data = {self.secret_key: base64.b64encode(self.redis_password.encode()).decode()}
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": self.redis_secret,
                "namespace": ns,
                "labels": {"app.kubernetes.io/managed-by": "elastune-operator"},
            },
            "type": "Opaque",
            "data": data,
        }
        try:
            self.core.create_namespaced_secret(ns, body)
            log.info("copied the Redis Secret %s into namespace %s", self.redis_secret, ns)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_namespaced_secret(self.redis_secret, ns, {"data": data})
        self._secret_in.add(ns)

    def write_control_secret(self, ns: str) -> None:
        """The worker control token of the pools of ``ns`` (their pods mount it): a random one, created
        once per namespace and kept (a 409 leaves the one there: rotating it means deleting the Secret and
        the pods). Per namespace, so one tenant's token opens no other tenant's workers; create is all
        the operator needs (it never reads the token back)."""
        if ns in self._control_in:
            return
        token = secrets.token_urlsafe(32)
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": WORKER_CONTROL_SECRET,
                "namespace": ns,
                "labels": {"app.kubernetes.io/managed-by": "elastune-operator"},
            },
            "type": "Opaque",
            "data": {WORKER_CONTROL_KEY: base64.b64encode(token.encode()).decode()},
        }
        try:
            self.core.create_namespaced_secret(ns, body)
            log.info("wrote the worker control Secret %s into namespace %s", WORKER_CONTROL_SECRET, ns)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self._control_in.add(ns)

    def write_network_policy(self, ns: str) -> None:
        """Cluster-wide installs: only the gateway, the operator and Prometheus (the chart's list) reach
        the worker pods of ``ns``. Create, or patch the one there (the chart's RBAC grants get/patch of
        that one name); once per namespace per operator run."""
        if self.network_policy is None or ns in self._policy_in:
            return
        name = self.network_policy["name"]
        body = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {"app.kubernetes.io/managed-by": "elastune-operator"},
            },
            "spec": {
                "podSelector": {"matchExpressions": [{"key": LABEL_WARM_POOL, "operator": "Exists"}]},
                "policyTypes": ["Ingress"],
                "ingress": self.network_policy["ingress"],
            },
        }
        try:
            self.networking.create_namespaced_network_policy(ns, body)
            log.info("wrote the worker NetworkPolicy %s into namespace %s", name, ns)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.networking.patch_namespaced_network_policy(name, ns, {"spec": body["spec"]})
        self._policy_in.add(ns)

    def use_s3_secret(self, pool: str, secret: str) -> None:
        """Mount ``secret`` (its name only: the operator never reads it) into the pool's pods; a new one
        changes the pod template, so the Deployment rolls the pool once to add it."""
        if pool in self.pools and secret not in self.s3_secrets.setdefault(pool, set()):
            self.s3_secrets[pool].add(secret)
            self._apply(pool)

    def unregister(self, name: str) -> None:
        """``name``: the pool's id (namespace/name)."""
        """The WarmPool is gone; its Deployment goes with it through the owner reference."""
        self.pools.pop(name, None)

    def grow(self, pool: str, model: str, count: int) -> None:
        wp, desired = self.pools[pool]
        self.pools[pool] = (wp, desired + count)
        self._scale(pool)

    def shrink(self, pool: str, worker_ids: list[str]) -> None:
        if pool not in self.pools:
            return  # the WarmPool is gone, and its Deployment with it
        wp, desired = self.pools[pool]
        ns = wp.metadata.namespace or "default"
        failed = 0
        for pod in (split_worker_id(w)[1] for w in worker_ids):
            self.mark(ns, pod, COST_REMOVE)
            self._done.add((ns, pod))
            # No longer vouched for: its READY record outlives the pod a while, and the fleet would bind
            # it again as a new GPU, then shrink it a second time when it goes (one replica too few,
            # taken from a busy pod). The gateway stops sending it requests too.
            self._addresses.get(ns, {}).get(wp.metadata.name or "", {}).pop(pod_worker_id(ns, pod), None)
            if (ns, pod) in self._failed:
                self._releasing.setdefault(pool, set()).add(pod)
                failed += 1
        self.pools[pool] = (wp, max(0, desired - len(worker_ids)))
        if failed:
            # The ReplicaSet removes the cheapest pod only when replicas really drop: a job still
            # waiting grows the pool back at once, and at an unchanged size the failed pod would stay,
            # never replaced nor reported again (its job waiting forever). Replicas stay this far below
            # what ran (bounded by maxWarmGPUs) until the failed pods are gone (exited() sees them go),
            # then follow the pool again.
            ran = min(desired, wp.spec.max_warm_gpus, self._cap.get(pool, desired))
            self._cap[pool] = max(0, ran - failed)
        self._scale(pool)

    def mark(self, namespace: str, pod: str, cost: str | None) -> None:
        """Set (or clear) a pod's deletion cost; a pod already gone is fine."""
        body = {"metadata": {"annotations": {DELETION_COST: cost}}}
        try:
            self.core.patch_namespaced_pod(pod, namespace, body)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def mark_busy(self, pool: str, worker_ids: list[str], busy: bool) -> None:
        wp, _ = self.pools[pool]
        for wid in worker_ids:
            self.mark(
                wp.metadata.namespace or "default", split_worker_id(wid)[1], COST_BUSY if busy else None
            )

    def exited(self) -> dict[str, WorkerExit]:
        """Pool pods whose status says they will not become or stay workers, each reported once (the
        core then shrinks the pool by them, so the ReplicaSet removes them). Deleted pods are not listed:
        they stop heartbeating and the registry TTL tells the core."""
        now = self.clock()
        if now - self._polled < POD_POLL_S:
            return {}
        self._polled = now
        pools: dict[str, dict[str, str]] = {}  # namespace -> pool name -> model
        for wp, _ in self.pools.values():
            pools.setdefault(wp.metadata.namespace or "default", {})[wp.metadata.name or ""] = wp.spec.model
        out: dict[str, WorkerExit] = {}
        for ns in set(self._addresses) - set(pools):
            del self._addresses[ns]  # its last pool went
        for ns, models in pools.items():
            try:
                # Raw JSON: the status exactly as the API spells it, and no model objects to build.
                resp: Any = self.core.list_namespaced_pod(  # an HTTP response without preloading
                    ns, label_selector=LABEL_WARM_POOL, _preload_content=False
                )
                pods = json.loads(resp.data).get("items") or []
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                log.warning("cannot list the worker pods of namespace %s: %s", ns, exc)
                continue
            listed = set()
            addresses: dict[str, dict[str, str]] = {}
            self._addresses[ns] = addresses
            for pod in pods:
                meta = pod.get("metadata") or {}
                key = (ns, meta.get("name", ""))
                listed.add(key)
                pool_name = (meta.get("labels") or {}).get(LABEL_WARM_POOL, "")
                model = models.get(pool_name)
                if model is not None and key not in self._done and (address := _pod_address(pod)) is not None:
                    addresses.setdefault(pool_name, {})[pod_worker_id(ns, key[1])] = address
                if model is None or key in self._done or meta.get("deletionTimestamp"):
                    continue  # not a pool of ours, already told, or going anyway
                failure = pod_failure(pod, now, self.pod_rules)
                if failure is not None:
                    reason, detail = failure
                    log.warning("worker pod %s/%s: %s", ns, key[1], detail)
                    out[pod_worker_id(ns, key[1])] = WorkerExit(model, detail, reason, pool_id(ns, pool_name))
                    self._done.add(key)
                    self._failed.add(key)
            self._done = {k for k in self._done if k[0] != ns or k in listed}
            self._failed = {k for k in self._failed if k[0] != ns or k in listed}
            for key in [k for k in self._releasing if split_adapter_id(k) in ((ns, n) for n in models)]:
                self._releasing[key] = {p for p in self._releasing[key] if (ns, p) in listed}
                if not self._releasing[key]:  # the failed pods are gone: the pool's own size again
                    del self._releasing[key]
                    self._cap.pop(key, None)
                    self._scale(key)
        return out

    def vouched(self) -> dict[str, dict[str, str]]:
        """The pods of each pool as the API lists them (``namespace/pod``, the id its worker registers
        under -> pod IP and worker port), refreshed with exited()'s listing: the gateway forwards only to
        these, so a worker credential that rewrites another worker's registry record cannot redirect its
        traffic. A namespace whose listing fails keeps its last good view; a pool never listed yet
        has none (its requests wait, rather than go to an address nobody vouched for)."""
        out: dict[str, dict[str, str]] = {}
        for key, (wp, _) in self.pools.items():
            ns = wp.metadata.namespace or "default"
            out[key] = dict(self._addresses.get(ns, {}).get(wp.metadata.name or "", {}))
        return out

    def close(self) -> None:
        pass

    # -- internals ----------------------------------------------------------------------------------
    def _current_replicas(self, name: str, ns: str) -> int:
        try:
            dep: Any = self.apps.read_namespaced_deployment(name, ns, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return 0
            raise
        try:
            return int((json.loads(dep.data).get("spec") or {}).get("replicas") or 0)
        except ValueError:
            return 0

    def _replicas(self, key: str) -> int:
        _, desired = self.pools[key]
        return min(desired, self._cap.get(key, desired))

    def _apply(self, key: str) -> None:
        """Create the pool's Deployment, or bring the one there to its template and size."""
        wp, _ = self.pools[key]
        ns, name = wp.metadata.namespace or "default", wp.metadata.name or ""
        body = worker_deployment(
            wp, self._replicas(key), self.redis_url, self.redis_secret, self.secret_key,
            self.s3_secrets.get(key, ()), redis_username=self.redis_username,
            redis_user_secret=pool_secret_name(name) if self.pool_users else None,
        )  # fmt: skip
        if self.request_secret is not None:  # its inference routes then serve only the gateway
            request_key.add_to_pod(body["spec"]["template"]["spec"])
        try:
            self.apps.create_namespaced_deployment(ns, body)
            log.info("created Deployment %s/%s (%d replicas)", ns, name, body["spec"]["replicas"])
        except ApiException as exc:
            if exc.status != 409:
                raise
            patch = {"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]}
            self.apps.patch_namespaced_deployment(name, ns, patch)
            log.info("Deployment %s/%s: %d replicas", ns, name, body["spec"]["replicas"])

    def _scale(self, key: str) -> None:
        """A resize: only ``spec.replicas`` changes (the template stays, so no pod is replaced)."""
        wp, _ = self.pools[key]
        ns, name = wp.metadata.namespace or "default", wp.metadata.name or ""
        replicas = min(self._replicas(key), wp.spec.max_warm_gpus)
        try:
            self.apps.patch_namespaced_deployment(name, ns, {"spec": {"replicas": replicas}})
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._apply(key)  # deleted under us: write it whole again
            return
        log.info("Deployment %s/%s: %d replicas", ns, name, replicas)


def _pod_address(pod: dict[str, Any]) -> str | None:
    """Where the pod's worker serves (its IP, the worker port), for a running pod that is not going;
    None otherwise. The worker advertises status.podIP (the downward API) and binds $PORT (the
    container port, set in the pod template)."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if status.get("phase") != "Running" or not ip or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    return vouched_address(str(ip), WORKER_PORT)
