"""The request path across pods: a client reaches the gateway's Service, the gateway pod holds a request
for a pool at zero while a worker pod starts, and forwards to the worker pod at the address that pod
advertises (on a cluster 127.0.0.1 inside the gateway's pod is the gateway itself); a LoRAAdapter on the
pool's claim is placed, loaded and served by a worker pod, and gone once deleted."""

from __future__ import annotations

import shutil
import time
from typing import Any

from kubernetes import client as k8s
from openai import AuthenticationError, NotFoundError, OpenAI

from conftest import API_KEY, MODEL, TENANT, gateway_url, served, warm_pool
from elastune_testing.podworld import PodWorld

POOL = "serve-a"
SELECTOR = f"elastune.dev/warmpool={POOL}"


def openai_client(world: PodWorld, timeout: float = 60) -> OpenAI:
    return OpenAI(base_url=gateway_url(world), api_key=API_KEY, max_retries=0, timeout=timeout)


def adapter_status(world: PodWorld, name: str) -> dict[str, Any]:
    custom = k8s.CustomObjectsApi(world.api)
    obj = custom.get_namespaced_custom_object("elastune.dev", "v1alpha1", TENANT, "loraadapters", name)
    return obj.get("status") or {}  # type: ignore[union-attr]


def test_a_request_for_a_pool_at_zero_waits_and_is_answered_from_a_worker_pods_address(
    world: PodWorld,
) -> None:
    world.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                 "metadata": {"name": "adapters", "namespace": TENANT}, "spec": {}})  # fmt: skip
    world.apply(warm_pool(POOL, volumes=[{"claimName": "adapters"}], serving={"minReplicas": 0}))
    client = openai_client(world, timeout=300)
    deadline = time.monotonic() + 60
    while MODEL not in served(client):  # the key is published and the pool's model is known at zero
        assert time.monotonic() < deadline, "the gateway never listed the pool's model"
        time.sleep(1)
    assert not world.pods(TENANT, SELECTOR), "a pool at zero has pods"
    anonymous = OpenAI(base_url=gateway_url(world), api_key="not-a-key", max_retries=0, timeout=30)
    try:
        anonymous.models.list()
        raise AssertionError("the chart's gateway answered a request without a valid key")
    except AuthenticationError:
        pass
    out = client.completions.create(model=MODEL, prompt="12 km →", max_tokens=4, temperature=0)
    assert out.choices[0].text, out
    workers = world.wait_ready(TENANT, SELECTOR, timeout=10)  # the request waited for this pod
    # The worker registered the address other pods reach it at (its pod IP), not a loopback one.
    log = world.kubelet.log_of(TENANT, workers[0]["metadata"]["name"])
    assert f"http://{workers[0]['status']['podIP']}:8080" in log, log[-2000:]


def test_a_lora_adapter_on_a_claim_is_served_by_a_worker_pod_and_gone_when_deleted(world: PodWorld) -> None:
    from elastune_demo.adapters import ensure_tiny_adapter

    shutil.copytree(ensure_tiny_adapter(8), world.root / "kubelet" / "pvc" / TENANT / "adapters" / "units")
    world.apply(warm_pool(POOL, volumes=[{"claimName": "adapters"}], serving={"minReplicas": 1}))
    world.wait_ready(TENANT, SELECTOR, timeout=240)
    world.apply({
        "apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter",
        "metadata": {"name": "units", "namespace": TENANT},
        "spec": {"baseModel": MODEL, "artifactURL": "pvc://adapters/units", "type": "lora", "rank": 8},
    })  # fmt: skip
    client = openai_client(world)
    deadline = time.monotonic() + 120
    while "units" not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, (
            f"the adapter never reached the gateway: {adapter_status(world, 'units')}"
        )
        time.sleep(1)
    out = client.completions.create(model="units", prompt="12 km →", max_tokens=6, temperature=0)
    assert out.model == "units" and out.choices[0].text
    deadline = time.monotonic() + 30
    while not adapter_status(world, "units").get("loadedOn"):  # placed and loaded on a worker pod
        assert time.monotonic() < deadline, adapter_status(world, "units")
        time.sleep(0.5)

    k8s.CustomObjectsApi(world.api).delete_namespaced_custom_object(
        "elastune.dev", "v1alpha1", TENANT, "loraadapters", "units"
    )
    deadline = time.monotonic() + 60
    while "units" in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "a deleted adapter is still listed"
        time.sleep(1)
    try:
        client.completions.create(model="units", prompt="12 km →", max_tokens=2)
    except NotFoundError:
        return
    raise AssertionError("a deleted adapter still answered")
