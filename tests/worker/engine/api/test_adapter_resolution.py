"""A served name is resolved once, at the worker's API, into a typed adapter reference that travels with
the request to the engine: a LoRA and a soft prompt of the same worker resolve to their kinds, an unknown
name is an OpenAI-shaped 404, a reference that outlived its adapter is refused, and two namespaces may each
load an adapter under the same name (the tenancy follow-up fills the namespace in)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from elastune_demo import adapters as A  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.api.app import create_app  # noqa: E402
from elastune_worker.engine.core.adapter_ref import AdapterRef  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.outputs import RequestOutput  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.frontend.async_engine import AsyncEngine  # noqa: E402
from elastune_worker.engine.frontend.serving_client import EngineServingClient  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.engine.model_runner.lora.weights import AdapterError  # noqa: E402

MODEL = "tiny-llama"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class RecordingClient(EngineServingClient):
    """The real serving client; it also keeps the adapter reference each request reached it with."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine, MODEL)
        self.seen: list[AdapterRef | None] = []

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        adapter: AdapterRef | None = None,
        *,
        tenant: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        self.seen.append(adapter)
        return super().generate(request_id, prompt_token_ids, params, priority, adapter, tenant=tenant)


def soft_prompt_artifact(out: Path) -> Path:
    torch.manual_seed(0)
    base = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    pm = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    pm.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served() -> Iterator[RecordingClient]:
    config = EngineConfig(kv_cache_tokens=4096, enable_lora=True, max_loras=2)
    engine = AsyncEngine(LLMEngine(B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), config))
    try:
        yield RecordingClient(engine)
    finally:
        engine.close()


def test_a_lora_and_a_soft_prompt_resolve_to_their_kinds_and_an_unknown_name_is_a_404(
    served: RecordingClient, tmp_path: Path
) -> None:
    app = create_app(lambda: served)
    body = {"prompt": "198 km →", "max_tokens": 4, "temperature": 0}

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
            for name, path in (
                ("units", A.ensure_tiny_adapter(8)),
                ("tuned", soft_prompt_artifact(tmp_path)),
            ):
                r = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                assert r.status_code == 200, r.text
            loaded = {a.name: a.ref for a in served.adapters()}
            assert {n: r.kind for n, r in loaded.items()} == {"units": "lora", "tuned": "soft_prompt"}
            assert loaded["units"].id != loaded["tuned"].id
            for model in ("units", "tuned", MODEL):
                r = await http.post("/v1/completions", json={**body, "model": model})
                assert r.status_code == 200, r.text
            r = await http.post("/v1/chat/completions", json={
                "model": "tuned", "messages": [{"role": "user", "content": "12 km"}], "max_tokens": 3
            })  # fmt: skip
            assert r.status_code == 200, r.text
            assert served.seen == [loaded["units"], loaded["tuned"], None, loaded["tuned"]]

            r = await http.post("/v1/completions", json={**body, "model": "nope"})
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["param"] == "model" and err["code"] == 404
            assert "`nope` does not exist" in err["message"] and "units" in err["message"]
            assert len(served.seen) == 4  # the engine never saw it

    asyncio.run(main())


def test_a_reference_that_outlived_its_adapter_is_refused_and_a_reload_gets_a_new_one() -> None:
    eng = LLMEngine(B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), EngineConfig(enable_lora=True))
    path = str(A.ensure_tiny_adapter(8))
    old = eng.load_lora("units", path).ref
    assert eng.load_lora("units", path).ref == old  # loading a loaded one again keeps its reference
    eng.unload_lora("units")
    with pytest.raises(AdapterError, match="not loaded"):
        eng.add_request("gone", "198 km →", GREEDY, adapter=old)
    new = eng.load_lora("units", path).ref
    assert new.id != old.id and eng.adapter_ref("units") == new
    with pytest.raises(AdapterError, match="unloaded and loaded again"):
        eng.add_request("stale", "198 km →", GREEDY, adapter=old)
    assert not eng.has_unfinished()  # nothing was queued for a refused reference


def test_two_namespaces_each_serve_their_own_adapter_under_one_name() -> None:
    eng = LLMEngine(B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC), EngineConfig(enable_lora=True, max_loras=4))
    r8, r32 = str(A.ensure_tiny_adapter(8)), str(A.ensure_tiny_adapter(32))
    eng.load_lora("r8", r8)
    eng.load_lora("r32", r32)
    a = eng.load_lora("summarizer", r8, namespace="team-a").ref
    b = eng.load_lora("summarizer", r32, namespace="team-b").ref
    assert (a.namespace, b.namespace) == ("team-a", "team-b") and a.key != b.key
    assert eng.adapter_ref("summarizer", "team-a") == a and eng.adapter_ref("summarizer", "team-b") == b
    with pytest.raises(AdapterError):
        eng.adapter_ref("summarizer")  # not in the default namespace
    prompts: list[str | list[int]] = ["1907-02-28 →"] * 2
    want = eng.generate(prompts, GREEDY, ["r8", "r32"])
    assert want[0] != want[1]  # the two adapters answer differently: the check below can fail
    for i, ref in enumerate((a, b)):
        eng.add_request(f"ns{i}", prompts[i], GREEDY, adapter=ref)
    got: dict[str, list[int]] = {"ns0": [], "ns1": []}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert [got["ns0"], got["ns1"]] == want
    eng.unload_lora("summarizer", namespace="team-a")
    assert [x.ref for x in eng.list_loras() if x.name == "summarizer"] == [b]


def test_the_unload_route_finds_an_adapter_the_placement_loaded_in_its_namespace(
    served: RecordingClient,
) -> None:
    """An adapter the placement loaded in its LoRAAdapter's namespace is unloaded by its served name when
    that name is unique on the worker, or by ``namespace/name``; a name two namespaces share is a 400
    asking for the namespace (the chaos bench's adapter-unloaded-behind-back found the route answering 404
    for every placed adapter: it looked the name up in the default namespace only)."""
    app = create_app(lambda: served)
    path = str(A.ensure_tiny_adapter(8))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
            await served.load_lora("placed", path, namespace="team-a")
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "placed"})
            assert r.status_code == 200, r.text
            assert not [a for a in served.adapters() if a.name == "placed"]

            await served.load_lora("placed", path, namespace="team-a")
            await served.load_lora("placed", path, namespace="team-b")
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "placed"})
            assert r.status_code == 400 and "team-a/placed" in r.json()["error"]["message"], r.text
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "team-b/placed"})
            assert r.status_code == 200, r.text
            assert [a.ref.namespace for a in served.adapters() if a.name == "placed"] == ["team-a"]
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "team-a/placed"})
            assert r.status_code == 200, r.text
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "placed"})
            assert r.status_code == 404, r.text

    asyncio.run(main())
