"""Top-p without the full vocabulary sort (issue 42 item 3): the nucleus found among each row's
``CANDIDATES`` likeliest tokens is the full stable sort's, token for token (peaked rows, ties, tiny
top_p, top-k with top-p, rows of top_p 1); rows whose nucleus does not close there (flat) are sorted
whole, and counted; seeded rows reproduce alone and in any batch, fallback rows beside them or not."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.model_runner import sampler as sampler_module
from elastune_worker.engine.model_runner.sampler import CANDIDATES, Sampler

VOCAB = 1000
CPU = torch.device("cpu")
assert VOCAB > CANDIDATES  # else the sampler sorts whole and nothing here tests the candidates


def peaked(rows: int, seed: int) -> torch.Tensor:
    """Probabilities falling as rank^-2 (a nucleus of a few tokens), the ranks shuffled per row."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.argsort(torch.rand(rows, VOCAB, generator=gen), dim=-1).float() + 1
    return -2.0 * ranks.log()


def flat(rows: int, seed: int, std: float = 0.5) -> torch.Tensor:
    """Gaussian logits: at std 0.5 the candidates may hold top_p's mass but do not; at 0.05 even 256 of
    the likeliest cannot (the row is sorted whole without trying them)."""
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * std


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Row by row, the whole vocabulary sorted stably (equal probabilities: the lower token id first)."""
    row = logits.float() / p.temperature
    if 0 < p.top_k < row.shape[-1]:
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True, stable=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
        drop[0] = False
        probs = probs.scatter(0, order[drop], 0.0)
    return probs / probs.sum()


def drawn_from(
    monkeypatch: pytest.MonkeyPatch, s: Sampler, logits: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """The distributions the (unseeded) rows were drawn from, in one batched sample call."""
    seen: list[torch.Tensor] = []
    real = torch.multinomial

    def recording(probs: torch.Tensor, n: int, **kw: Any) -> torch.Tensor:
        seen.append(probs.clone())
        return real(probs, n, **kw)

    monkeypatch.setattr(sampler_module.torch, "multinomial", recording)
    s.sample(logits, [(f"r{i}", p) for i, p in enumerate(params)])
    monkeypatch.undo()
    assert len(seen) == 1
    return seen[0]


ROWS = [
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=1e-9),  # below float32's resolution: the likeliest only
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    SamplingParams(temperature=1.2, top_k=600, top_p=0.8),  # top_k past the candidates
    SamplingParams(temperature=1.0),  # top_p 1: untouched
    SamplingParams(temperature=1.5, top_p=0.99),
]


@pytest.mark.parametrize("shape", ["peaked", "flat", "flatter", "ties"])
def test_the_kept_set_and_distribution_are_the_full_sorts(
    monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    if shape == "ties":  # logits on a coarse grid: long runs of equal probabilities, at the boundary too
        logits = torch.round(peaked(len(ROWS), 3) * 0.5)
    elif shape == "flatter":
        logits = flat(len(ROWS), 1, std=0.05)
    else:
        logits = (peaked if shape == "peaked" else flat)(len(ROWS), 1)
    s = Sampler(CPU)
    got = drawn_from(monkeypatch, s, logits, ROWS)
    for i, p in enumerate(ROWS):
        want = reference(logits[i], p)
        assert torch.equal(got[i] > 0, want > 0), f"row {i}: kept set differs"
        torch.testing.assert_close(got[i] / got[i].sum(), want, rtol=1e-6, atol=1e-7, msg=str(i))
    assert int((got[2] > 0).sum()) == 1
    if shape == "peaked":
        assert s.full_sorts == 1  # only the last row's (0.99 at temperature 1.5) spreads past them
    if shape == "flat":
        assert s.full_sorts >= 3  # flat rows' nuclei are wider than the candidates: sorted whole


def test_a_tie_at_the_boundary_keeps_the_lower_token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the candidates: two of four equal tokens fit the nucleus, the two lowest ids are kept. A
    tie spanning the K-th candidate: which equal tokens topk picked is unspecified, so the row is sorted
    whole (counted) and again the lowest ids are kept."""
    inside = torch.full((VOCAB,), -30.0)
    inside[[7, 8]] = 5.0
    inside[[900, 10, 500, 20]] = 4.0  # equal: the nucleus below takes two of them
    across = torch.full((VOCAB,), -30.0)
    across[3] = 2.0
    across[torch.arange(999, 299, -1)] = 0.0  # 700 equal tokens, more than the candidates
    probs = torch.softmax(inside, -1)
    top_p = float(probs[[7, 8]].sum() + 1.5 * probs[10])  # past two of the four
    params = [SamplingParams(temperature=1.0, top_p=top_p), SamplingParams(temperature=1.0, top_p=0.5)]
    s = Sampler(CPU)
    got = drawn_from(monkeypatch, s, torch.stack([inside, across]), params)
    assert (got[0] > 0).nonzero().flatten().tolist() == [7, 8, 10, 20]
    mass_before = float(torch.softmax(across, -1)[3])
    n_tied = -(-int((0.5 - mass_before) / float(torch.softmax(across, -1)[300])) // 1)
    kept = (got[1] > 0).nonzero().flatten().tolist()
    assert kept[0] == 3 and kept[1:] == list(range(300, 300 + len(kept) - 1)) and len(kept) - 1 >= n_tied
    assert s.full_sorts == 1


def test_the_fallback_is_counted_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[int] = []
    real = Sampler._nucleus

    def counting(probs: torch.Tensor, top_p: torch.Tensor) -> Any:
        tried.append(len(probs))
        return real(probs, top_p)

    monkeypatch.setattr(Sampler, "_nucleus", staticmethod(counting))
    logits = torch.cat([peaked(5, 4), flat(3, 4), flat(2, 4, std=0.05)])
    s = Sampler(CPU)
    s.sample(logits, [(f"r{i}", SamplingParams(temperature=1.0, top_p=0.9)) for i in range(10)])
    assert s.full_sorts == 5 and tried == [8]  # the flattest two never tried among the candidates
    s.sample(logits[:5], [(f"r{i}", SamplingParams(temperature=1.0, top_p=0.9)) for i in range(5)])
    assert s.full_sorts == 5 and tried == [8, 5]


def test_seeded_rows_reproduce_alone_and_beside_fallback_rows() -> None:
    steps = [torch.cat([peaked(2, 10 + t), flat(2, 20 + t)]) for t in range(6)]
    fast = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    slow = SamplingParams(temperature=1.0, top_p=0.95, seed=8)  # its flat rows take the full sort
    other = SamplingParams(temperature=1.1, top_k=50, top_p=0.7)

    def run(batch: bool) -> list[tuple[int, int]]:
        s, out = Sampler(CPU), []
        for x in steps:
            if batch:
                t = s.sample(x, [("o1", other), ("f", fast), ("s", slow), ("o2", other)])
                out.append((t[1], t[2]))
            else:
                out.append((s.sample(x[1:2], [("f", fast)])[0], s.sample(x[2:3], [("s", slow)])[0]))
        return out

    alone = run(batch=False)
    assert alone == run(batch=False) == run(batch=True)


def test_the_ops_of_a_step_do_not_grow_with_the_rows_on_the_candidate_path() -> None:
    from tests.worker.engine.model_runner.test_sampler import _Ops

    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)

    def ops(rows: int) -> int:
        with _Ops() as mode:
            Sampler(CPU).sample(peaked(rows, 5), [(f"r{i}", params) for i in range(rows)])
        return sum(mode.count.values())

    assert ops(2) == ops(64)
