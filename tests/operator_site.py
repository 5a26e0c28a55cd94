"""The operator's runtime (control core + workload backend) in the test's process, against the Kubernetes
API emulator over HTTP and a real Redis, driven as kopf's handlers drive it (``upsert_pool``,
``submit_job``, ``upsert_adapter``); the test plays the worker side of the protocol, so no torch runs.

The emulator and Redis outlive the operator: ``restart()`` stops the runtime and starts a fresh one on
the same bus namespace, as an operator pod restart does. Used by the operator-level tests of durable
storage, intent before effect and namespace isolation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from elastune_common.bus import Bus
from elastune_contract.api.constants import (
    GROUP,
    LABEL_WARM_POOL,
    PLURAL_LORA_ADAPTERS,
    PLURAL_TUNING_JOBS,
    PLURAL_WARM_POOLS,
    VERSION,
)
from elastune_contract.protocol import WorkerRecord, WorkerState
from elastune_operator.k8s.runtime import Runtime
from elastune_operator.k8s.settings import OperatorSettings
from elastune_testing.emulator import start_emulator
from elastune_testing.nodes import add_gpu_node

API_VERSION = f"{GROUP}/{VERSION}"
NS = "default"
MODEL = "test/model"
KINDS = {PLURAL_WARM_POOLS: "WarmPool", PLURAL_TUNING_JOBS: "TuningJob", PLURAL_LORA_ADAPTERS: "LoRAAdapter"}


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def job_spec(model: str = MODEL, **extra: Any) -> dict[str, Any]:
    """A valid TuningJob spec that never consults the Prompt Bank."""
    return {
        "model": model, "dataset": "/data/train.jsonl", "termination": {"maxIterations": 20},
        "deadline": "10m", "promptBank": "never", **extra,
    }  # fmt: skip


class OperatorSite:
    def __init__(self, tmp: Path, redis_url: str, bus_prefix: str, model: str = MODEL) -> None:
        self.tmp, self.redis_url, self.model = tmp, redis_url, model
        self.emulator = start_emulator(tmp / "emulator")
        self.api = config.new_client_from_config(config_file=str(self.emulator.kubeconfig_path))
        self.custom = client.CustomObjectsApi(self.api)
        self.bus = Bus(redis_url, f"{bus_prefix}{time.time_ns()}")
        add_gpu_node(self.api, "gpu-node-0", 2)  # the cold pool the runtime counts (k8s.node_capacity)
        self._runtimes: list[Runtime] = []
        self._pods: list[str] = []
        self.runtime = self.restart()

    def restart(self) -> Runtime:
        for old in self._runtimes:
            old.stop()
        settings = OperatorSettings(
            redis_url=self.redis_url,
            redis_secret=None,
            work_dir=self.tmp / "pod-tmp",  # the pods' /tmp: what must never hold a user's artifact
            metrics_port=0,
            namespace=self.bus.ns,
        )
        self.runtime = Runtime(settings, self.api, bus=Bus(self.redis_url, self.bus.ns))
        self.runtime.start()
        self._runtimes.append(self.runtime)
        return self.runtime

    def close(self) -> None:
        for rt in self._runtimes:
            rt.stop()
        self.emulator.stop()

    # -- the API, as a user with kubectl sees it ---------------------------------------------------------
    def create(
        self, plural: str, name: str, spec: dict[str, Any], ns: str = NS, **metadata: Any
    ) -> dict[str, Any]:
        meta = {"name": name, "namespace": ns, **metadata}
        body = {"apiVersion": API_VERSION, "kind": KINDS[plural], "metadata": meta, "spec": spec}
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, plural, body
        )
        return created

    def get(
        self, plural: str, name: str, ns: str = NS, group: str = GROUP, version: str = VERSION
    ) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.custom.get_namespaced_custom_object(group, version, ns, plural, name)
            return found
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def status(self, name: str, plural: str = PLURAL_TUNING_JOBS, ns: str = NS) -> dict[str, Any]:
        return (self.get(plural, name, ns) or {}).get("status") or {}

    def conditions(
        self, name: str, plural: str = PLURAL_TUNING_JOBS, ns: str = NS
    ) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in self.status(name, plural, ns).get("conditions", [])}

    def condition(
        self, name: str, ctype: str, plural: str = PLURAL_TUNING_JOBS, ns: str = NS
    ) -> dict[str, Any] | None:
        return self.conditions(name, plural, ns).get(ctype)

    # -- objects handed to the runtime as kopf's handlers would ------------------------------------------
    def pool(self, name: str, ns: str = NS, **spec: Any) -> dict[str, Any]:
        body = self.create(PLURAL_WARM_POOLS, name, {"model": self.model, "maxWarmGPUs": 2, **spec}, ns)
        self.runtime.upsert_pool(body)
        return body

    def job(self, name: str, ns: str = NS, submit: bool = True, **spec: Any) -> dict[str, Any]:
        body = self.create(PLURAL_TUNING_JOBS, name, job_spec(self.model, **spec), ns)
        if submit:
            self.runtime.submit_job(body)
        return body

    def adapter(self, name: str, ns: str = NS, **spec: Any) -> dict[str, Any]:
        full = {"baseModel": self.model, "artifactURL": f"pvc://shared/adapters/{name}", "rank": 8, **spec}
        body = self.create(PLURAL_LORA_ADAPTERS, name, full, ns)
        self.runtime.upsert_adapter(body)
        return body

    # -- the worker side of the protocol -----------------------------------------------------------------
    def ready_worker(self, pod: str, pool: str, ns: str = NS) -> str:
        """A running pod of the pool (what the Deployment and the kubelet would make) and its worker's READY
        record at the pod's address, as a worker pod registers (``<namespace>/<pod>``): the control plane
        counts only records of pods it lists (issue 39 item 1). Returns the worker id."""
        wid, url = self.add_pod(pod, pool, ns)
        now = time.time()
        self.bus.publish_worker(
            WorkerRecord(
                id=wid, pool=pool, model=self.model, state=WorkerState.READY, url=url,
                started_at=now - 3, ready_at=now, heartbeat=now,
            )
        )  # fmt: skip
        return wid

    def add_pod(self, pod: str, pool: str, ns: str = NS) -> tuple[str, str]:
        """A running pod of the pool in the API: (the id its worker registers under, the URL at its IP)."""
        core = client.CoreV1Api(self.api)
        ip = f"10.9.0.{len(self._pods) + 1}"
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns, "labels": {LABEL_WARM_POOL: pool}},
            "spec": {"containers": [{"name": "worker", "image": "ghcr.io/elastune/worker:0.1.0"}]},
        }  # fmt: skip
        core.create_namespaced_pod(ns, body)
        core.patch_namespaced_pod_status(pod, ns, {"status": {"phase": "Running", "podIP": ip}})
        self._pods.append(pod)
        return f"{ns}/{pod}", f"http://{ip}:8080"
