"""Paged attention against a direct computation: decodes of different lengths in one padded group and a
prefill chunk over a cached prefix, grouped-query heads, through both decode paths (one KV head at a
time, the CPU's; all heads in one call, CUDA's — run here on the CPU so it is checked somewhere)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from elastune_worker.engine.model_runner.attention import (  # noqa: E402
    AttentionMetadata,
    DecodeGroup,
    paged_attention,
)

BS, KV, H, D = 4, 2, 4, 8
SCALE = D**-0.5


def slots_of(table: list[int], length: int) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in range(length)]


@pytest.mark.parametrize("per_head", [True, False])
def test_paged_attention_equals_attention_over_each_tokens_context(per_head: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(KV, 32 * BS, D, generator=gen)
    v_cache = torch.randn(KV, 32 * BS, D, generator=gen)
    # Two decodes (contexts of 7 and 10 tokens) and a 3-token chunk at positions 5-7 of a cached prefix.
    tables = {"a": [5, 9], "b": [1, 3, 12], "c": [20, 21]}
    rows = [("a", 6), ("b", 9), ("c", 5), ("c", 6), ("c", 7)]  # (sequence, position) of each step token
    q = torch.randn(len(rows), H, D, generator=gen)
    k = torch.randn(len(rows), KV, D, generator=gen)
    v = torch.randn(len(rows), KV, D, generator=gen)
    slot_mapping = torch.tensor([slots_of(tables[s], p + 1)[p] for s, p in rows])
    decode_lens = torch.tensor([7, 10])
    width = 3 * BS
    group = DecodeGroup(
        index=torch.tensor([0, 1]),
        blocks=torch.tensor([tables["a"] + [0], tables["b"]]),
        mask=(torch.arange(width)[None, :] < decode_lens[:, None]).view(2, 1, 1, width),
    )
    ctx = torch.arange(8)
    causal = (ctx[None, :] <= torch.arange(5, 8)[:, None]).view(1, 1, 3, 8)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        positions=torch.tensor([p for _, p in rows]),
        logits_index=torch.tensor([0, 1, 4]),
        decodes=[group],
        prefills=[(2, 5, torch.tensor(slots_of(tables["c"], 8)), causal)],
    )
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, per_head=per_head)

    # The step's K/V are in the cache at their slots; each token attends to its context up to itself.
    for i, (s, p) in enumerate(rows):
        slot = slot_mapping[i]
        assert torch.equal(k_cache[:, slot], k[i]) and torch.equal(v_cache[:, slot], v[i])
        context = torch.tensor(slots_of(tables[s], p + 1))
        for h in range(H):
            kh, vh = k_cache[h // (H // KV), context], v_cache[h // (H // KV), context]
            expected = torch.softmax(kh @ q[i, h] * SCALE, dim=0) @ vh
            torch.testing.assert_close(out[i, h], expected, rtol=1e-5, atol=1e-5)
