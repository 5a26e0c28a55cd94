"""End to end on a real cluster (kind, see e2e/README.md): a WarmPool and a TuningJob from manifests/ go
all the way to an optimized prompt, and deleting them releases everything; a pool resized keeps its pods.
Each WarmPool's workers are one apps/v1 Deployment (label elastune.dev/warmpool=<pool>), owned by the
WarmPool: docs/operations/warm-pool-workload.md.

Skipped unless ELASTUNE_E2E_KUBECONFIG names a kubeconfig: the default `python3 -m pytest` only
collects tests/ (pyproject testpaths), and even `python3 -m pytest e2e` never touches a cluster it
was not pointed at. Uses kubectl (PATH or tools/k8s_binaries.py) and PyYAML only.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
KUBECONFIG = os.environ.get("ELASTUNE_E2E_KUBECONFIG", "")
NAMESPACE = os.environ.get("ELASTUNE_E2E_NAMESPACE", "default")
# The worker image setup-kind.sh loads (CPU torch); the manifest's tag by default.
WORKER_IMAGE = os.environ.get("ELASTUNE_E2E_WORKER_IMAGE", "")
JOB_TIMEOUT_S = float(os.environ.get("ELASTUNE_E2E_JOB_TIMEOUT", "900"))
# Secret and Redis Service of the chart installed as release "elastune" in NAMESPACE.
REDIS_URL = os.environ.get("ELASTUNE_E2E_REDIS_URL", f"redis://elastune-redis.{NAMESPACE}.svc:6379/0")
REDIS_SECRET = os.environ.get("ELASTUNE_E2E_REDIS_SECRET", "elastune-redis")
LABEL_WARM_POOL = "elastune.dev/warmpool"

pytestmark = pytest.mark.skipif(
    not KUBECONFIG, reason="set ELASTUNE_E2E_KUBECONFIG to a cluster prepared by e2e/setup-kind.sh"
)

T = TypeVar("T")


def _kubectl_binary() -> str:
    spec = importlib.util.spec_from_file_location(
        "elastune_tools_k8s_binaries", REPO / "tools" / "k8s_binaries.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.find_binary("kubectl"))


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [_kubectl_binary(), "--kubeconfig", KUBECONFIG, *args]
    result = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False, timeout=300)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


def get_json(*args: str) -> dict[str, Any] | None:
    result = kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        pytest.fail(result.stderr)
    return json.loads(result.stdout)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 5.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c.get("type") == kind), None)


def manifest(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "manifests" / name).read_text(encoding="utf-8"))
    doc["metadata"]["namespace"] = NAMESPACE
    return doc


def cpu_warm_pool() -> dict[str, Any]:
    """manifests/warmpool.yaml sized for one kind node: the node advertises fake nvidia.com/gpu capacity,
    so only CPU and memory shrink; the workers get the chart's Redis like the chart's example pool."""
    pool = copy.deepcopy(manifest("warmpool.yaml"))
    worker = pool["spec"]["worker"]
    worker["resources"]["requests"].update(cpu="500m", memory="1536Mi")
    worker["resources"]["limits"].update(memory="1536Mi")
    pool["spec"]["maxWarmGPUs"] = 2
    if WORKER_IMAGE:
        worker["image"] = WORKER_IMAGE
    worker["env"] = [e for e in worker["env"] if e["name"] == "HF_HUB_OFFLINE"] + [
        {"name": "ELASTUNE_REDIS_URL", "value": REDIS_URL},
        {
            "name": "ELASTUNE_REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": REDIS_SECRET, "key": "password"}},
        },
    ]
    return pool


def apply(doc: dict[str, Any]) -> None:
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))


def pool_deployments(selector: str) -> list[dict[str, Any]]:
    return (get_json("deployments", "-n", NAMESPACE, "-l", selector) or {}).get("items") or []


def check_pool_deployment(pool: dict[str, Any], deployments: list[dict[str, Any]]) -> None:
    """One Deployment per WarmPool, named and labelled after it, owned by it (deleting the pool deletes
    it), never more replicas than maxWarmGPUs, one GPU per pod."""
    assert len(deployments) == 1, [d["metadata"]["name"] for d in deployments]
    dep = deployments[0]
    assert dep["metadata"]["name"] == pool["metadata"]["name"]
    owners = dep["metadata"].get("ownerReferences") or []
    assert [(o["kind"], o["name"]) for o in owners] == [("WarmPool", pool["metadata"]["name"])], owners
    assert dep["spec"]["replicas"] <= pool["spec"]["maxWarmGPUs"], dep["spec"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1", container["resources"]


@pytest.fixture
def cluster_ready() -> Iterator[None]:
    for crd in ("tuningjobs.elastune.dev", "warmpools.elastune.dev", "loraadapters.elastune.dev"):
        assert get_json("crd", crd) is not None, f"CRD {crd} missing: run e2e/setup-kind.sh"
    yield


def test_tuning_job_end_to_end(cluster_ready: None) -> None:
    pool, job = cpu_warm_pool(), manifest("tuningjob.yaml")
    pool_name, job_name = pool["metadata"]["name"], job["metadata"]["name"]
    selector = f"{LABEL_WARM_POOL}={pool_name}"
    try:
        apply(pool)
        check_pool_deployment(
            pool, wait_for("the WarmPool's Deployment", lambda: pool_deployments(selector), 180)
        )

        apply(job)

        def succeeded() -> dict[str, Any] | None:
            current = get_json("tuningjob", job_name, "-n", NAMESPACE) or {}
            state = condition(current, "Succeeded")
            if state and state["status"] == "False":
                pytest.fail(f"TuningJob failed: {state.get('reason')}: {state.get('message')}")
            return current if state and state["status"] == "True" else None

        done = wait_for("the TuningJob's Succeeded condition", succeeded, timeout=JOB_TIMEOUT_S)
        status = done["status"]
        assert status.get("optimizedPrompt"), status
        assert status.get("iterations", 0) >= 1, status
        assert (condition(done, "Succeeded") or {}).get("reason"), status
    finally:
        # Deleting waits for the finalizers: a stuck finalizer fails the test here.
        kubectl("delete", "tuningjob", job_name, "-n", NAMESPACE, "--ignore-not-found", "--timeout=120s")
        kubectl("delete", "warmpool", pool_name, "-n", NAMESPACE, "--ignore-not-found", "--timeout=180s")

    # The finalizers released everything the pool and the job held.
    assert get_json("tuningjob", job_name, "-n", NAMESPACE) is None
    assert get_json("warmpool", pool_name, "-n", NAMESPACE) is None
    wait_for("the Deployment to go (owner reference)", lambda: not pool_deployments(selector) or None, 120)
    wait_for(
        "the worker pods to go",
        lambda: not (get_json("pods", "-n", NAMESPACE, "-l", selector) or {}).get("items") or None,
        timeout=180,
    )


def live_pod_uids(selector: str, ready: bool = False) -> set[str]:
    """UIDs of the pool's pods that are not terminating (and Ready, if asked)."""
    pods = (get_json("pods", "-n", NAMESPACE, "-l", selector) or {}).get("items") or []
    return {
        p["metadata"]["uid"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and (not ready or (condition(p, "Ready") or {}).get("status") == "True")
    }


def test_a_resized_pool_keeps_its_pods(cluster_ready: None) -> None:
    """Issue 37: a resize patches only the Deployment's replicas, so the ReplicaSet scales in place and
    the pods there stay (same UIDs); the pod template never changes. Grown by the WarmPool's floor,
    shrunk by its idle window returning the GPU once the floor drops (tests/cluster/test_warm_pool_resize.py
    drives it with TuningJobs in the pod world)."""
    pool = cpu_warm_pool()
    pool["metadata"]["name"] = "e2e-resize"
    pool["spec"].update(minWarmGPUs=1, idleWindow="5s")
    selector = f"{LABEL_WARM_POOL}=e2e-resize"

    def pods_when(n: int, ready: bool) -> set[str] | None:
        uids = live_pod_uids(selector, ready)
        return uids if len(uids) == n else None

    def template() -> Any:
        return (get_json("deployment", "e2e-resize", "-n", NAMESPACE) or {})["spec"]["template"]

    try:
        apply(pool)
        first = wait_for("the pool's first pod", lambda: pods_when(1, True), 600)
        before = template()
        pool["spec"]["minWarmGPUs"] = 2
        apply(pool)
        both = wait_for("a second pod", lambda: pods_when(2, True), 600)
        assert first <= both, "growing the pool replaced its pod"
        pool["spec"]["minWarmGPUs"] = 1
        apply(pool)
        left = wait_for("the pool back to one pod", lambda: pods_when(1, False), 300)
        assert left < both, "shrinking the pool replaced the pod it kept"
        assert template() == before, "a resize changed the pod template (that rolls every pod)"
    finally:
        kubectl("delete", "warmpool", "e2e-resize", "-n", NAMESPACE, "--ignore-not-found", "--timeout=180s")


GATEWAY_SERVICE = os.environ.get("ELASTUNE_E2E_GATEWAY_SERVICE", "elastune-gateway")


def serving_doc(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "manifests" / "serving" / name).read_text(encoding="utf-8"))
    doc["metadata"]["namespace"] = NAMESPACE
    return doc


