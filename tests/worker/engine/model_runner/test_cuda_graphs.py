"""Decode CUDA graphs: the batch ladder and padding; the whole graph data path (static buffers, padding
rows on the scratch block, sampled rows, multi-LoRA in the graph) run on the CPU through a stand-in
whose "replay" re-runs the recorded step over the same buffers; the fallbacks (a capture that raises,
a replay that differs from eager: logged, eager from then on, same tokens); the KV-cache sizing from free
memory. On a GPU (the device script runs this file) the real graphs: greedy outputs with graphs on equal
those with graphs off, and the KV cache is sized from the device's memory."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # the graphs' attention is the Triton kernel: on the CPU, in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or ON_GPU,
    reason="a CPU engine's stand-in graphs run the Triton attention in Triton's interpreter: needs the "
    "triton package, and a process without CUDA (with CUDA, Triton compiles for it; the cases below run)",
)

from elastune_demo import adapters as A  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.engine.model_runner.cuda_graphs import DecodeGraphs, batch_ladder, padded_batch  # noqa: E402
from elastune_worker.engine.model_runner.runner import kv_blocks_for_memory  # noqa: E402

needs_gpu = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
PROMPTS = [
    "12 km →",
    "Read the record and return one value. book: Dune; author: Frank Herbert →",
    "hello",
    "Translate the record: name Alice, age 3, city Oslo, job pilot, pet cat →",
    "Count the words →",
]
# Different lengths: as requests finish, the decode batch shrinks through 5, 4, 3, 2, 1 (padded to 8, 4, 4,
# 2, 1 on the ladder).
LENGTHS = [6, 4, 5, 2, 8]


def test_ladder_and_padding():
    ladder = batch_ladder(256)
    assert ladder[:7] == [1, 2, 4, 8, 16, 24, 32] and ladder[-1] == 256
    assert all(b - a == 8 for a, b in itertools.pairwise(ladder[4:]))
    assert (
        batch_ladder(1) == [1]
        and batch_ladder(5) == [1, 2, 4, 5]
        and batch_ladder(20) == [1, 2, 4, 8, 16, 20]
    )
    for top in (1, 5, 20, 100):
        ladder = batch_ladder(top)
        for n in range(1, top + 1):
            assert padded_batch(ladder, n) == min(b for b in ladder if b >= n)
        assert padded_batch(ladder, top + 1) is None


def test_a_step_is_padded_with_rows_that_attend_to_nothing():
    graphs = DecodeGraphs(20, 4, 16, scratch_slot=160, device=torch.device("cpu"))
    step = graphs.pad([7, 8, 9], [3, 17, 0], [35, 81, 16], [4, 18, 1], [[2], [5, 1], [1]], [0, -1, 1])
    assert step is not None and len(step.tokens) == 4
    assert step.context_lens == [4, 18, 1, 0] and step.slots[-1] == 160 and step.lora_slots[-1] == -1
    assert graphs.pad([1] * 21, [0] * 21, [0] * 21, [1] * 21, [[0]] * 21, [-1] * 21) is None


def test_kv_blocks_from_free_memory():
    gib = 2**30
    # 0.9 x 40 GiB - 2 GiB of activations = 34 GiB of 1 MiB blocks.
    assert (
        kv_blocks_for_memory(40 * gib, 2 * gib, 0.9, 2**20, 10**9) == int(0.9 * 40 * gib - 2 * gib) // 2**20
    )
    assert kv_blocks_for_memory(40 * gib, 2 * gib, 0.9, 2**20, 1000) == 1000  # no more than can be used
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_blocks_for_memory(gib, gib, 0.9, 2**20, 1000)
    for bad in (
        {"kv_cache_memory_fraction": 0.0},
        {"kv_cache_memory_fraction": 1.5},
        {"cuda_graph_max_batch": 0},
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    assert not EngineConfig().kv_size_given() and EngineConfig().kv_blocks() == 65_536 // 16
    assert EngineConfig(kv_cache_tokens=1024).kv_size_given()


class EagerReplayGraphs(DecodeGraphs):
    """Graphs for the CPU: recording runs the step once, a replay runs it again over the same buffers."""

    replays = 0
    lora_replays = 0
    """Replays of steps with adapter rows."""

    def fill(self, step: Any) -> int:
        EagerReplayGraphs.lora_replays += any(s >= 0 for s in step.lora_slots)
        return super().fill(step)

    def _record(self, step: Callable[[], None], pool: Any) -> tuple[Callable[[], None], Any]:
        step()

        def replay() -> None:
            EagerReplayGraphs.replays += 1
            step()

        return replay, None

    def _synchronize(self) -> None:
        pass


class WrongReplayGraphs(EagerReplayGraphs):
    """A graph that replays wrong logits: the start-up comparison with eager must catch it."""

    def _record(self, step: Callable[[], None], pool: Any) -> tuple[Callable[[], None], Any]:
        def wrong() -> None:
            step()
            assert self.logits is not None
            self.logits.add_(1.0)

        return wrong, None


def greedy_outputs(eng: LLMEngine, loras: list[str | None] | None = None) -> list[list[int]]:
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        ref = eng.adapter_ref(loras[i]) if loras and loras[i] else None
        eng.add_request(
            str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), adapter=ref
        )
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    return [outs[str(i)] for i in range(len(PROMPTS))]


def cpu_engine(path: Any, graphs: type[DecodeGraphs] | None, **config: Any) -> LLMEngine:
    """Eager steps through gather + SDPA (the Triton kernel agrees with it: test_triton_attention.py), so
    that only the graphs' decodes run in Triton's slow interpreter."""
    cfg = {"kv_cache_tokens": 4096, "max_num_batched_tokens": 32, "attention_backend": "gather",
           "device": "cpu", **config}  # fmt: skip
    eng = LLMEngine(path, EngineConfig(**cfg))
    if graphs is not None:  # graphs "on" for a CPU engine, through the stand-in
        eng.runner.use_cuda_graphs = True
        eng.runner.graph_factory = graphs
        eng.runner.cuda_graph_max_batch = 8
    return eng


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_graph_data_path_gives_the_eager_tokens(arch):
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC if arch == "llama" else B.DEFAULT_SPEC)
    eager = greedy_outputs(cpu_engine(path, None))
    before = EagerReplayGraphs.replays
    eng = cpu_engine(path, EagerReplayGraphs)
    assert greedy_outputs(eng) == eager
    assert eng.runner.graphs is not None and eng.runner.graphs.ladder == [1, 2, 4, 8]
    assert EagerReplayGraphs.replays - before >= sum(LENGTHS) // len(PROMPTS)  # decode steps replayed


@needs_triton
@pytest.mark.parametrize(
    ("backend", "kernel"), [("torch", "padded"), ("triton", "padded"), ("triton", "unpadded")]
)
def test_multi_lora_decode_in_the_graph_gives_the_eager_tokens(backend, kernel):
    """torch: GraphLoRA (every slot, masked per row); triton: the segmented kernels over the graph's
    tile table, refilled at each replay (either kernel's ranks)."""
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    loras = ["r8", None, "r16", "r8", None]
    outs = []
    for graphs in (None, EagerReplayGraphs):
        eng = cpu_engine(
            path, graphs, enable_lora=True, max_loras=2, lora_backend=backend, lora_kernel=kernel
        )
        assert eng.runner.lora_backend == backend
        for r in (8, 16):
            eng.load_lora(f"r{r}", str(A.ensure_tiny_adapter(r)))
        before = EagerReplayGraphs.lora_replays
        outs.append(greedy_outputs(eng, loras))
        if graphs is not None:
            assert eng.runner.graphs is not None and eng.runner.graphs.lora is not None
            assert EagerReplayGraphs.lora_replays > before  # the adapters' decodes replayed
            assert (getattr(eng.runner.graphs, "lora_tiles", None) is not None) == (backend == "triton")
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    ("graphs", "reason"),
    [
        pytest.param(
            DecodeGraphs,
            "capturing the decode step failed",
            marks=pytest.mark.skipif(ON_GPU, reason="a CPU engine's capture fails only where CUDA is absent"),
        ),
        pytest.param(WrongReplayGraphs, "differs", marks=needs_triton),
    ],
)
def test_a_failed_capture_or_a_wrong_replay_turns_graphs_off_and_serving_goes_on(graphs, reason, caplog):
    """On the CPU the real DecodeGraphs fails at its first CUDA call: the path an unseen GPU error takes."""
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    eager = greedy_outputs(cpu_engine(path, None))
    eng = cpu_engine(path, graphs)
    with caplog.at_level(logging.WARNING, logger="elastune_worker.engine.model_runner.cuda_graphs"):
        assert greedy_outputs(eng) == eager
    assert eng.runner.graphs is None and not eng.runner.use_cuda_graphs
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name.endswith("cuda_graphs") and "CUDA graphs off" in r.getMessage()
    ]
    assert len(warnings) == 1 and reason in warnings[0]  # logged once, not at every step


