"""No Triton kernel variant is compiled while serving: every variant of the paged-attention kernel, of the
fused element-wise kernels (fused_ops.py) and of the LoRA kernels (lora/sgmv.py) that steps launch (the
constexprs, the class of each specialized integer argument, the dtypes) was launched at start-up (the
element-wise backend's check, ModelRunner.compile_kernels, compile_lora_or_fall_back), whatever the
contexts' widths and with prefix-cache hits. A compile inside serving stalls every running request
(seconds on a cold GPU). On the CPU the kernel runs in Triton's interpreter (nothing compiles there: the
launches' keys are compared, as Triton forms them); on a GPU the compiled-kernel cache itself must not
grow."""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from elastune_demo import adapters as A  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.engine.model_runner import fused_kernels, triton_attention, triton_paged_kernel  # noqa: E402
from elastune_worker.engine.model_runner.lora import sgmv_kernels  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
FUSED = ("add_rms_norm_kernel", "rope_kernel", "silu_mul_kernel")
"""fused_kernels' kernels (fused_ops imports each at its launch: patched on the module, they are seen)."""
LORA = ("lora_shrink_kernel", "lora_expand_kernel")
"""sgmv_kernels' kernels (sgmv imports each at its launch)."""
UNSPECIALIZED = {*triton_paged_kernel.UNSPECIALIZED, *sgmv_kernels.EXPAND_UNSPECIALIZED}


def variant(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a kernel per: its constexprs and launch options, each tensor's dtype, and
    for each integer it specializes, whether it is 1 and whether a multiple of 16."""
    names = list(kernel.arg_names)
    ints = tuple(
        (name, a == 1, a % 16 == 0)
        for name, a in zip(names, args, strict=False)
        if isinstance(a, int) and not isinstance(a, bool) and name not in UNSPECIALIZED
    )
    dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
    return kernel.fn.__name__, tuple(sorted(kwargs.items())), ints, dtypes


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    seen: list[tuple] = []
    real = triton_attention._kernel

    class Recorded:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                seen.append(variant(self.kernel, args, kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_attention, "_kernel", lambda device_type: Recorded(real(device_type)))
    for name in FUSED:
        monkeypatch.setattr(fused_kernels, name, Recorded(getattr(fused_kernels, name)))
    for name in LORA:
        monkeypatch.setattr(sgmv_kernels, name, Recorded(getattr(sgmv_kernels, name)))
    return seen


def _unrecorded(kernel: Any) -> Any:
    """The Triton kernel behind a ``launches`` recorder (the fixture patches the modules' names)."""
    return kernel if hasattr(kernel, "device_caches") else kernel.kernel


def _compiled() -> int:
    """Compiled variants in the kernels' caches (Triton 3.x: device -> (kernel cache, ...))."""
    kernels = [
        triton_paged_kernel.paged_attention_kernel,
        *(getattr(fused_kernels, n) for n in FUSED),
        *(getattr(sgmv_kernels, n) for n in LORA),
    ]
    caches = [
        c[0] if isinstance(c, tuple) else c for k in kernels for c in _unrecorded(k).device_caches.values()
    ]
    assert all(isinstance(c, dict) for c in caches), "this Triton keeps its compiled kernels elsewhere"
    return sum(len(c) for c in caches)


def test_serving_launches_only_what_start_up_compiled(launches: list[tuple]) -> None:
    """The tiny Llama, eager steps (no graphs): decodes whose widest context grows from one block to
    several (block tables of width 1, 2, 3), chunked prompts, and a second round that prefills over
    the first round's cached prefixes."""
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    cfg = EngineConfig(device=DEVICE, dtype="float32", attention_backend="triton", num_kv_blocks=256,  # type: ignore[arg-type]
                       max_num_batched_tokens=40, cuda_graphs=False,
                       elementwise_backend="triton")  # fmt: skip
    eng = LLMEngine(path, cfg)
    if not ON_GPU:  # on CUDA the runner compiles at start-up itself; the interpreter skips it (slow)
        eng.runner.compile_kernels()
    at_start = set(launches)  # the backends' own start-up checks, then the model's variants
    tiles = {dict(kw)["TILE_Q"] for name, kw, _, _ in at_start if name == "paged_attention_kernel"}
    assert tiles == {1, 4, 16}, tiles  # the check's tiles of 1 and 4; the model's decode and prefix tiles
    assert {name for name, _, _, _ in at_start} >= set(FUSED), "the fused kernels did not run"
    compiled = _compiled() if ON_GPU else 0
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, eng.vocab_size, (n,), generator=gen).tolist() for n in (3, 14, 37)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng.generate(prompts, greedy)
    eng.generate(
        [p + [5, 6, 7] * 6 for p in prompts], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    assert eng.scheduler.blocks.hit_tokens > 0  # the second round did read cached prefixes
    served = set(launches) - at_start
    assert not served, f"variants first launched while serving: {served}"
    if ON_GPU:
        assert _compiled() == compiled


def test_lora_serving_launches_only_what_start_up_compiled(launches: list[tuple]) -> None:
    """Eager LoRA steps through the Triton kernels: adapters of ranks 8 and 64 and base requests, a
    chunked prompt and decodes; every target's variant was launched at start-up. The unpadded kernel
    (each tile at its own rank); the padded one launches the same kernels with other rank values."""
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    cfg = EngineConfig(device=DEVICE, dtype="float32", attention_backend="triton", num_kv_blocks=256,  # type: ignore[arg-type]
                       max_num_batched_tokens=24, cuda_graphs=False, enable_lora=True, max_loras=2,
                       lora_backend="triton", lora_kernel="unpadded")  # fmt: skip
    eng = LLMEngine(path, cfg)
    if not ON_GPU:  # on CUDA the runner compiles at start-up itself (enable_loras)
        eng.runner.compile_lora_or_fall_back()
    at_start = set(launches)
    assert {name for name, _, _, _ in at_start} >= set(LORA), "the LoRA kernels did not run"
    compiled = _compiled() if ON_GPU else 0
    for r in (8, 64):
        eng.load_lora(f"r{r}", str(A.ensure_tiny_adapter(r)))
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.generate([[1, 2, 3], list(range(5, 35)), [9, 8]], greedy, ["r8", "r64", None])
    served = set(launches) - at_start
    assert not served, f"variants first launched while serving: {served}"
    if ON_GPU:
        assert _compiled() == compiled


def test_the_block_tables_width_is_not_specialized() -> None:
    """Without this, the width (1, then 2-15, then 16...) would be three variants of the same kernel."""
    assert triton_paged_kernel.UNSPECIALIZED == ["stride_table"]
    if ON_GPU:
        assert "stride_table" in triton_paged_kernel.paged_attention_kernel.do_not_specialize


def test_a_kernel_that_fails_at_the_models_shapes_leaves_the_gather_backend(monkeypatch, caplog) -> None:
    path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    cfg = EngineConfig(device=DEVICE, dtype="float32", attention_backend="triton", num_kv_blocks=256,  # type: ignore[arg-type]
                       cuda_graphs=False)  # fmt: skip
    eng = LLMEngine(path, cfg)

    def fails(self: Any) -> None:
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(type(eng.runner), "compile_kernels", fails)
    eng.runner.compile_or_fall_back()
    assert eng.runner.attention_backend == "gather"
    assert "triton kernel failed at this model's shapes (RuntimeError: out of resource" in caplog.text
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(eng.generate([[1, 2, 3]], greedy)[0]) == 3  # and it serves