def lora(name: str, path: str, rank: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"baseModel": "elastune/tiny-llama", "artifactURL": path}
    if rank is not None:
        spec["rank"] = rank
    meta = {"name": name, "namespace": NAMESPACE}
    return {"apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": meta, "spec": spec}


@pytest.fixture
def gateway_url() -> Iterator[str]:
    """The chart's gateway Service through kubectl port-forward."""
    port = 18000 + os.getpid() % 1000
    cmd = [_kubectl_binary(), "--kubeconfig", KUBECONFIG, "port-forward", "-n", NAMESPACE]
    cmd += [f"svc/{GATEWAY_SERVICE}", f"{port}:http"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()


E2E_API_KEY = "e2e-serving-key"


def _key_works(client: Any) -> bool | None:
    try:
        client.models.list()
    except Exception:
        return None
    return True


def test_serving_end_to_end(cluster_ready: None, gateway_url: str) -> None:
    """Issue 15 on a real cluster: a pool that scales from zero, LoRAAdapters of ranks 8 and 16 (built
    into the worker image under /app/adapters), one whose artifact does not exist, tune -> serve, and
    delete; requests through the chart's gateway with the openai client."""
    openai = pytest.importorskip("openai")
    pool, job = serving_doc("warmpool.yaml"), serving_doc("tuningjob.yaml")
    worker = pool["spec"].setdefault("worker", {})
    worker["resources"] = {"requests": {"cpu": "500m", "memory": "1536Mi"}, "limits": {"memory": "1536Mi"}}
    if WORKER_IMAGE:
        worker["image"] = WORKER_IMAGE
    job["spec"]["dataset"] = "data/person-city.jsonl"  # /app/data in the worker image
    job["spec"]["termination"]["maxIterations"] = 10
    adapters = [
        lora("e2e-units", "/app/adapters/tiny-llama-lora-r8-units", 8),
        lora("e2e-case", "/app/adapters/tiny-llama-lora-r16-case", 16),
        lora("e2e-missing", "/app/adapters/no-such-adapter", None),
    ]
    names = [a["metadata"]["name"] for a in adapters]
    published = job["spec"]["output"]["publish"]
    try:
        apply(pool)
        for a in adapters:
            apply(a)
        # The chart's gateway asks for a key: a Secret labelled elastune.dev/api-key in this namespace.
        apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": "e2e-key",
                    "namespace": NAMESPACE,
                    "labels": {"elastune.dev/api-key": "true"},
                },
                "stringData": {"key": E2E_API_KEY},
            }
        )
        client = openai.OpenAI(base_url=gateway_url, api_key=E2E_API_KEY, timeout=600, max_retries=0)
        wait_for("the key to be published", lambda: _key_works(client), 60)
        wait_for(
            "the gateway to list the adapters",
            lambda: "e2e-case" in {m.id for m in client.models.list()},
            120,
        )
        # Scaled to zero: the request waits in the gateway while the pool starts a pod.
        answer = client.completions.create(model="e2e-units", prompt="12 km →", max_tokens=6, temperature=0)
        assert answer.choices[0].text and answer.model == "e2e-units"

        def loaded(name: str) -> list[dict[str, Any]] | None:
            obj = get_json("loraadapter", name, "-n", NAMESPACE) or {}
            return obj.get("status", {}).get("loadedOn") or None

        for name in names[:2]:
            holders = wait_for(f"{name} loaded on a pod", functools.partial(loaded, name), 300)
            assert all(h["tier"] in ("device", "host") for h in holders), holders
        # The workers' load decides for paths only they see; the reason comes back on the resource.
        missing = wait_for(
            "the missing artifact's condition",
            lambda: (
                (condition(get_json("loraadapter", names[2], "-n", NAMESPACE) or {}, "Ready") or {}).get(
                    "reason"
                )
                in ("AdapterLoadFailed", "ArtifactNotFound")
                or None
            ),
            300,
        )
        assert missing

        apply(job)
        wait_for(
            "the published LoRAAdapter",
            lambda: get_json("loraadapter", published, "-n", NAMESPACE),
            JOB_TIMEOUT_S,
        )
        wait_for(
            "the published prompt listed", lambda: published in {m.id for m in client.models.list()}, 300
        )
        tuned = client.completions.create(
            model=published, prompt="name: dara; age: 48; city: turin →", max_tokens=4
        )
        assert tuned.model == published

        kubectl("delete", "loraadapter", "e2e-case", "-n", NAMESPACE, "--timeout=180s")
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="e2e-case", prompt="x", max_tokens=2)
    finally:
        for name in names:
            kubectl("delete", "loraadapter", name, "-n", NAMESPACE, "--ignore-not-found", "--timeout=180s")
        kubectl("delete", "tuningjob", job["metadata"]["name"], "-n", NAMESPACE, "--ignore-not-found")
        kubectl("delete", "secret", "e2e-key", "-n", NAMESPACE, "--ignore-not-found")
        kubectl("delete", "warmpool", pool["metadata"]["name"], "-n", NAMESPACE, "--ignore-not-found")
    # The published adapter goes with its job (owner reference).
    wait_for(
        "the published adapter to go with its job",
        lambda: get_json("loraadapter", published, "-n", NAMESPACE) is None or None,
        180,
    )
