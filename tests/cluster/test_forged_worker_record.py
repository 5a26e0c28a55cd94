"""A second pod holding the worker credential rewrites the first worker pod's registry record to point at
itself, and gets none of its traffic (issue 25 item 4, docs/design.md §6): the chart's operator vouches for
the pool's pods at the IPs the API lists, and the chart's gateway forwards only there.

The rogue pod runs in the tenant's namespace with exactly what a WarmPool's author can give a pod there:
the worker Redis credential (the Secret the operator copies into the namespace, the worker ACL user) and
an HTTP server at its own pod IP that answers like a worker."""

from __future__ import annotations

import time
from typing import Any

from openai import OpenAI

from conftest import API_KEY, MODEL, RELEASE_NAMESPACE, TENANT, gateway_url, warm_pool
from elastune_testing.podworld import PodWorld

POOL = "vouch-a"
SELECTOR = f"elastune.dev/warmpool={POOL}"
ROGUE = "rogue"

ROGUE_SCRIPT = r"""
import json, os, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from elastune_common.bus import Bus
from elastune_contract.protocol import ServingState, WorkerRecord, WorkerState

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send({"status": "ok"})
    def do_POST(self):
        print("ROGUE" + "-HIT", self.path, flush=True)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send({"id": "x", "object": "text_completion", "created": 0, "model": os.environ["MODEL"],
                   "choices": [{"index": 0, "text": "rogue", "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
    def send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

server = ThreadingHTTPServer(("0.0.0.0", 8080), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
bus = Bus(os.environ["ELASTUNE_REDIS_URL"])
now = time.time()
forged = WorkerRecord(id=os.environ["VICTIM"], pool=os.environ["POOL"], model=os.environ["MODEL"],
                      state=WorkerState.READY, url="http://%s:8080" % os.environ["POD_IP"], started_at=now,
                      ready_at=now, serving=ServingState(model=os.environ["MODEL"], max_model_len=2048))
n = 0
while True:
    bus.publish_worker(forged)
    n += 1
    if n % 20 == 1:
        print("FORGED" + "-RECORD", n, flush=True)
    time.sleep(0.05)
"""


def rogue_pod(victim: dict[str, Any]) -> dict[str, Any]:
    (container,) = victim["spec"]["containers"]
    redis_env = [e for e in container["env"] if e["name"].startswith("ELASTUNE_REDIS_")]
    assert {e["name"] for e in redis_env} >= {"ELASTUNE_REDIS_URL", "ELASTUNE_REDIS_PASSWORD"}, redis_env
    env = [
        *redis_env,
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # The id the victim's worker registers under: namespace/pod (POD_NAMESPACE/POD_NAME).
        {"name": "VICTIM", "value": f"{TENANT}/{victim['metadata']['name']}"},
        {"name": "POOL", "value": POOL},
        {"name": "MODEL", "value": MODEL},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": ROGUE, "namespace": TENANT, "labels": {"app": ROGUE}},
        "spec": {
            "containers": [
                {
                    "name": ROGUE,
                    "image": container["image"],
                    "command": ["python", "-c", ROGUE_SCRIPT],
                    "env": env,
                }
            ]
        },
    }


def marked(world: PodWorld, marker: str) -> list[str]:
    """The rogue's output lines that start with ``marker`` (its log also holds its command line)."""
    return [line for line in world.kubelet.log_of(TENANT, ROGUE).splitlines() if line.startswith(marker)]


def test_a_pod_with_the_worker_credential_cannot_redirect_a_worker_pods_traffic(world: PodWorld) -> None:
    world.apply(warm_pool(POOL, serving={"minReplicas": 1}))
    (victim,) = world.wait_ready(TENANT, SELECTOR, timeout=240)
    client = OpenAI(base_url=gateway_url(world), api_key=API_KEY, max_retries=0, timeout=120)
    deadline = time.monotonic() + 120
    while True:  # the key's hash and the pool record are published within seconds
        try:
            assert client.completions.create(model=MODEL, prompt="1 km →", max_tokens=2).choices[0].text
            break
        except Exception:
            assert time.monotonic() < deadline, "the worker pod never answered through the gateway"
            time.sleep(1)

    world.apply(rogue_pod(victim))
    world.wait_ready(TENANT, f"app={ROGUE}", timeout=60)
    deadline = time.monotonic() + 60
    while len(marked(world, "FORGED-RECORD")) < 3:  # it rewrites the record 20x a second
        assert time.monotonic() < deadline, world.kubelet.log_of(TENANT, ROGUE)[-2000:]
        time.sleep(0.5)

    forged_before = len(marked(world, "FORGED-RECORD"))
    texts = [
        client.completions.create(model=MODEL, prompt=f"{i} km →", max_tokens=2, temperature=0)
        .choices[0]
        .text
        for i in range(8)
    ]
    assert marked(world, "ROGUE-HIT") == [], world.kubelet.log_of(TENANT, ROGUE)[-2000:]
    assert "rogue" not in texts
    # The rogue was still rewriting the record around the requests (it prints once a second: eight
    # short requests can finish inside one such second, so wait for the next line, not count lines).
    deadline = time.monotonic() + 15
    while len(marked(world, "FORGED-RECORD")) <= forged_before:
        assert time.monotonic() < deadline, world.kubelet.log_of(TENANT, ROGUE)[-2000:]
        time.sleep(0.25)
    # The gateway saw the forged record and set it aside (so the attack did reach it).
    (gateway,) = world.pods(RELEASE_NAMESPACE, "app.kubernetes.io/component=gateway")
    gateway_log = world.kubelet.log_of(RELEASE_NAMESPACE, gateway["metadata"]["name"])
    skipped = [line for line in gateway_log.splitlines() if "not forwarding to worker record" in line]
    assert any(
        victim["metadata"]["name"] in line and victim["status"]["podIP"] not in line for line in skipped
    ), gateway_log[-3000:]
