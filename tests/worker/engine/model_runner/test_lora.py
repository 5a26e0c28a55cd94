"""Multi-LoRA on real torch: adapters of ranks 8, 16, 32 and 64 (trained by the project) and base-model
requests in one batch give, for every adapter, the greedy tokens of PEFT's merged model and its logits
within float tolerance — with both kernels, chunked prefill and prefix caching keyed by adapter; the
adapter tiers, the per-batch adapter limit and the load/unload checks behave as vLLM users expect."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from elastune_demo import adapters as A  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_demo import tasks as T  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.core.scheduler import Scheduler  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.engine.model_runner.lora.copies import EmulatedCopies  # noqa: E402
from elastune_worker.engine.model_runner.lora.weights import AdapterError  # noqa: E402

RANKS = (8, 16, 32, 64)
PROMPTS = ["198 km →", "window window harbor →", "1907-02-28 →", "age: 64; city: rome; name: dara →"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    base = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    tok = transformers.AutoTokenizer.from_pretrained(base, local_files_only=True)
    paths = {r: A.ensure_tiny_adapter(r) for r in RANKS}
    merged = {}
    for r, p in paths.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
        merged[r] = peft.PeftModel.from_pretrained(hf, p).merge_and_unload().eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True).eval()
    return {"base": base, "tok": tok, "paths": paths, "merged": merged, "plain": plain}


def reference(tok: Any, hf: Any, prompt: str, n: int = 8) -> list[int]:
    ids = tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(
            **ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None
        )
    return out[0, ids["input_ids"].shape[1] :].tolist()


def lora_engine(setup: dict[str, Any], ranks: tuple[int, ...] = RANKS, **config: Any) -> LLMEngine:
    cfg = {"kv_cache_tokens": 8192, "enable_lora": True, "max_loras": 4, **config}
    eng = LLMEngine(setup["base"], EngineConfig(**cfg))
    for r in ranks:
        eng.load_lora(f"r{r}", str(setup["paths"][r]))
    return eng


def test_each_adapter_measurably_changes_its_familys_answers(setup):
    for r in RANKS:
        info = json.loads((setup["paths"][r] / A.INFO_FILE).read_text())
        assert info["answer_loss_adapter"] < 0.85 * info["answer_loss_base"], info
    tok = setup["tok"]
    for r in RANKS:  # and its greedy answers differ from the base model's on its family's prompts
        family = A.ADAPTER_SPECS[r].family
        examples = T.make_task(T.TaskSpec(family, 0), n_train=0, n_eval=4, seed=7).eval
        prompts = [T.format_example(e["input"]) for e in examples]
        changed = [
            reference(tok, setup["merged"][r], p) != reference(tok, setup["plain"], p) for p in prompts
        ]
        assert sum(changed) >= 2, (r, changed)


@pytest.mark.parametrize("kernel", ["padded", "unpadded"])
def test_mixed_batch_of_ranks_and_base_equals_peft_merged_models(setup, kernel):
    eng = lora_engine(setup, lora_kernel=kernel, max_num_batched_tokens=24)  # chunked prefill too
    prompts, loras, want = [], [], []
    tok = setup["tok"]
    for r, p in zip(RANKS, PROMPTS, strict=True):
        for lora, model in ((f"r{r}", setup["merged"][r]), (None, setup["plain"])):
            prompts.append(p)
            loras.append(lora)
            want.append(reference(tok, model, p))
    assert eng.generate(prompts, GREEDY, loras) == want


@pytest.mark.parametrize("kernel", ["padded", "unpadded"])
def test_logits_match_the_merged_models_within_float_tolerance(setup, kernel):
    eng = lora_engine(setup, lora_kernel=kernel)
    for i, (r, p) in enumerate(zip(RANKS, PROMPTS, strict=True)):
        eng.add_request(f"a{i}", p, SamplingParams(max_tokens=1), adapter=eng.adapter_ref(f"r{r}"))
        eng.add_request(f"b{i}", p, SamplingParams(max_tokens=1))
    out = eng.scheduler.schedule()
    slots = eng.loras.activate({c.seq.lora for c in out.chunks if c.seq.lora}, set())  # type: ignore[union-attr]
    logits, seqs = eng.runner.forward(out, slots)
    for row, seq in zip(logits, seqs, strict=True):
        model = setup["plain"] if seq.lora is None else setup["merged"][int(seq.lora[1:])]
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([seq.prompt_token_ids])).logits[0, -1]
        torch.testing.assert_close(row, ref, rtol=1e-4, atol=1e-4)


def test_prefix_cache_is_keyed_by_adapter(setup):
    eng = lora_engine(setup)
    shared = "Read the record and return one value. You are careful; answer with one word. " * 2
    tok = setup["tok"]
    eng.generate([shared + PROMPTS[0]], GREEDY, ["r8"])
    hits = eng.stats().prefix_cache_hits_tokens
    out = eng.generate([shared + PROMPTS[0]], GREEDY, ["r16"])  # same tokens, other adapter: no reuse
    assert eng.stats().prefix_cache_hits_tokens == hits
    assert out[0] == reference(tok, setup["merged"][16], shared + PROMPTS[0])
    out = eng.generate([shared + PROMPTS[0]], GREEDY, ["r8"])  # same adapter: reuse, same answer
    assert eng.stats().prefix_cache_hits_tokens > hits
    assert out[0] == reference(tok, setup["merged"][8], shared + PROMPTS[0])


def test_a_request_whose_adapter_exceeds_the_slots_waits_and_lru_evicts_idle_adapters(setup):
    eng = lora_engine(setup, max_loras=2, max_cpu_loras=2)
    for i, r in enumerate(RANKS):
        params = SamplingParams(max_tokens=3, temperature=0.0)
        eng.add_request(f"q{i}", PROMPTS[i], params, adapter=eng.adapter_ref(f"r{r}"))
    out = eng.scheduler.schedule()
    assert sorted(c.seq.lora or "" for c in out.chunks) == ["r16", "r8"]  # r32, r64 wait for slots
    assert [s.lora for s in eng.scheduler.waiting] == ["r32", "r64"]  # their order is kept
    done: dict[str, list[int]] = {}
    eng.runner.execute(out, eng.loras.activate({"r8", "r16"}, set()))  # type: ignore[union-attr]
    while eng.has_unfinished():
        for o in eng.step():
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert set(done) == {"q0", "q1", "q2", "q3"}
    tiers = {a.name: a.tier for a in eng.list_loras()}
    assert sorted(tiers.values()).count("device") == 2 and tiers["r64"] == "device"
    assert eng.loras.host.storage_loads >= 2  # type: ignore[union-attr]  # host LRU of 2: re-read from storage


def test_bad_adapters_are_refused_with_the_reason(setup, tmp_path: Path):
    eng = lora_engine(setup, (8, 16), max_lora_rank=32)
    with pytest.raises(AdapterError, match="rank 64 is outside"):
        eng.load_lora("big", str(setup["paths"][64]))
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        eng.load_lora("nothing", str(tmp_path))
    other = tmp_path / "other"
    shutil.copytree(setup["paths"][8], other)
    cfg = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    with pytest.raises(AdapterError, match="shape"):
        eng.load_lora("mismatch", str(other))
    with pytest.raises(AdapterError, match="not loaded"):
        eng.adapter_ref("nope")
    eng.add_request("y", "hello", SamplingParams(max_tokens=2), adapter=eng.adapter_ref("r8"))
    with pytest.raises(AdapterError, match="in use"):
        eng.unload_lora("r8")
    while eng.has_unfinished():
        eng.step()
    eng.unload_lora("r8")
    with pytest.raises(KeyError):
        eng.unload_lora("r8")
    assert "r8" not in {a.name for a in eng.list_loras()}


def test_scheduler_never_runs_more_adapters_than_slots():
    from elastune_worker.engine.core.adapter_ref import AdapterRef
    from elastune_worker.engine.core.sequence import Sequence

    config = EngineConfig(kv_cache_tokens=4096, max_loras=2, enable_lora=True)
    sched = Scheduler(config.scheduler_config(), 2048)
    refs = {n: AdapterRef("lora", "", n, i) for i, n in enumerate("abc")}
    for i, lora in enumerate(["a", "b", "a", "c", None, "b", "c"]):
        adapter = refs[lora] if lora is not None else None
        sched.add(Sequence(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=4), arrival=i, adapter=adapter))
    out = sched.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["s0", "s1", "s2", "s4", "s5"]
    assert [s.request_id for s in sched.waiting] == ["s3", "s6"]


def _emulated(setup: dict[str, Any], mode: str, **kw: Any) -> tuple[LLMEngine, list[float]]:
    """An engine whose EMULATED adapter copies (10 GB/s) finish when the test moves its clock past them."""
    eng = lora_engine(setup, (8, *kw.pop("ranks", ())), lora_load_mode=mode, **{"max_loras": 2, **kw})
    now = [100.0]
    assert eng.loras is not None
    eng.loras.time_copies(EmulatedCopies(10.0, clock=lambda: now[0]))
    return eng, now


def test_cpu_assisted_cold_start_serves_during_the_load_with_the_same_tokens(setup):
    eng, now = _emulated(setup, "cpu_assisted")
    assert EmulatedCopies(10.0).seconds(64) == pytest.approx(0.01007, rel=0.01)  # 100.7 MB at 10 GB/s
    eng.add_request("cold", PROMPTS[0], GREEDY, adapter=eng.adapter_ref("r8"))
    first = eng.step()  # the copy is in flight: the prefill ran with the CPU path
    assert [o.request_id for o in first] == ["cold"] and eng.loras.device.loading() == {"r8"}  # type: ignore[union-attr]
    tokens = list(first[0].new_token_ids)
    now[0] += 1.0  # the copy finished: the device path takes over
    while eng.has_unfinished():
        tokens += [t for o in eng.step() for t in o.new_token_ids]
    assert eng.loras.device.loading() == set()  # type: ignore[union-attr]
    assert tokens == reference(setup["tok"], setup["merged"][8], PROMPTS[0])
    # One request's prefill ran CPU-assisted, in one step; its decodes on the device did not count.
    counters = eng.stats().lora_counters
    assert counters["cpu_assisted_prefills"] == 1 and counters["cpu_assisted_steps"] == 1


def test_async_loading_holds_the_request_back_until_its_adapter_is_on_the_device(setup):
    eng, now = _emulated(setup, "async")
    eng.add_request("cold", PROMPTS[0], GREEDY, adapter=eng.adapter_ref("r8"))
    eng.add_request("base", PROMPTS[1], GREEDY)
    first = eng.step()
    assert [o.request_id for o in first] == ["base"]  # others run; the adapter's request waits
    assert [s.request_id for s in eng.scheduler.waiting] == ["cold"]
    now[0] += 1.0
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert out["cold"] == reference(setup["tok"], setup["merged"][8], PROMPTS[0])


def test_prefetch_never_evicts_the_adapter_the_queue_head_waits_for(setup):
    """One device slot, two waiting requests on two adapters (async): while the head's adapter copies,
    the next step's prefetch must not evict it for the second one (they evicted each other every step,
    and neither request ever started)."""
    eng, now = _emulated(setup, "async", ranks=(16,), max_loras=1)
    eng.add_request("first", PROMPTS[0], GREEDY, adapter=eng.adapter_ref("r8"))
    eng.add_request("second", PROMPTS[1], GREEDY, adapter=eng.adapter_ref("r16"))
    assert eng.loras is not None
    for _ in range(3):  # the copy is in flight: nothing may run yet, and r8 keeps its slot
        eng.step()
        assert list(eng.loras.device.slot_of) == ["r8"]
    now[0] += 1.0
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        now[0] += 1.0
    assert out["first"] == reference(setup["tok"], setup["merged"][8], PROMPTS[0])
    assert out["second"] == reference(setup["tok"], setup["merged"][16], PROMPTS[1])


def test_on_demand_loading_makes_the_step_wait_and_cached_needs_every_adapter_on_the_device(setup):
    eng = lora_engine(setup, (8,), lora_load_mode="ondmd", max_loras=2)
    copies = EmulatedCopies(0.5)
    assert eng.loras is not None
    eng.loras.time_copies(copies)
    eng.add_request("cold", PROMPTS[0], GREEDY, adapter=eng.adapter_ref("r8"))
    t0 = time.perf_counter()
    eng.step()
    assert time.perf_counter() - t0 >= copies.seconds(8) * 0.95
    cached = lora_engine(setup, (8, 16), lora_load_mode="cached", max_loras=2)
    assert {a.tier for a in cached.list_loras()} == {"device"}
    with pytest.raises(AdapterError, match="cached keeps every adapter on the device"):
        cached.load_lora("r32", str(setup["paths"][32]))


def test_cpu_lora_worker_processes_compute_the_cold_path_with_the_same_tokens(setup):
    """CaraServe's CPU LoRA processes over shared memory: same tokens as PEFT's merged model."""
    eng, _ = _emulated(setup, "cpu_assisted", ranks=(64,), lora_cpu_workers=2)
    pool = eng.runner.lora_cpu_pool
    assert pool is not None
    try:
        got = eng.generate(PROMPTS[:2] * 2, GREEDY, ["r8", "r8", "r64", "r64"])  # the copies never finish
        assert pool.calls > 0 and eng.loras.device.loading() == {"r8", "r64"}  # type: ignore[union-attr]
        tok = setup["tok"]
        pairs = ((8, PROMPTS[0]), (8, PROMPTS[1]), (64, PROMPTS[0]), (64, PROMPTS[1]))
        assert got == [reference(tok, setup["merged"][r], p) for r, p in pairs]
    finally:
        pool.close()


def test_rslora_scaling_matches_peft(setup, tmp_path: Path):
    """use_rslora scales by alpha / sqrt(r), not alpha / r: the engine's tokens are peft's."""
    rs = tmp_path / "rslora"
    shutil.copytree(setup["paths"][8], rs)
    cfg = json.loads((rs / "adapter_config.json").read_text())
    (rs / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(setup["base"], local_files_only=True)
    merged = peft.PeftModel.from_pretrained(hf, rs).merge_and_unload().eval()
    eng = LLMEngine(setup["base"], EngineConfig(kv_cache_tokens=4096, enable_lora=True, max_loras=2))
    eng.load_lora("rs", str(rs))
    got = eng.generate(PROMPTS, GREEDY, adapters=["rs"] * len(PROMPTS))
    assert got == [reference(setup["tok"], merged, p) for p in PROMPTS]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"lora_bias": True}, "lora_bias=True"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ],
)
def test_adapter_settings_the_engine_does_not_compute_are_refused_by_name(
    setup, tmp_path: Path, setting: dict[str, Any], named: str
):
    """An adapter whose config asks for more than plain LoRA is refused at load, naming the setting,
    rather than served as plain LoRA."""
    bad = tmp_path / "bad"
    shutil.copytree(setup["paths"][8], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, **setting}))
    eng = LLMEngine(setup["base"], EngineConfig(kv_cache_tokens=2048, enable_lora=True, max_loras=2))
    with pytest.raises(AdapterError, match=named):
        eng.load_lora("bad", str(bad))
