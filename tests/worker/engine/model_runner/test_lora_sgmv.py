"""The Triton LoRA kernels (lora/sgmv.py) against the torch path's arithmetic: adapters of mixed ranks,
base rows between theirs, more rows than a tile, outputs that are column slices of a wider tensor, the
padded (batch max rank) and unpadded (own rank) reads; then whole engines: greedy tokens with
lora_backend triton equal torch's for a mixed batch of ranks 8-64 and base requests with chunked
prefill, both kernels, and the backend's choice and fallback. On the CPU the kernels run in Triton's
interpreter; on a GPU (the device script runs this file) compiled, in float32 and bfloat16."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # the CPU runs the kernels in Triton's interpreter (set before the kernels' import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton LoRA kernels need the triton package")
pytest.importorskip("peft")

from elastune_demo import adapters as A  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.engine.model_runner.lora import sgmv  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def slots(n: int, rank: int, d_in: int, d_out: int, ranks: list[int], dtype: torch.dtype, seed: int = 0):
    """Device-slot-shaped A and (B·s)ᵀ, zero past each slot's rank (as slots.py fills them)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, rank, d_in, generator=gen) / d_in**0.5
    bt = torch.randn(n, rank, d_out, generator=gen)
    for s, r in enumerate(ranks):
        a[s, r:] = 0
        bt[s, r:] = 0
    return a.to(DEVICE, dtype), bt.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize(
    ("d_in", "programs"),
    [(48, sgmv.SHRINK_PROGRAMS), (200, sgmv.SHRINK_PROGRAMS), (200, 10)],
    ids=["one-k-step", "split-k-by-step", "split-k-by-two-steps"],
)
def test_segmented_launches_equal_the_per_adapter_torch_path(dtype, padded, d_in, programs, monkeypatch):
    """d_in 200 is four of the shrink's K steps, the last one partial: split in four, or (fewer programs
    wanted than 4 per tile) in two splits of two steps."""
    monkeypatch.setattr(sgmv, "SHRINK_PROGRAMS", programs)
    d_out, max_rank = 40, 64
    ranks = [8, 64, 16, 0]  # slot 3 is empty
    a, bt = slots(4, max_rank, d_in, d_out, ranks, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, d_in, generator=gen).to(DEVICE, dtype)
    # slot 1 has more rows than a tile, interleaved with others; rows 3, 7, ... are base rows (no delta)
    by_slot = {1: [r for r in range(40) if r % 4 in (0, 1)], 0: [2, 38], 2: [6]}
    batch_rank = max(ranks[s] for s in by_slot)
    groups = [(s, rows, batch_rank if padded else ranks[s]) for s, rows in by_slot.items()]
    wide = torch.randn(40, d_out + 24, generator=gen).to(DEVICE, dtype)
    got, expected = wide.clone(), wide.clone()
    sgmv.add(got[:, 16 : 16 + d_out], x, a, bt, sgmv.build_tiles(groups, max_rank, DEVICE))
    sgmv.reference_add(expected[:, 16 : 16 + d_out], x, a, bt, groups)
    # bfloat16: each path rounds the two products and the sum (the interpreter truncates): a few steps
    steps = 1e-6 if dtype == torch.float32 else (2 if ON_GPU else 4) * 2**-8
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= steps * expected.float().abs().max().item(), err
    untouched = [r for r in range(40) if r % 4 == 3 and r not in (2, 38, 6)]
    assert torch.equal(got[untouched], wide[untouched])  # base rows and the columns beside the slice
    assert torch.equal(got[:, :16], wide[:, :16]) and torch.equal(got[:, 16 + d_out :], wide[:, 16 + d_out :])
    assert not torch.equal(got[by_slot[1]], wide[by_slot[1]])  # and the adapters' rows did change


def test_split_k_covers_the_input_features_once():
    for n_tiles, d_in in ((1, 4096), (8, 4096), (8, 14336), (200, 4096), (600, 200), (5, 200), (40, 48)):
        splits, chunk = sgmv.k_split(n_tiles, d_in)
        assert chunk % sgmv.BLOCK_K == 0 and (splits - 1) * chunk < d_in <= splits * chunk
        assert splits == 1 or n_tiles * splits <= max(sgmv.SHRINK_PROGRAMS, n_tiles)
    assert sgmv.k_split(8, 4096) == (32, 128)  # a decode step's 8 tiles: 256 programs


