"""The Triton attention that reads the paged KV cache in place, against the gather + SDPA path and a direct
computation: mixed batches (decodes of different lengths, prefill chunks over a cached prefix, a chunk
that starts its sequence), grouped-query and multi-head attention, head sizes that are not powers of
two, padding rows. On the CPU the kernel runs in Triton's interpreter; on a GPU (the device script runs
this file) compiled, in float32 and bfloat16. Then whole engines: greedy outputs with the triton backend
equal the gather backend's for the tiny Llama and GPT-2, with chunked prefill and prefix-cache hits."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # the CPU runs the kernel in Triton's interpreter (set before the kernel's import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from elastune_demo import build as B  # noqa: E402
from elastune_worker.engine.core.config import EngineConfig  # noqa: E402
from elastune_worker.engine.core.sampling import SamplingParams  # noqa: E402
from elastune_worker.engine.llm_engine import LLMEngine  # noqa: E402
from elastune_worker.engine.model_runner import runner as MR  # noqa: E402
from elastune_worker.engine.model_runner.attention import (  # noqa: E402
    AttentionMetadata,
    DecodeGroup,
    paged_attention,
)
from elastune_worker.engine.model_runner.triton_attention import build_tiles  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]


def slots_of(table: list[int], length: int, page: int) -> list[int]:
    return [table[p // page] * page + p % page for p in range(length)]


def mixed_batch(page: int, n_heads: int, n_kv: int, d: int, dtype: torch.dtype, tile: int) -> dict:
    """Decodes with contexts of 1, 7, 10 and 33 tokens; a 14-token chunk after a 5-token cached prefix; a
    6-token chunk that starts its sequence; then the triton and the gather metadata of that step."""
    gen = torch.Generator().manual_seed(page * 100 + n_heads * 10 + d)
    blocks = 64
    need = {"a": 1, "b": 10, "c": 19, "d": 33, "e": 6}  # context of each sequence after the step
    shuffled = torch.randperm(blocks, generator=gen).tolist()  # scattered blocks, none shared
    tables: dict[str, list[int]] = {}
    for s, n in need.items():
        tables[s], shuffled = shuffled[: -(-n // page)], shuffled[-(-n // page) :]
    work = [("a", 0, 1), ("b", 9, 1), ("c", 5, 14), ("d", 32, 1), ("e", 0, 6)]  # (seq, start, tokens)
    rows = sum(n for _, _, n in work)
    q = torch.randn(rows, n_heads, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(rows, n_kv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(rows, n_kv, d, generator=gen).to(DEVICE, dtype)
    cache = [torch.randn(n_kv, blocks * page, d, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    slot_mapping, positions, firsts = [], [], []
    row = 0
    for s, start, n in work:
        slot_mapping += slots_of(tables[s], start + n, page)[start:]
        positions += range(start, start + n)
        firsts.append(row)
        row += n
    common = {
        "slot_mapping": torch.tensor(slot_mapping, device=DEVICE),
        "positions": torch.tensor(positions, device=DEVICE),
        "logits_index": torch.arange(rows, device=DEVICE),
    }
    fresh = (firsts[4], firsts[4] + 6, None, None)
    decodes = [(firsts[i], 1, work[i][1] + 1, tables[work[i][0]]) for i in (0, 1, 3)]
    width = max(-(-c // page) for _, _, c, _ in decodes)
    triton_meta = AttentionMetadata(**common, page_size=page, prefills=[fresh])
    triton_meta.paged = [
        build_tiles(decodes, width, 1, DEVICE),
        build_tiles([(firsts[2], 14, 19, tables["c"])], -(-19 // page), tile, DEVICE),
    ]
    gather_meta = AttentionMetadata(**common, prefills=[fresh])
    for r, _, ctx, table in decodes:
        w = -(-ctx // page)
        mask = (torch.arange(w * page) < ctx).view(1, 1, 1, -1).to(DEVICE)
        gather_meta.decodes.append(
            DecodeGroup(torch.tensor([r], device=DEVICE), torch.tensor([table[:w]], device=DEVICE), mask)
        )
    ctx = torch.arange(19)
    ctx_slots = torch.tensor(slots_of(tables["c"], 19, page), device=DEVICE)
    causal = (ctx[None, :] <= torch.arange(5, 19)[:, None]).view(1, 1, 14, 19).to(DEVICE)
    gather_meta.prefills.append((firsts[2], firsts[2] + 14, ctx_slots, causal))
    contexts = [(s, start + i) for s, start, n in work for i in range(n)]
    return {
        "qkv": (q, k, v),
        "cache": cache,
        "triton": triton_meta,
        "gather": gather_meta,
        "contexts": contexts,
        "tables": tables,
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "d"),
    [(4, 2, 32), (4, 4, 32), (6, 2, 24), (8, 1, 64)],
    ids=["gqa", "mha", "rep3-d24", "mqa"],
)
@pytest.mark.parametrize(("page", "tile"), [(16, 16), (4, 4)])
def test_in_place_attention_equals_gather_and_direct_attention(page, tile, n_heads, n_kv, d, dtype):
    b = mixed_batch(page, n_heads, n_kv, d, dtype, tile)
    q, k, v = b["qkv"]
    outs = {}
    for path in ("triton", "gather"):
        kc, vc = b["cache"][0].clone(), b["cache"][1].clone()
        outs[path] = paged_attention(q, k, v, kc, vc, b[path], d**-0.5)
        caches = (kc, vc)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(outs["triton"], outs["gather"], **tol)
    kc, vc = (c.float() for c in caches)
    rep = n_heads // n_kv
    for i, (s, p) in enumerate(b["contexts"]):  # each token attends to its context up to itself
        ctx = torch.tensor(slots_of(b["tables"][s], p + 1, page), device=DEVICE)
        for h in range(n_heads):
            kh, vh = kc[h // rep, ctx], vc[h // rep, ctx]
            expected = torch.softmax(kh @ q[i, h].float() * d**-0.5, dim=0) @ vh
            torch.testing.assert_close(outs["triton"][i, h].float(), expected, **tol)


def test_padding_rows_read_nothing_and_leave_other_rows_alone():
    page, n_heads, n_kv, d = 16, 4, 2, 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, n_heads, d, generator=gen).to(DEVICE)
    cache = [torch.randn(n_kv, 8 * page, d, generator=gen).to(DEVICE) for _ in range(2)]
    out = torch.full((3, n_heads, d), float("nan"), device=DEVICE)
    # Row 1 is padding (context 0, as a CUDA graph pads a batch); rows 0 and 2 are decodes.
    tiles = build_tiles([(0, 1, 5, [2]), (1, 1, 0, [0]), (2, 1, 20, [4, 6])], 2, 1, DEVICE)
    from elastune_worker.engine.model_runner.triton_attention import paged_attention_in_place

    paged_attention_in_place(q, cache[0], cache[1], out, tiles, d**-0.5, page)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for row, ctx, table in ((0, 5, [2]), (2, 20, [4, 6])):
        slots = torch.tensor(slots_of(table, ctx, page), device=DEVICE)
        for h in range(n_heads):
            kh, vh = cache[0][h // 2, slots], cache[1][h // 2, slots]
            expected = torch.softmax(kh @ q[row, h] * d**-0.5, dim=0) @ vh
            torch.testing.assert_close(out[row, h], expected, rtol=1e-5, atol=1e-5)


def test_backend_choice(monkeypatch):
    assert MR.pick_attention_backend("gather", DEVICE, torch.float32) == "gather"
    expected_auto = "triton" if ON_GPU else "gather"  # auto uses Triton on CUDA only
    assert MR.pick_attention_backend("auto", DEVICE, torch.float32) == expected_auto
    assert MR.pick_attention_backend("triton", DEVICE, torch.float32) == "triton"  # passes its check
    if not ON_GPU:  # outside the interpreter the CPU cannot run it: a clear error when asked for
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="interpreter"):
            MR.pick_attention_backend("triton", DEVICE, torch.float32)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")  # type: ignore[arg-type]


def test_start_up_check_rejects_a_kernel_that_computes_wrong_values(monkeypatch):
    def wrong(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        got, expected = real(device, dtype)
        return got + 0.1, expected

    real = MR._triton_check_outputs
    monkeypatch.setattr(MR, "_triton_check_outputs", wrong)
    assert "differs" in (MR.triton_problem(DEVICE, torch.float32) or "")
    with pytest.raises(ValueError, match="differs"):
        MR.pick_attention_backend("triton", DEVICE, torch.float32)


PROMPTS = [
    "12 km →",
    "Read the record and return one value. book: Dune; author: Frank Herbert →",
    "Read the record and return one value. book: Emma; author: Jane Austen →",
    "hello",
]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_engine_greedy_outputs_equal_with_either_backend(arch):
    spec = B.TINY_LLAMA_SPEC if arch == "llama" else B.DEFAULT_SPEC
    path = B.ensure_tiny_model(spec=spec)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("gather", "triton"):
        # fp32 and no CUDA graphs: the comparison is of the attention alone; a 16-token budget chunks
        # the long prompts (chunks over a cached prefix), and the second shares the first's prefix.
        config = EngineConfig(
            kv_cache_tokens=4096,
            max_num_batched_tokens=16,
            attention_backend=backend,
            dtype="float32",
            cuda_graphs=False,
        )
        eng = LLMEngine(path, config)
        assert eng.runner.attention_backend == backend
        outs[backend] = eng.generate(PROMPTS, greedy)
    assert outs["triton"] == outs["gather"]


@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize(("n_heads", "n_kv", "d"), [(4, 2, 32), (6, 2, 24)], ids=["gqa", "rep3-d24"])
def test_split_contexts_equal_one_pass(splits, n_heads, n_kv, d):
    """Flash-decoding: each decode's context cut into ``splits`` runs of whole key blocks, each attended
    by its own program, then merged. Contexts of 1 token (most splits empty), 17, 64 (exactly one
    key block), 200 (a ragged last split) and a padding row (context 0, written as zeros)."""
    from elastune_worker.engine.model_runner.triton_attention import LaunchTuning, paged_attention_in_place

    page = 16
    gen = torch.Generator().manual_seed(splits)
    contexts = [1, 17, 64, 0, 200]
    pages = [max(1, -(-c // page)) for c in contexts]
    order = torch.randperm(sum(pages), generator=gen).tolist()
    tables = [order[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(contexts))]
    q = torch.randn(len(contexts), n_heads, d, generator=gen).to(DEVICE)
    cache = [torch.randn(n_kv, sum(pages) * page, d, generator=gen).to(DEVICE) for _ in range(2)]
    tiles = build_tiles(
        [(i, 1, c, t) for i, (c, t) in enumerate(zip(contexts, tables, strict=True))], max(pages), 1, DEVICE
    )
    out = torch.full_like(q, float("nan"))
    paged_attention_in_place(q, cache[0], cache[1], out, tiles, d**-0.5, page, LaunchTuning(splits=splits))
    rep = n_heads // n_kv
    for row, (ctx, table) in enumerate(zip(contexts, tables, strict=True)):
        if ctx == 0:
            assert torch.equal(out[row], torch.zeros_like(out[row]))
            continue
        slots = torch.tensor(slots_of(table, ctx, page), device=DEVICE)
        for h in range(n_heads):
            kh, vh = cache[0][h // rep, slots], cache[1][h // rep, slots]
            expected = torch.softmax(kh @ q[row, h] * d**-0.5, dim=0) @ vh
            torch.testing.assert_close(out[row, h], expected, rtol=1e-5, atol=1e-5)


def test_small_decode_batches_split_their_contexts():
    from elastune_worker.engine.model_runner import triton_attention as TA

    slots = TA._multiprocessors(DEVICE) if ON_GPU else TA.CPU_PROGRAM_SLOTS
    assert TA.decode_splits(1, DEVICE) == min(TA.MAX_SPLITS, 1 << (2 * slots - 1).bit_length())
    assert TA.decode_splits(2 * slots, DEVICE) == 1  # the batch fills the device alone
    assert all(
        s & (s - 1) == 0 and s <= TA.MAX_SPLITS
        for s in map(lambda p: TA.decode_splits(p, DEVICE), range(1, 99))
    )
    with pytest.raises(ValueError, match="power of 2"):
        q = torch.zeros(1, 2, 16, device=DEVICE)
        tiles = build_tiles([(0, 1, 1, [0])], 1, 1, DEVICE)
        TA.paged_attention_in_place(q, q[:, :1].transpose(0, 1), q[:, :1].transpose(0, 1), q, tiles, 1.0, 16,
                                    TA.LaunchTuning(splits=3))  # fmt: skip
