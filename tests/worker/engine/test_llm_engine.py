"""The engine on real torch: greedy outputs equal transformers' ``generate`` for the tiny GPT-2 and the
tiny Llama — batches of mixed lengths, prefix-cache hits, chunked prefill, preemption — and sampling,
stopping, aborts and bad input behave as users of vLLM expect."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402

PROMPTS = [
    "12 km →",
    "Read the record and return one value. book: Dune; author: Frank Herbert →",
    "hello",
    "Translate the record: name Alice, age 3, city Oslo, job pilot, pet cat →",
    "Count the words →",
]
SHARED = "Read the record and return one value. You are a careful assistant; answer with one word. "
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request: pytest.FixtureRequest) -> tuple[Path, Any, Any]:
    spec = B.TINY_LLAMA_SPEC if request.param == "llama" else B.DEFAULT_SPEC
    path = B.ensure_tiny_model(spec=spec)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    return path, tok, hf


def reference(tok: Any, hf: Any, prompt: str, n: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(
            **ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None
        )
    return out[0, ids["input_ids"].shape[1] :].tolist()


def engine(path: Path, **config: Any) -> LLMEngine:
    return LLMEngine(path, EngineConfig(**{"kv_cache_tokens": 8192, **config}))


def test_greedy_batch_of_mixed_lengths_equals_transformers(model):
    path, tok, hf = model
    eng = engine(path, max_num_batched_tokens=32)  # prompts longer than the budget: chunked prefill
    outs = eng.generate(PROMPTS, GREEDY)
    assert outs == [reference(tok, hf, p, 10) for p in PROMPTS]
    s = eng.stats()
    assert s.steps > 10 and s.num_requests_running == 0 and s.kv_cache_usage_perc == 0.0


def test_a_prompt_longer_than_the_step_budget_alone_is_prefilled_in_chunks(model):
    """A step whose only chunk stops mid-prompt samples nothing: it must still run (it crashed with
    "tensors used as indices must be long": an empty index list became a float tensor)."""
    path, tok, hf = model
    prompt = PROMPTS[3]
    assert len(tok(prompt).input_ids) > 16
    eng = engine(path, max_num_batched_tokens=16)
    assert eng.generate([prompt], GREEDY) == [reference(tok, hf, prompt, 10)]


def test_prefix_cache_hits_change_nothing_but_the_work(model):
    path, tok, hf = model
    prompts = [SHARED + q for q in ("book: Dune →", "city: Oslo →", "age: 3 →")]
    eng = engine(path, block_size=8)
    first = eng.generate(prompts[:1], GREEDY)
    hits_before = eng.stats().prefix_cache_hits_tokens
    rest = eng.generate(prompts[1:], GREEDY)
    hits = eng.stats().prefix_cache_hits_tokens - hits_before
    assert hits >= 2 * 8 * (len(tok(SHARED).input_ids) // 8 - 1)  # the shared full blocks, per request
    assert first + rest == [reference(tok, hf, p, 10) for p in prompts]


def test_preemption_by_recompute_keeps_outputs_exact(model):
    path, tok, hf = model
    # 8 blocks of 8 tokens = 64 slots for 3 requests of ~25 + 24 tokens: someone must be preempted.
    ctx = 64
    eng = LLMEngine(
        path, EngineConfig(block_size=8, num_kv_blocks=8, max_model_len=ctx, enable_prefix_caching=False)
    )
    prompts = PROMPTS[1], PROMPTS[3], SHARED
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = eng.generate(list(prompts), params)
    assert eng.stats().preemptions >= 1
    assert outs == [reference(tok, hf, p, 20) for p in prompts]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model):
    path, tok, hf = model
    eng = engine(path)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a = eng.generate(["hello", "12 km →"], seeded)
    b = eng.generate(["12 km →", "Count the words →", "hello"], seeded)  # another batch, another order
    assert a[0] == b[2] and a[1] == b[0]
    other = eng.generate(["hello"], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))
    assert other[0] != a[0]
    top1 = eng.generate(["hello"], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True))
    assert top1[0] == reference(tok, hf, "hello", 8)


def test_stop_strings_end_the_text_before_them_and_eos_and_length_finish(model):
    path, tok, hf = model
    eng = engine(path)
    full = tok.decode(reference(tok, hf, PROMPTS[1], 12), skip_special_tokens=True)
    stop = full[3:6]
    eng.add_request(
        "s", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,), ignore_eos=True)
    )
    text, reason = "", None
    while eng.has_unfinished():
        for o in eng.step():
            text += o.text
            reason = o.finish_reason
    assert reason == "stop" and text == full[: full.find(stop)]
    eng.add_request("l", "hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outs = [o for _ in range(5) for o in eng.step()]
    assert [o.finish_reason for o in outs] == [None, None, "length"] and outs[-1].completion_tokens == 3


def test_abort_frees_the_blocks_and_bad_input_is_refused_before_allocating(model):
    path = model[0]
    eng = engine(path)
    eng.add_request("a", PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.stats().kv_cache_usage_perc > 0
    assert eng.abort("a") and not eng.abort("a") and eng.stats().kv_cache_usage_perc == 0.0
    with pytest.raises(ValueError, match="context"):
        eng.add_request("long", [5] * eng.max_model_len)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", [])
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("oov", [eng.vocab_size + 3])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert not eng.has_unfinished()


def test_degenerate_sampling_values_found_by_fuzzing_do_not_break_a_step(model):
    """Regressions from schemathesis: a top_p below float32's resolution and a vanishing temperature
    used to produce NaN probabilities and fail the whole step."""
    path, tok, hf = model
    eng = engine(path)
    tiny_p = eng.generate(
        ["hello"], SamplingParams(max_tokens=6, temperature=1.0, top_p=5e-324, ignore_eos=True)
    )
    cold = eng.generate(["hello"], SamplingParams(max_tokens=6, temperature=1e-30, ignore_eos=True))
    assert tiny_p[0] == cold[0] == reference(tok, hf, "hello", 6)  # both reduce to argmax


def test_incremental_detokenization_equals_decoding_the_whole_output(model):
    from elastune_worker.engine.detokenizer import IncrementalDetokenizer

    tok = model[1]
    text = "naïve café ✓ 東京 — 12 km → ok"
    ids = tok(text)["input_ids"]
    detok = IncrementalDetokenizer(tok, ("→",))
    out, stopped = "", False
    for t in ids:
        delta, stopped = detok.add(t)
        out += delta
        if stopped:
            break
    assert stopped and out == text[: text.index("→")]
    plain = IncrementalDetokenizer(tok, ())
    streamed = "".join(plain.add(t)[0] for t in ids) + plain.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_running_engines_stream_outputs_and_abort_when_the_caller_leaves(model, where):
    import asyncio

    from elastune_worker.engine.frontend.async_engine import AsyncEngine
    from elastune_worker.engine.frontend.engine_process import ProcessEngine

    path, tok, hf = model
    config = EngineConfig(kv_cache_tokens=8192)
    eng = AsyncEngine(LLMEngine(path, config)) if where == "thread" else ProcessEngine(path, config)

    async def collect(rid: str, prompt: str, n: int, leave_after: int | None = None) -> list[int]:
        got: list[int] = []
        async for o in eng.generate(
            rid, tok(prompt)["input_ids"], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        ):
            got += o.new_token_ids
            if leave_after is not None and len(got) >= leave_after:
                break
        return got

    async def main() -> tuple[list[int], list[int]]:
        a, b = await asyncio.gather(collect("a", "hello", 8), collect("b", PROMPTS[1], 400, leave_after=3))
        for _ in range(100):  # the abandoned request is aborted: the engine goes idle
            if eng.stats().num_requests_running == 0 and eng.stats().kv_cache_usage_perc == 0:
                break
            await asyncio.sleep(0.05)
        return a, b

    try:
        a, b = asyncio.run(main())
        assert a == reference(tok, hf, "hello", 8) and len(b) == 3
        assert eng.stats().num_requests_running == 0 and eng.stats().kv_cache_usage_perc == 0
    finally:
        eng.close()


def test_detokenizing_starts_from_the_prompts_last_tokens(model):
    """The window includes the prompt's tail (as vLLM's does), and only output text is emitted."""
    from elastune_worker.engine.detokenizer import IncrementalDetokenizer

    tok = model[1]
    prompt, output = tok("Read the record:")["input_ids"], tok(" Dune, by Frank Herbert")["input_ids"]
    detok = IncrementalDetokenizer(tok, (), prompt)
    text = "".join(detok.add(t)[0] for t in output) + detok.flush()
    assert text == tok.decode(prompt + output)[len(tok.decode(prompt)) :] == " Dune, by Frank Herbert"


def test_a_closed_caller_loop_aborts_its_requests_and_the_engine_carries_on(model):
    import asyncio

    from elastune_worker.engine.frontend.async_engine import AsyncEngine

    path, tok, hf = model
    eng = AsyncEngine(LLMEngine(path, EngineConfig(kv_cache_tokens=8192)))
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def start_and_abandon() -> None:
        gen = eng.generate("orphan", tok("hello")["input_ids"], params)
        await gen.__anext__()  # running; then the loop closes under it without closing the generator

    loop = asyncio.new_event_loop()
    loop.run_until_complete(start_and_abandon())
    loop.close()
    try:
        for _ in range(100):
            if eng.stats().num_requests_running == 0 and eng.stats().kv_cache_usage_perc == 0:
                break
            time.sleep(0.05)
        assert eng.stats().num_requests_running == 0 and eng.stats().kv_cache_usage_perc == 0

        async def after() -> list[int]:
            out: list[int] = []
            five = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
            async for o in eng.generate("next", tok("hello")["input_ids"], five):
                out += o.new_token_ids
            return out

        # a dead engine thread would never answer: fail instead of hanging
        assert asyncio.run(asyncio.wait_for(after(), 30)) == reference(tok, hf, "hello", 5)
    finally:
        eng.close()


class RecordingHook:
    """A ``StepHook`` (engine/hooks.py) with ``work`` iterations of work; records what the engine tells it.
    ``fail``: raise in the ``run`` of that iteration (1-based), or in ``pending`` with "pending"."""

    def __init__(self, work: int, fail: int | str | None = None) -> None:
        self.left, self.fail = work, fail
        self.runs: list[int] = []
        self.observed: list[tuple[float, float]] = []
        self.dropped: str | None = None

    def pending(self) -> bool:
        if self.fail == "pending":
            raise RuntimeError("no memory for the next batch")
        return self.left > 0

    def run(self, inference_tokens: int) -> int:
        self.runs.append(inference_tokens)
        if self.fail == len(self.runs):
            raise RuntimeError("out of activation memory")
        self.left -= 1
        return 5

    def observe(self, inference_s: float, hook_s: float) -> None:
        self.observed.append((inference_s, hook_s))

    def drop(self, reason: str) -> None:
        self.dropped = reason


def test_a_step_hook_rides_every_iteration_and_a_failing_one_is_dropped_while_serving_goes_on():
    """Co-serving's seam (FlexLLM): the hook runs after each step's inference tokens, with their count,
    and hears the step's times; it keeps an idle engine stepping; one that raises, in a step or between
    steps, is detached and told why, and the requests' outputs are those of the engine alone."""
    path = B.ensure_tiny_model(spec=B.DEFAULT_SPEC)
    alone = engine(path).generate(PROMPTS[:2], GREEDY)

    eng = engine(path)
    hook = RecordingHook(work=100)
    eng.attach_hook(hook)
    assert eng.has_work() and not eng.has_unfinished()  # idle iterations run the hook
    assert eng.generate(PROMPTS[:2], GREEDY) == alone
    assert hook.runs[0] > 0 and hook.runs[-1] == 2  # the prompts' tokens, then the two decodes
    assert len(hook.observed) == len(hook.runs) and all(i > 0 and h >= 0 for i, h in hook.observed)
    assert eng.step() == [] and hook.runs[-1] == 0  # an idle step is the hook's alone
    stats = eng.stats()
    assert 0 < stats.coserve_seconds < stats.step_seconds
    assert eng.detach_hook() is hook and not eng.has_work() and hook.dropped is None

    failing = RecordingHook(work=100, fail=2)
    eng.attach_hook(failing)
    assert eng.generate(PROMPTS[:2], GREEDY) == alone
    assert failing.dropped == "RuntimeError: out of activation memory" and len(failing.runs) == 2
    assert len(failing.observed) == 1  # the failed share is not fed to its latency model
    assert eng.hooks_dropped == [(failing, failing.dropped)] and eng.detach_hook() is None

    between = RecordingHook(work=100, fail="pending")
    eng.attach_hook(between)
    assert eng.has_work() is False  # the loop asks between steps: dropped there, no raise into the loop
    assert between.dropped == "RuntimeError: no memory for the next batch" and eng.detach_hook() is None
    assert eng.generate(PROMPTS[:2], GREEDY) == alone
