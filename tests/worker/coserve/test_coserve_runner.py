"""Co-serving, the torch half: a prompt-learning job run in forward token windows and a layer-by-layer
backward, inside engine steps that serve real requests, ends with the prompt the dedicated trainer gets
on the same seed and data; the inference outputs do not change; a failing job is dropped, serving goes
on; a job of another model is refused."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from elastune_demo import build as B  # noqa: E402
from elastune_demo import tasks as T  # noqa: E402
from elastune_worker.coserve.hook import DROP_PREFIX, CoServeHook  # noqa: E402
from elastune_worker.coserve.job import CoServedJob  # noqa: E402
from elastune_worker.coserve.planner import (  # noqa: E402
    CoServeConfig,
    CoServePlanner,
    FinetuneState,
    IterationPlan,
    LatencyModel,
)
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.tuning.trainer import Trainer, TuningConfig  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),  # the trainer's peft
]

# The 2-layer GPT-2 variant test_tuning.py builds (seconds, cached) and the tiny Llama the engine serves.
GPT2_SPEC = dataclasses.replace(
    B.DEFAULT_SPEC, vocab_size=768, n_layer=2, n_embd=64, n_head=2, n_positions=128,
    examples_per_task=40, block_size=64, batch_size=16, steps=250, warmup_steps=20,
)  # fmt: skip
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["12 km →", "window window harbor →", "Read the record and return one value. book: Dune →"]
# Parameters move by ~0.3 over the steps; the co-served gradient differs from the batched one only by
# float summation order. Observed max |Δ| ≈ 5e-6 (AdamW, prompt tuning) and 6e-8 (SGD).
RTOL, ATOL = 1e-4, 2e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: do not oversubscribe
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama() -> Path:
    return B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)


@pytest.fixture(scope="module")
def task() -> T.Task:
    return T.make_task(T.TaskSpec("classify", 0), n_train=24, n_eval=4, seed=3)


def cfg(method: str = "promptTuning", optimizer: str = "adamw", steps: int = 3) -> TuningConfig:
    return TuningConfig(
        method=method, virtual_tokens=4, batch_size=4, max_iterations=steps, learning_rate=0.1,
        max_length=48, optimizer=optimizer,  # type: ignore[arg-type]
    )  # fmt: skip


def dedicated(model: Path, c: TuningConfig, task: T.Task) -> dict[str, torch.Tensor]:
    trainer = Trainer(model, c, task.train, task.eval, device="cpu")
    for step in range(c.max_iterations):
        trainer.step(step)
    return trainer.trainable_state()


def assert_same_prompt(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL)


def assert_dropped_alone(engine: LLMEngine, job: CoServedJob) -> None:
    """The engine detached the job's hook, recorded why, and the job was told (FlexLLM: serving goes on)."""
    [(hook, why)] = engine.hooks_dropped
    assert isinstance(hook, CoServeHook) and hook.job is job
    assert job.reason == DROP_PREFIX + why and engine.detach_hook() is None


def serve(engine: LLMEngine, job: CoServedJob | None = None) -> tuple[list[list[int]], int]:
    """Greedy outputs of PROMPTS arriving one per step, stepping on until the job (if any) is done;
    and how many steps carried both inference and finetuning work."""
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    pending = list(zip(ids, PROMPTS, strict=True))
    mixed = 0
    while pending or engine.has_unfinished() or (job is not None and not job.done):
        if pending:
            engine.add_request(*pending.pop(0), GREEDY)
        before = job.state() if job is not None and not job.done else None
        progress = (before.forward_done, before.backward_done) if before else None
        busy = engine.has_unfinished()
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        after = job._seq.state if job is not None and job._seq is not None else None
        moved = after is None or (after.forward_done, after.backward_done) != progress
        mixed += int(busy and before is not None and moved)
    return [tokens[rid] for rid in ids], mixed


def test_a_coserved_job_ends_with_the_dedicated_prompt_and_leaves_inference_unchanged(
    llama: Path, task: T.Task
) -> None:
    c = cfg()
    alone, _ = serve(LLMEngine(llama, EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=16)))
    engine = LLMEngine(llama, EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=16))
    job = CoServedJob(Trainer(llama, c, task.train, task.eval, device="cpu"), served_model_dir=llama)
    # A generous SLO with a small window: the forward goes in windows of <= 8 tokens beside the decodes.
    planner = CoServePlanner(CoServeConfig(tpot_slo_s=5.0, max_window=8), LatencyModel(0.001, 1e-4))
    engine.attach_hook(CoServeHook(job, planner))
    together, mixed = serve(engine, job)
    assert together == alone  # the co-served job changes no inference output
    assert mixed > 0, "no iteration carried inference and finetuning together"
    assert job.trainer.iterations == c.max_iterations and job.reason is None
    assert job.tokens_trained > 0 and len(planner.model.samples) > 0  # the latency model saw the steps
    assert_same_prompt(job.trainer.trainable_state(), dedicated(llama, c, task))


