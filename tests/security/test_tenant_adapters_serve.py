"""Two tenants, one served name (issue 25 item 1), end to end with real processes: `elastune serve` (the
embedded Redis, the control core, a local worker process, the gateway with API keys) and the real `openai`
client. A WarmPool in team-a admits team-b; each namespace has a LoRAAdapter `summarizer`, from different
artifacts (ranks 8 and 16); each namespace has an API key. Both adapters end Ready and loaded on the one
pod as two adapters; each key's `summarizer` is its own namespace's (the worker's loaded set shows both,
each with its namespace and artifact, and each key's answer equals that artifact's answer asked of the
worker directly); team-b's key also reaches the base model of team-a's pool, which admits it.

Fails before per-namespace identity: team-b's `summarizer` was refused (DuplicateAdapterName), so its key
had no `summarizer` (403)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.api_keys import API_KEY_LABEL  # noqa: E402
from elastune_contract.protocol import NAMESPACE_HEADER, adapter_id  # noqa: E402
from elastune_contract.request_credential import CREDENTIAL_HEADER, Credential, seal  # noqa: E402
from elastune_demo import adapters as tiny_adapters  # noqa: E402
from elastune_demo import build as tiny_build  # noqa: E402
from serve_process import ElastuneServe  # noqa: E402

MODEL = "elastune/tiny-llama"
A, B = "team-a", "team-b"
KEYS = {A: "sk-team-a-key", B: "sk-team-b-key"}
PROMPT = "12 km →"


def manifests(root: Path, artifacts: dict[str, Path]) -> Path:
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "tiny-llama", "namespace": A},
            "spec": {"model": MODEL, "maxWarmGPUs": 1, "idleWindow": "600s", "allowedNamespaces": [B],
                     "serving": {"minReplicas": 1, "holdTimeout": "120s", "maxLoras": 2}},
        },
    ]  # fmt: skip
    for ns, path in artifacts.items():
        docs.append(
            {
                "apiVersion": "elastune.dev/v1alpha1",
                "kind": "LoRAAdapter",
                "metadata": {"name": "summarizer", "namespace": ns},
                "spec": {"baseModel": MODEL, "artifactURL": str(path)},
            }
        )
        docs.append(
            {
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": f"key-{ns}", "namespace": ns, "labels": {API_KEY_LABEL: "true"}},
                "stringData": {"key": KEYS[ns]},
            }
        )  # fmt: skip
    folder = root / "manifests"
    folder.mkdir(parents=True, exist_ok=True)
    for doc in docs:  # two objects share a name: the file names say the namespace too
        meta = doc["metadata"]
        (folder / f"{doc['kind'].lower()}-{meta['namespace']}-{meta['name']}.yaml").write_text(
            yaml.safe_dump(doc)
        )
    return folder


def wait(what: str, check: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_each_key_reaches_its_own_namespaces_summarizer(tmp_path: Path) -> None:
    tiny_build.ensure_tiny_model(spec=tiny_build.TINY_LLAMA_SPEC)
    artifacts = {A: tiny_adapters.ensure_tiny_adapter(8), B: tiny_adapters.ensure_tiny_adapter(16)}
    serve = ElastuneServe(manifests(tmp_path, artifacts), tmp_path / "state").wait_up()
    try:
        clients = {ns: serve.openai_client(api_key=key) for ns, key in KEYS.items()}
        for ns in (A, B):
            listed = {m.id for m in clients[ns].models.list().data}
            assert {MODEL, "summarizer"} <= listed, (ns, listed)

        def loaded(ns: str) -> Any:
            st = serve.status("LoRAAdapter", "summarizer", ns)
            ready = {c["type"]: c["status"] for c in st.get("conditions", [])}
            return st.get("loadedOn") and ready.get("Ready") == "True" and st

        for ns in (A, B):
            st = wait(f"{ns}'s summarizer Ready and loaded", lambda ns=ns: loaded(ns))
            assert st["loadedOn"][0]["pod"] == "tiny-llama-w1", st
            assert st["rank"] == (8 if ns == A else 16), st

        answers = {}
        for ns in (A, B):
            out = clients[ns].completions.create(
                model="summarizer", prompt=PROMPT, max_tokens=8, temperature=0
            )
            assert out.model == "summarizer" and out.choices[0].text, out
            answers[ns] = out.choices[0].text

        # The worker holds both, each under its namespace and with its own artifact; asked directly with
        # each namespace, it answers as the gateway did for that namespace's key.
        worker = wait("the worker's URL", lambda: _worker_url(serve))
        roots = {m["root"] for m in httpx.get(f"{worker}/v1/models", timeout=10).json()["data"]}
        assert {str(artifacts[A]), str(artifacts[B])} <= roots, roots
        body = {"model": "summarizer", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        # Not without the gateway's credential (issue 39 item 3): the namespace header alone is refused.
        r = httpx.post(f"{worker}/v1/completions", json=body, headers={NAMESPACE_HEADER: A}, timeout=60)
        assert r.status_code == 401, r.text
        worker_key = (serve.state / "worker-request-key").read_bytes().strip()
        for ns in (A, B):
            cred = _credential(worker_key, adapter_id(ns, "summarizer"))
            r = httpx.post(f"{worker}/v1/completions", json=body, headers=cred, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == answers[ns], (ns, r.json(), answers)
        assert answers[A] != answers[B], answers  # two artifacts, two answers: neither key got the other's

        # team-b's key reaches the base model of team-a's pool (it admits team-b).
        base = clients[B].completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert base.choices[0].text

        # The gateway's per-model series say the model's namespace: two namespaces' summarizer are two
        # series (one request each), the base model is its pool's namespace's (team-a).
        text = httpx.get(serve.metrics_url, timeout=10).text  # its own port, not the client one
        for metric in ("elastune_gateway_requests_total", "elastune_gateway_routed_requests_total",
                       "elastune_gateway_request_duration_seconds_count"):  # fmt: skip
            got = _series(text, metric)
            assert got.get((A, "summarizer")) == 1 and got.get((B, "summarizer")) == 1, (metric, got)
            assert got.get((A, MODEL)) == 1, (metric, got)
    finally:
        out = serve.stop(signal.SIGINT)
    assert serve.proc.returncode == 0, out


def _credential(worker_key: bytes, served: str) -> dict[str, str]:
    """A credential as the gateway signs it, sealed with the worker's own (derived) key: local workers
    have no namespace, so theirs is the one for ""."""
    cred = Credential("", served, True, "test", time.time() + 20)
    return {CREDENTIAL_HEADER: seal(worker_key, cred)}


def _series(text: str, metric: str) -> dict[tuple[str, str], float]:
    """Samples of ``metric`` summed by (model_namespace, model)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric:
                key = (sample.labels.get("model_namespace", "?"), sample.labels.get("model", "?"))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _worker_url(serve: ElastuneServe) -> str | None:
    """The worker's /v1 address, from its registry record (the embedded Redis's URL read from the
    command line of the gateway that `elastune serve` started)."""
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == serve.proc.pid and b"elastune_gateway.server" in argv:
            url = argv[argv.index(b"--redis-url") + 1].decode()
            ns = argv[argv.index(b"--namespace") + 1].decode() if b"--namespace" in argv else "elastune"
            # The embedded Redis requires the password serve generated: in its children's environment.
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
            password = env.get(b"ELASTUNE_REDIS_PASSWORD", b"").decode()
            if password:
                url = url.replace("redis://", f"redis://:{password}@", 1)
            bus = Bus(url, ns)
            try:
                w = bus.workers().get("tiny-llama-w1")
            finally:
                bus.close()
            return w.url if w is not None and w.serving is not None else None
    return None
