"""The request path across pods: a client reaches the gateway's Service, the gateway pod forwards to a
worker pod of a tenant's WarmPool at the address that pod advertises. On a cluster, 127.0.0.1 inside
the gateway's pod is the gateway itself: a worker advertising it is unreachable."""

from __future__ import annotations

import time

from openai import OpenAI

from conftest import MODEL, TENANT, gateway_url, warm_pool
from elastune_testing.podworld import PodWorld


def test_the_gateway_pod_answers_from_a_worker_pod_at_its_pod_address(world: PodWorld) -> None:
    world.apply(warm_pool("serve-a", serving={"minReplicas": 1}))
    workers = world.wait_ready(TENANT, "elastune.dev/warmpool=serve-a", timeout=240)
    worker_ip = workers[0]["status"]["podIP"]
    client = OpenAI(base_url=gateway_url(world), api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + 90
    while MODEL not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the gateway never listed the pool's model"
        time.sleep(1)
    out = client.completions.create(model=MODEL, prompt="12 km →", max_tokens=4, temperature=0)
    assert out.choices[0].text, out
    # The worker registered the address other pods reach it at (its pod IP), not a loopback one.
    log = world.kubelet.log_of(TENANT, workers[0]["metadata"]["name"])
    assert f"http://{worker_ip}:8080" in log, log[-2000:]