def test_a_coserved_job_trains_the_same_prompt_on_transformers_before_5_24(
    llama: Path, task: T.Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers before 5.24 names the forward's KV cache ``past_key_values`` and drops a ``cache=``
    into its ``**kwargs`` unread: the job must pass the name the model takes (with ``cache=`` it ran each
    window without the earlier windows' keys and values and trained another prompt; seen with 5.23)."""
    c = cfg()
    want = dedicated(llama, c, task)
    job = CoServedJob(Trainer(llama, c, task.train, task.eval, device="cpu"), served_model_dir=llama)
    model_type = type(job.base)
    current = model_type.forward
    if "cache" not in inspect.signature(current).parameters:
        pytest.skip("transformers before 5.24 is installed: the tests above run on it for real")

    def forward_before_5_24(self, input_ids=None, past_key_values=None, **kwargs):
        kwargs.pop("cache", None)  # an unknown keyword: ignored, as 5.23's forward does
        return current(self, input_ids=input_ids, cache=past_key_values, **kwargs)

    monkeypatch.setattr(model_type, "forward", forward_before_5_24)
    engine = LLMEngine(llama, EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=16))
    planner = CoServePlanner(CoServeConfig(tpot_slo_s=5.0, max_window=8), LatencyModel(0.001, 1e-4))
    engine.attach_hook(CoServeHook(job, planner))
    serve(engine, job)
    assert job.trainer.iterations == c.max_iterations and job.reason is None
    assert_same_prompt(job.trainer.trainable_state(), want)


def drive(job: CoServedJob) -> int:
    """Run the job to its end on uneven windows (1, 5, 3, 7 positions of every row) and one backward
    layer per iteration, beside a decode; the number of iterations."""
    sizes = itertools.cycle([1, 5, 3, 7])
    n = 0
    while (state := job.state()) is not None:
        rows = job._seq.inputs.shape[0] if job._seq is not None else 1
        if state.in_forward:
            plan = IterationPlan(0.0, 1, finetune_forward_tokens=min(next(sizes) * rows, _left(state)))
        else:
            plan = IterationPlan(
                0.0, 1, finetune_backward_layers=(state.num_layers - 1 - state.backward_done,)
            )
        job.run(plan)
        n += 1
    return n


def _left(state: FinetuneState) -> int:
    return state.sequence_tokens - state.forward_done


@pytest.mark.parametrize(
    ("arch", "method", "optimizer", "micro_batch"),
    [
        ("llama", "promptTuning", "adamw", None),
        ("llama", "promptTuning", "adamw", 3),  # micro-batches of 3, 1 rows: gradient accumulation
        # Adam divides by sqrt(v): on near-zero gradient components it turns the float summation-order
        # difference into parameter differences far above it (p-tuning's encoder: ~1e-3; Llama's
        # prefix on a model cache built on a fresh machine: 2.1e-4, 1 of 1,536 elements). SGD shows the
        # gradient is the same (observed max |Δ| 6e-8); AdamW itself is covered by the other rows.
        ("llama", "prefixTuning", "sgd", None),
        ("llama", "pTuning", "sgd", None),
        ("gpt2", "promptTuning", "adamw", None),
        ("gpt2", "prefixTuning", "adamw", 2),
        ("gpt2", "pTuning", "sgd", None),
    ],
)
def test_token_windows_and_layerwise_backward_give_the_dedicated_gradient(
    arch: str, method: str, optimizer: str, micro_batch: int | None, llama: Path, task: T.Task
) -> None:
    model = llama if arch == "llama" else B.ensure_tiny_model(spec=GPT2_SPEC)
    c = cfg(method, optimizer, steps=2)
    job = CoServedJob(Trainer(model, c, task.train, task.eval, device="cpu"), micro_batch=micro_batch)
    iterations = drive(job)
    assert iterations > c.max_iterations * (job.num_layers + 3)  # windows and layers were spread
    assert job.trainer.iterations == c.max_iterations
    assert [h["step"] for h in job.trainer.history] == list(range(c.max_iterations))
    assert_same_prompt(job.trainer.trainable_state(), dedicated(model, c, task))


def test_a_failing_coserved_job_is_dropped_and_serving_goes_on(
    llama: Path, task: T.Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone, _ = serve(LLMEngine(llama, EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=16)))
    engine = LLMEngine(llama, EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=16))
    job = CoServedJob(Trainer(llama, cfg(), task.train, task.eval, device="cpu"))
    calls = {"n": 0}
    real = job._forward

    def flaky(seq: object, n: int) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("out of activation memory")
        real(seq, n)  # type: ignore[arg-type]

    monkeypatch.setattr(job, "_forward", flaky)
    planner = CoServePlanner(CoServeConfig(tpot_slo_s=5.0, max_window=8), LatencyModel(0.001, 1e-4))
    engine.attach_hook(CoServeHook(job, planner))
    got, _ = serve(engine, job)
    assert got == alone
    assert job.reason is not None and "out of activation memory" in job.reason
    assert_dropped_alone(engine, job)
    assert all(p.grad is None for _, p in job.trainer.params)  # its partial gradients were released