# -- on a GPU ---------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cuda_graphs_on_and_off_give_the_same_tokens(arch):
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC if arch == "llama" else B.DEFAULT_SPEC)
    outs = []
    for on in (False, True):
        config = EngineConfig(
            kv_cache_tokens=8192, dtype="float32", cuda_graphs=on, max_num_batched_tokens=32
        )
        eng = LLMEngine(path, config)
        assert eng.runner.attention_backend == "triton"
        outs.append(greedy_outputs(eng))
        assert (eng.runner.graphs is not None) == on
    assert outs[0] == outs[1]


@needs_gpu
@pytest.mark.parametrize(
    ("backend", "kernel"), [("torch", "padded"), ("auto", "padded"), ("auto", "unpadded")]
)
def test_cuda_graphs_with_multi_lora_give_the_same_tokens(backend, kernel):
    """auto on CUDA: the Triton LoRA kernels in the graphs (GraphTiles); torch: GraphLoRA."""
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    loras = ["r8", None, "r16", "r8", None]
    outs = []
    for on in (False, True):
        config = EngineConfig(
            kv_cache_tokens=8192, dtype="float32", cuda_graphs=on, enable_lora=True, max_loras=2,
            lora_backend=backend, lora_kernel=kernel,
        )  # fmt: skip
        eng = LLMEngine(path, config)
        for r in (8, 16):
            eng.load_lora(f"r{r}", str(A.ensure_tiny_adapter(r)))
        outs.append(greedy_outputs(eng, loras))
        graphs = eng.runner.graphs
        assert (graphs is not None and graphs.lora is not None) == on
        if on:
            assert (graphs.lora_tiles is not None) == (backend == "auto")
    assert outs[0] == outs[1]


@needs_gpu
def test_kv_cache_is_sized_from_free_device_memory_unless_given():
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    config = EngineConfig(max_num_seqs=8)
    eng = LLMEngine(path, config)
    r = eng.runner
    useful = 8 * -(-r.max_model_len // r.block_size)
    assert 0 < r.num_kv_blocks <= useful
    assert r.kv_caches[0][0].shape[1] >= r.num_kv_blocks * r.block_size
    given = LLMEngine(path, EngineConfig(kv_cache_tokens=1024, max_num_seqs=8)).runner
    assert given.num_kv_blocks == 1024 // given.block_size
