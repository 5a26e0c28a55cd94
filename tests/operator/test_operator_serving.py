"""Serving through the real operator (issue 15): `elastune operator` (kopf) against the Kubernetes API
emulator over HTTP, the workload stand-in starting real local worker processes with the pod's container
args, a real redis-server, the real gateway process and the real `openai` client.

Scenario: a WarmPool with `serving.minReplicas: 0`, LoRAAdapters of ranks 8 and 16, one whose artifact
does not exist, and a TuningJob with `output.publish`. The first request waits in the gateway while the
pool scales from zero, then succeeds; the adapters' status names the pods and tiers that really hold
them; the operator is killed and restarted mid-way; the tuned prompt is published as a LoRAAdapter owned
by its job and served (the job ran co-served in the engine of the pod serving requests); deleting an
adapter unloads it from every pod before its finalizer goes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("kmock")

from test_operator_integration import NS, Cluster, wait_for  # noqa: E402

from elastune_common.servers import free_port  # noqa: E402
from elastune_contract.api.constants import GROUP, VERSION  # noqa: E402
from elastune_contract.request_credential import KEY_FILE_ENV  # noqa: E402
from elastune_demo import adapters as tiny_adapters  # noqa: E402
from elastune_demo import build as tiny_build  # noqa: E402

MODEL = "elastune/tiny-llama"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(tmp_path: Path, redis_server: Any) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server.url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def gateway(cluster: Cluster) -> Iterator[str]:
    port = free_port()
    log = (cluster.tmp / "gateway.log").open("wb")
    argv = [sys.executable, "-m", "elastune_gateway.server", "--redis-url", cluster.redis_url]
    argv += ["--namespace", cluster.namespace, "--host", "127.0.0.1", "--port", str(port)]
    # The workers the stand-in starts hold the local backend's worker request key: the gateway signs with
    # its secret (issue 39 item 3), as `elastune serve` and the chart wire them.
    env = {**os.environ, KEY_FILE_ENV: str(cluster.backend.request_key_file)}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return True
        except OSError:
            return False

    try:
        wait_for("the gateway", up, 60)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(15)


def adapter(name: str, url: str, rank: int | None = None) -> dict:
    spec: dict[str, Any] = {"baseModel": MODEL, "artifactURL": url}
    if rank is not None:
        spec["rank"] = rank
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LoRAAdapter",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


def condition(obj: dict | None, ctype: str) -> dict:
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == ctype), {})


def test_scale_from_zero_adapters_publish_delete_and_restart_through_the_operator(
    cluster: Cluster, gateway: str
) -> None:
    tiny_build.ensure_tiny_model(spec=tiny_build.TINY_LLAMA_SPEC)
    r8, r16 = tiny_adapters.ensure_tiny_adapter(8), tiny_adapters.ensure_tiny_adapter(16)
    cluster.start_operator()
    cluster.create(
        "warmpools",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "WarmPool",
            "metadata": {"name": "tiny-llama", "namespace": NS},
            "spec": {
                "model": MODEL,
                "maxWarmGPUs": 2,
                "idleWindow": "600s",
                "serving": {"minReplicas": 0, "holdTimeout": "180s", "maxLoras": 2, "maxLoraRank": 32},
                "volumes": [{"claimName": "work", "jobStorage": True}],  # the published prompt goes there
            },
        },
    )
    cluster.create("loraadapters", adapter("units", str(r8), 8))
    cluster.create("loraadapters", adapter("case", str(r16), 16))
    cluster.create("loraadapters", adapter("missing", str(cluster.tmp / "no-such-adapter")))
    orphan = adapter("orphan", str(r8))
    orphan["spec"]["baseModel"] = "no/such-model"
    cluster.create("loraadapters", orphan)
    wait_for("the Deployment", lambda: cluster.deployment("tiny-llama") is not None, 60)
    svc = cluster.deployment("tiny-llama")
    args = svc["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["serve", "--enable-lora", "--max-loras"] and "--max-lora-rank" in args, args
    assert cluster.replicas("tiny-llama") == 0  # scaled to zero until a request comes

    missing = wait_for(
        "the missing artifact's condition",
        lambda: condition(cluster.get("loraadapters", "missing"), "Ready").get("reason"),
        60,
    )
    assert missing == "ArtifactNotFound"
    orphaned = wait_for(
        "the orphan's condition",
        lambda: condition(cluster.get("loraadapters", "orphan"), "Ready").get("reason"),
        60,
    )
    assert orphaned == "UnknownModel"

    client = openai.OpenAI(base_url=gateway, api_key="unused", timeout=240, max_retries=0)
    # Both: kopf runs the two create handlers concurrently, so one adapter can be known before the other.
    wait_for(
        "the gateway to know the pool's adapters",
        lambda: {"units", "case"} <= {m.id for m in client.models.list()},
    )
    t0 = time.monotonic()
    answer = client.completions.create(model="units", prompt="12 km →", max_tokens=6, temperature=0)
    assert answer.choices[0].text and answer.model == "units"
    assert time.monotonic() - t0 > 1.0  # it waited while a pod started
    assert (cluster.replicas("tiny-llama") or 0) >= 1

    def holders(name: str) -> list[dict]:
        return ((cluster.get("loraadapters", name) or {}).get("status") or {}).get("loadedOn") or []

    for name in ("units", "case"):
        placed = wait_for(f"{name} loaded on a pod", lambda n=name: holders(n), 90)
        # Workers register as namespace/pod (pod names repeat across namespaces); status names them so.
        pods = {f"{NS}/{p.metadata.name}" for p in cluster.core.list_namespaced_pod(NS).items}
        assert all(h["pod"] in pods and h["tier"] in ("device", "host") for h in placed), (placed, pods)
        # True residency: the worker's own registry record says the same.
        rec = cluster.bus.workers()[placed[0]["pod"]]
        assert any(a.name == name for a in rec.serving.adapters)
        obj = cluster.get("loraadapters", name)
        assert condition(obj, "Ready")["status"] == "True" and condition(obj, "Loaded")["status"] == "True"
        assert obj["status"]["rank"] == (8 if name == "units" else 16)

    # Tune -> serve, with the operator killed and restarted while the job runs.
    job = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TuningJob",
        "metadata": {"name": "author", "namespace": NS},
        "spec": {
            "model": MODEL,
            "dataset": str(REPO / "manifests" / "data" / "extract.jsonl"),
            "initialPrompt": "Read the record and return one value.",
            "termination": {"maxIterations": 8},
            "deadline": "10m",
            "hyperparameters": {"batchSize": 4, "virtualTokens": 4},
            "promptBank": "never",
            "output": {"publish": "book-author"},
        },
    }
    # The pod serves inference right now: the job is co-served inside its engine (FlexLLM).
    client.completions.create(model="units", prompt="3 kg →", max_tokens=2, temperature=0)
    cluster.create("tuningjobs", job)
    cluster.kill_operator()
    cluster.start_operator()
    done = wait_for("the job to finish", lambda: cluster.finished("author"), 300)
    assert done["status"] == "True", cluster.operator_log()[-3000:]
    published = wait_for("the published LoRAAdapter", lambda: cluster.get("loraadapters", "book-author"), 60)
    owner = published["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("TuningJob", "author")
    assert published["metadata"]["labels"][f"{GROUP}/job"] == "author"
    assert published["spec"]["type"] == "promptTuning"
    # The claim's URI, readable by every pod of the pool (not the path inside the pod that tuned it).
    assert published["spec"]["artifactURL"] == f"pvc://work/elastune/artifacts/{NS}/author"
    st = cluster.get("tuningjobs", "author")["status"]
    assert st["publishedAdapter"] == "book-author"
    assert st["coServed"] is True and "coServingReason" not in st, st
    wait_for("book-author listed", lambda: "book-author" in {m.id for m in client.models.list()}, 60)
    tuned = client.completions.create(model="book-author", prompt="title: Dune; author:", max_tokens=4)
    assert tuned.model == "book-author" and tuned.choices
    # The adapters placed before the restart are still held and reported.
    assert holders("units") and condition(cluster.get("loraadapters", "units"), "Loaded")["status"] == "True"

    # Delete: unloaded from every pod, then the finalizer goes and the object with it.
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "loraadapters", "case")
    wait_for("case to be gone", lambda: cluster.get("loraadapters", "case") is None, 90)
    assert not any(
        a.name == "case" for w in cluster.bus.workers().values() if w.serving for a in w.serving.adapters
    )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="case", prompt="x", max_tokens=2)
    # The bad adapter disturbed nothing and the operator never crashed on anything.
    assert condition(cluster.get("loraadapters", "missing"), "Ready")["reason"] == "ArtifactNotFound"
    assert "Traceback" not in cluster.operator_log(), cluster.operator_log()[-4000:]