def test_a_job_of_another_model_is_refused(llama: Path, task: T.Task) -> None:
    other = B.ensure_tiny_model(spec=GPT2_SPEC)
    trainer = Trainer(other, cfg(), task.train, task.eval, device="cpu")
    with pytest.raises(ValueError, match="engine's own base model"):
        CoServedJob(trainer, served_model_dir=llama)


def _data_parallel(
    model: Path, c: TuningConfig, task: T.Task, world: int, redis_url: str, timeout_s: float = 30.0
) -> list[CoServedJob]:
    from elastune_worker.comm import StorageAllReduce, make_channel

    comm = f"dp-{os.getpid()}-{world}-{c.batch_size}-{timeout_s}"

    def worker(rank: int) -> CoServedJob:
        ar = StorageAllReduce(make_channel(redis_url), comm, rank, world, timeout_s=timeout_s)
        return CoServedJob(
            Trainer(model, c, task.train, task.eval, worker=rank, world=world, device="cpu", allreduce=ar)
        )

    return [worker(rank) for rank in range(world)]


def drive_together(jobs: list[CoServedJob], max_seconds: float = 120.0) -> None:
    """Advance every worker's job by one planned piece in turn (uneven windows, one backward layer); a
    worker whose step is in its all-reduce has no piece to run and is skipped, as its engine would."""
    import time

    sizes = itertools.cycle([1, 5, 3, 7])
    deadline = time.monotonic() + max_seconds
    while not all(j.done for j in jobs):
        assert time.monotonic() < deadline, "the data-parallel co-served jobs did not finish"
        idle = True
        for job in jobs:
            state = job.state()
            if state is None:
                continue
            idle = False
            rows = job._seq.inputs.shape[0] if job._seq is not None else 1
            if state.in_forward:
                plan = IterationPlan(0.0, 1, finetune_forward_tokens=min(next(sizes) * rows, _left(state)))
            else:
                plan = IterationPlan(
                    0.0, 1, finetune_backward_layers=(state.num_layers - 1 - state.backward_done,)
                )
            job.run(plan)
        if idle:
            time.sleep(0.001)  # every worker waits for the all-reduce


@pytest.mark.parametrize(("world", "batch_size"), [(2, 4), (3, 2)])  # (3, 2): one worker's shard is empty
def test_data_parallel_co_served_workers_all_reduce_to_the_dedicated_prompt(
    world: int, batch_size: int, llama: Path, task: T.Task, redis_server: object
) -> None:
    c = dataclasses.replace(cfg(), batch_size=batch_size)
    jobs = _data_parallel(llama, c, task, world, redis_server.url)  # type: ignore[attr-defined]
    drive_together(jobs)
    assert all(j.reason is None and j.trainer.iterations == c.max_iterations for j in jobs)
    want = dedicated(llama, c, task)
    for job in jobs:
        assert_same_prompt(job.trainer.trainable_state(), want)
    first = jobs[0].trainer.trainable_state()
    for job in jobs[1:]:  # the all-reduce hands every worker the same bytes
        assert all(torch.equal(first[n], t) for n, t in job.trainer.trainable_state().items())
    # The history holds the mean loss of the global batch, the same on every worker.
    assert len({tuple(h["loss"] for h in j.trainer.history) for j in jobs}) == 1


def test_a_co_served_worker_whose_peer_is_gone_drops_the_job_with_the_reason(
    llama: Path, task: T.Task, redis_server: object
) -> None:
    alone = _data_parallel(llama, cfg(), task, 2, redis_server.url, timeout_s=1.0)[0]  # type: ignore[attr-defined]
    drive_together([alone], max_seconds=30)  # its peer never joins: the all-reduce times out
    assert alone.done and alone.reason is not None and "all-reduce failed" in alone.reason
    assert alone.trainer.iterations == 0 and alone.state() is None


def test_a_job_failing_between_steps_is_dropped_and_the_engine_loop_goes_on(
    llama: Path, task: T.Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's loop asks ``has_work()`` between steps; a job whose next batch cannot be prepared
    (here: the prompt encoder fails) is dropped there instead of raising into the loop."""
    engine = LLMEngine(llama, EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=16))
    job = CoServedJob(Trainer(llama, cfg(), task.train, task.eval, device="cpu"))

    def broken() -> None:
        raise RuntimeError("cannot allocate the batch")

    monkeypatch.setattr(job, "_start_sequence", broken)
    engine.attach_hook(
        CoServeHook(job, CoServePlanner(CoServeConfig(tpot_slo_s=5.0), LatencyModel(0.001, 1e-4)))
    )
    assert engine.has_work() is False
    assert job.reason is not None and "cannot allocate the batch" in job.reason
    assert_dropped_alone(engine, job)
    got, _ = serve(engine)
    assert got == serve(LLMEngine(llama, EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=16)))[0]
