"""Warm pools that stay warm (issue 37 item 2), with real worker pods of the chart's operator.

The pool is resized the way users resize it: a TuningJob whose deadline the pool's one busy pod cannot
meet grows it (Algorithm 2 takes a GPU from the cold pool), and the WarmPool's short idleWindow returns
a GPU that went idle. The operator patches only the Deployment's ``spec.replicas``; the pod world's
Deployments controller keeps ReplicaSet semantics (a template change rolls the pods, a replicas change
does not; a scale-down removes pods in the ReplicaSet controller's order, deletion cost included).

The shrink is arranged so that the ReplicaSet controller's default order and the scheduler disagree: the
pod the scheduler releases is the *older* one (idle longest), the pod it keeps is the newer one, busy
with a job. Without the operator's ``controller.kubernetes.io/pod-deletion-cost`` the controller would
take the newer pod (ready for less time first) and kill the running job.
docs/operations/warm-pool-workload.md.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from typing import Any

from kubernetes import client as k8s
from openai import OpenAI
from test_tuning_path import CLAIM, DATA, claim, condition, custom_object, job_status, tuning_job

from conftest import API_KEY, MODEL, RELEASE_NAMESPACE, TENANT, gateway_url, warm_pool
from elastune_operator.k8s.workload import COST_BUSY, COST_REMOVE, DELETION_COST
from elastune_testing.podworld import PodWorld

POOL = "resize"
SELECTOR = f"elastune.dev/warmpool={POOL}"
LONG_ITERATIONS = 1500
"""The first job (on the first pod): runs while the pool grows and the second pod starts."""
WIDE_ITERATIONS = 1500
"""The second job (on the pod the pool grew by): still running when the first pod is released."""


def pool_pods(world: PodWorld) -> dict[str, str]:
    """name -> uid of the pool's pods that are not going."""
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in world.pods(TENANT, SELECTOR)
        if not p["metadata"].get("deletionTimestamp")
    }


