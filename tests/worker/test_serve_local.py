"""`elastune serve` end to end with real processes: the embedded Redis, the control core, local worker
processes, the gateway, and the real `openai` client. The pool starts at zero: the first request waits in
the gateway while the pool scales up, then the LoRA adapter's answer comes back; its status file shows
the pod and tier that really hold it; a bad adapter ends Ready=False with its reason and disturbs nothing."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from elastune_demo import adapters as tiny_adapters  # noqa: E402
from elastune_demo import build as tiny_build  # noqa: E402
from serve_process import ElastuneServe, write_manifests  # noqa: E402

MODEL = "elastune/tiny-llama"


def manifests(root: Path, adapter_dir: Path) -> Path:
    docs = [
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "tiny-llama", "namespace": "default"},
            "spec": {"model": MODEL, "maxWarmGPUs": 1, "idleWindow": "600s",
                     "serving": {"minReplicas": 0, "holdTimeout": "120s", "maxLoras": 2}},
        },
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": "units", "namespace": "default"},
            "spec": {"baseModel": MODEL, "artifactURL": str(adapter_dir), "rank": 8},
        },
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": "rank-lie", "namespace": "default"},
            "spec": {"baseModel": MODEL, "artifactURL": str(adapter_dir), "rank": 16},
        },
    ]  # fmt: skip
    return write_manifests(root / "manifests", docs)


def test_scale_from_zero_lora_request_through_the_gateway(tmp_path: Path) -> None:
    tiny_build.ensure_tiny_model(spec=tiny_build.TINY_LLAMA_SPEC)
    adapter_dir = tiny_adapters.ensure_tiny_adapter(8)
    serve = ElastuneServe(manifests(tmp_path, adapter_dir), tmp_path / "state")
    try:
        client = serve.wait_up().openai_client()
        models = {m.id for m in client.models.list().data}
        assert {MODEL, "units"} <= models and "rank-lie" not in models
        assert not serve.log("tiny-llama-w1").exists()  # scaled to zero: no worker yet
        t0 = time.monotonic()
        answer = client.completions.create(model="units", prompt="12 km →", max_tokens=6, temperature=0)
        waited = time.monotonic() - t0
        assert answer.choices[0].text and answer.model == "units"
        assert serve.log("tiny-llama-w1").exists()  # the request made the pool grow
        assert waited > 1.0  # it waited for a worker to warm up (seconds on this CPU)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)

        def status(name: str) -> dict:
            return serve.status("LoRAAdapter", name)

        deadline = time.monotonic() + 30
        while not status("units").get("loadedOn"):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert status("units")["loadedOn"][0]["pod"] == "tiny-llama-w1"
        assert status("units")["loadedOn"][0]["tier"] in ("device", "host")
        lie = {c["type"]: c for c in status("rank-lie")["conditions"]}
        assert lie["Ready"]["status"] == "False" and lie["Ready"]["reason"] == "ArtifactMismatch"
        assert "rank 16 in the spec, 8 in the artifact" in lie["Ready"]["message"]
    finally:
        out = serve.stop(signal.SIGINT)
    assert serve.proc.returncode == 0, out
    assert f"OpenAI base URL: {serve.url}/v1" in out