def test_padding_tiles_and_rows_change_nothing():
    """A CUDA graph's table has fixed lengths: the step's tiles, then padding tiles of count and rank 0
    (the kernels skip them), and row entries past the step's rows."""
    a, bt = slots(3, 16, 200, 24, [16, 8, 4], torch.float32)
    x = torch.randn(20, 200, device=DEVICE)
    groups = [(0, list(range(0, 20, 2)), 16), (2, [1, 19], 4)]
    want, got = torch.zeros(20, 24, device=DEVICE), torch.zeros(20, 24, device=DEVICE)
    sgmv.add(want, x, a, bt, sgmv.build_tiles(groups, 16, DEVICE))
    flat = torch.from_numpy(sgmv.tile_table(groups, 24, 9)).to(DEVICE)
    sgmv.add(got, x, a, bt, sgmv.SegmentTiles(flat[:24], flat[24:], 9, sgmv.block_rank(16)))
    assert torch.equal(got, want) and got[1::2][1:-1].eq(0).all()
    with pytest.raises(ValueError, match="do not fit"):
        sgmv.tile_table(groups, 24, 1)


def test_a_tile_reads_only_its_rank():
    """The unpadded read stops at the adapter's rank: garbage past it in the slot is never read (the
    padded read at a larger batch rank would)."""
    a, bt = slots(2, 32, 16, 16, [8, 32], torch.float32)
    a[0, 8:] = float("nan")
    bt[0, 8:] = float("nan")
    x = torch.randn(3, 16, device=DEVICE)
    out = torch.zeros(3, 16, device=DEVICE)
    sgmv.add(out, x, a, bt, sgmv.build_tiles([(0, [0, 2], 8), (1, [1], 32)], 32, DEVICE))
    assert torch.isfinite(out).all()
    padded = torch.zeros(3, 16, device=DEVICE)
    sgmv.add(padded, x, a, bt, sgmv.build_tiles([(0, [0, 2], 32), (1, [1], 32)], 32, DEVICE))
    assert torch.isnan(padded[[0, 2]]).all() and torch.isfinite(padded[1]).all()


def test_the_start_up_check_passes_here_and_names_what_fails():
    shapes = {"q_proj": (64, 64), "down_proj": (128, 64)}
    assert sgmv.triton_problem(DEVICE, torch.float32, shapes, 16) is None
    assert sgmv.pick_lora_backend("auto", torch.device("cpu"), torch.float32, shapes, 16) == "torch"
    assert sgmv.pick_lora_backend("triton", DEVICE, torch.float32, shapes, 16) == "triton"


def test_a_kernel_that_computes_wrong_is_refused_at_start_up(monkeypatch):
    real = sgmv.add

    def off_by_a_bit(out, x, a, bt, tiles):
        real(out, x, a, bt, tiles)
        out.add_(0.5)

    monkeypatch.setattr(sgmv, "add", off_by_a_bit)
    shapes = {"q_proj": (32, 32)}
    assert "differs from the torch path" in (sgmv.triton_problem(DEVICE, torch.float32, shapes, 8) or "")
    with pytest.raises(ValueError, match="lora_backend triton: at \\(32, 32\\)"):
        sgmv.pick_lora_backend("triton", DEVICE, torch.float32, shapes, 8)
    if ON_GPU:  # auto falls back to the torch path instead of serving wrong tokens
        assert sgmv.pick_lora_backend("auto", DEVICE, torch.float32, shapes, 8) == "torch"


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="lora_backend must be auto, torch or triton"):
        EngineConfig(lora_backend="cuda")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_and_adapters():
    base = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    return base, {r: A.ensure_tiny_adapter(r) for r in (8, 16, 64)}


@pytest.mark.parametrize("kernel", ["padded", "unpadded"])
def test_engine_tokens_with_triton_lora_equal_the_torch_paths(model_and_adapters, kernel):
    base, paths = model_and_adapters
    prompts = ["198 km →", "window window harbor →", "1907-02-28 →", "age: 64; city: rome; name: dara →"]
    loras = ["r8", None, "r64", "r16"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {}
    for backend in ("torch", "triton"):
        config = EngineConfig(
            kv_cache_tokens=4096, enable_lora=True, max_loras=4, lora_kernel=kernel,
            lora_backend=backend, max_num_batched_tokens=24, cuda_graphs=False,
        )  # fmt: skip
        eng = LLMEngine(base, config)
        assert eng.runner.lora_backend == backend
        for r, p in paths.items():
            eng.load_lora(f"r{r}", str(p))
        out[backend] = eng.generate(prompts, greedy, loras)
    assert out["triton"] == out["torch"]