def wait_for(what: str, check: Any, timeout: float, diagnose: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {diagnose() if diagnose else ''}")
        time.sleep(0.5)
    return value


def loaded_on(world: PodWorld, adapter: str) -> dict[str, str]:
    """The pods (names) status.loadedOn says hold ``adapter``, each with when it was first seen there."""
    obj: Any = k8s.CustomObjectsApi(world.api).get_namespaced_custom_object(
        "elastune.dev", "v1alpha1", TENANT, "loraadapters", adapter
    )
    held = (obj.get("status") or {}).get("loadedOn") or []
    return {h["pod"].rsplit("/", 1)[-1]: h.get("since", "") for h in held}


def running_on(world: PodWorld, job: str) -> set[str]:
    st = job_status(world, job)
    return set(st.get("pods") or []) if condition(st, "Running").get("status") == "True" else set()


def pod_names(names: set[str]) -> set[str]:
    return {n.rsplit("/", 1)[-1] for n in names}


def removed(world: PodWorld) -> list[tuple[str, int]]:
    """The pool's pods a Deployment scale-down removed, with their deletion cost at the time."""
    return [(r.pod, r.deletion_cost) for r in world.deployments.removals if r.pod.startswith(f"{POOL}-")]


def test_a_resized_pool_keeps_its_pods_jobs_and_adapters(world: PodWorld) -> None:
    from elastune_demo.adapters import ensure_tiny_adapter

    t0 = time.monotonic()
    world.apply(claim(CLAIM))
    claim_dir = world.root / "kubelet" / "pvc" / TENANT / CLAIM
    (claim_dir / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA, claim_dir / "data" / "extract.jsonl")
    shutil.copytree(ensure_tiny_adapter(8), claim_dir / "adapters" / "units")
    # serving.maxLoras turns LoRA on in the workers; replicas 2: the adapter is on every pod of the pool.
    world.apply(warm_pool(POOL, minWarmGPUs=1, maxWarmGPUs=2, idleWindow="3s", serving={"maxLoras": 2},
                          volumes=[{"claimName": CLAIM, "jobStorage": True}]))  # fmt: skip
    world.apply({
        "apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter",
        "metadata": {"name": "units", "namespace": TENANT},
        "spec": {"baseModel": MODEL, "artifactURL": f"pvc://{CLAIM}/adapters/units", "rank": 8,
                 "replicas": 2},
    })  # fmt: skip
    first = world.wait_ready(TENANT, SELECTOR, timeout=240)[0]["metadata"]["name"]

    def status() -> str:
        out = {
            "pods": pool_pods(world),
            "removed": removed(world),
            "pool": custom_object(world, "warmpools", POOL).get("status"),
            "adapter": custom_object(world, "loraadapters", "units").get("status"),
        }
        for job in ("long", "wide"):
            with contextlib.suppress(k8s.ApiException):
                out[job] = job_status(world, job)
        operator = world.pods(RELEASE_NAMESPACE, "app.kubernetes.io/component=operator")[0]
        log = world.kubelet.log_of(RELEASE_NAMESPACE, operator["metadata"]["name"])
        lines = [line for line in log.splitlines() if POOL in line or "long" in line or "wide" in line]
        return json.dumps(out, default=str) + "\n" + "\n".join(lines[-60:])

    wait_for(
        "the adapter loaded on the first pod", lambda: set(loaded_on(world, "units")) == {first}, 120, status
    )
    # At its floor the pool is minWarmGPUs pods: the scheduler's own launch is the only one.
    time.sleep(2)
    apps = k8s.AppsV1Api(world.api)
    deployment = apps.read_namespaced_deployment(POOL, TENANT)
    assert deployment.spec.replicas == 1, status()
    template = deployment.spec.template.to_dict()
    before, first_since = pool_pods(world), loaded_on(world, "units")[first]
    assert list(before) == [first], status()
    print(f"{time.monotonic() - t0:.0f}s: pool at 1 pod, {first}, adapter loaded")

    # A long job takes the pool's one pod (it is idle: no need to grow).
    world.apply(tuning_job("long", deadline="30m", termination={"maxIterations": LONG_ITERATIONS}))
    wait_for("the long job running on the first pod",
             lambda: pod_names(running_on(world, "long")) == {first}, 120, status)  # fmt: skip
    print(f"{time.monotonic() - t0:.0f}s: long running")

    # A job with a tight deadline cannot wait for that pod: the pool grows by one GPU from the cold pool.
    world.apply(tuning_job("wide", deadline="40s", termination={"maxIterations": WIDE_ITERATIONS}))
    wait_for("the pool to grow", lambda: len(pool_pods(world)) == 2, 60, status)
    grown = pool_pods(world)
    second = next(n for n in grown if n != first)
    assert before.items() <= grown.items(), f"growing the pool replaced its pod: {before} -> {grown}"
    wait_for("the wide job running on the new pod",
             lambda: pod_names(running_on(world, "wide")) == {second}, 240, status)  # fmt: skip
    print(f"{time.monotonic() - t0:.0f}s: wide running on {second}")
    long_status = job_status(world, "long")
    assert condition(long_status, "Running").get("status") == "True", (
        f"the long job ended before the new pod ran the wide job (raise LONG_ITERATIONS): {status()}"
    )
    assert long_status.get("attempts") == 1, status()
    # Loaded before the resize and never reloaded since (the same pod holds it since the same time).
    assert loaded_on(world, "units").get(first) == first_since, status()
    wait_for("the adapter's second replica on the new pod",
             lambda: set(loaded_on(world, "units")) == {first, second}, 120, status)  # fmt: skip
    second_since = loaded_on(world, "units")[second]

    # The long job ends; its pod idles past the pool's idle window and the scheduler releases it,
    # while the newer pod is busy: exactly that older pod goes, and nothing of the newer one changes.
    done = wait_for("the long job to succeed", lambda: condition(job_status(world, "long"), "Succeeded").get(
        "status") == "True" and job_status(world, "long"), 240, status)  # fmt: skip
    assert done.get("attempts") == 1 and done.get("iterations") == LONG_ITERATIONS, status()
    print(f"{time.monotonic() - t0:.0f}s: long succeeded")
    wait_for("the pool to shrink", lambda: len(pool_pods(world)) == 1, 60, status)
    print(f"{time.monotonic() - t0:.0f}s: shrunk")
    assert pool_pods(world) == {second: grown[second]}, status()
    assert removed(world) == [(first, int(COST_REMOVE))], (
        f"the scale-down removed other pods than the released one: {status()}"
    )
    wide = job_status(world, "wide")
    assert condition(wide, "Running").get("status") == "True", (
        f"the wide job ended before the shrink (raise WIDE_ITERATIONS): {status()}"
    )
    assert wide.get("attempts") == 1 and pod_names(set(wide.get("pods") or [])) == {second}, status()
    kept = next(p for p in world.pods(TENANT, SELECTOR) if p["metadata"]["name"] == second)
    assert kept["metadata"]["annotations"].get(DELETION_COST) == COST_BUSY, status()
    assert loaded_on(world, "units").get(second) == second_since, status()

    # The busy job finishes on the pod it started on; the adapter is served from the pod that stayed.
    done = wait_for("the wide job to succeed", lambda: condition(job_status(world, "wide"), "Succeeded").get(
        "status") == "True" and job_status(world, "wide"), 240, status)  # fmt: skip
    assert done.get("attempts") == 1 and done.get("iterations") == WIDE_ITERATIONS, status()
    assert pool_pods(world) == {second: grown[second]}, status()
    api = OpenAI(base_url=gateway_url(world), api_key=API_KEY, max_retries=0, timeout=60)
    out = api.completions.create(model="units", prompt="12 km →", max_tokens=4, temperature=0)
    assert out.model == "units" and out.choices[0].text
    # Neither resize touched the pod template (a template change would have rolled the pool).
    deployment = apps.read_namespaced_deployment(POOL, TENANT)
    assert deployment.spec.replicas == 1 and deployment.spec.template.to_dict() == template
    print(f"{time.monotonic() - t0:.0f}s: done")
