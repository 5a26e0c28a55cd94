"""The batched sampler: every sampled row's distribution is the one its own parameters give (temperature,
top-k, top-p, as computed row by row before), whatever else is in the batch; seeded rows reproduce
alone or in any batch; one bad row fails alone; and the kernels a step launches do not grow with the
number of sampled rows (row by row they were 7-22 per row: 449-1,409 at batch 64, each a launch on a
GPU)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.model_runner import sampler as sampler_module
from elastune_worker.engine.model_runner.sampler import Sampler

VOCAB = 50
CPU = torch.device("cpu")


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The row-by-row computation the sampler used before it was batched."""
    row = logits.float() / p.temperature
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
        drop[0] = False
        probs = probs.scatter(0, order[drop], 0.0)
        probs = probs / probs.sum()
    return probs


PARAMS = [
    SamplingParams(temperature=0.0),  # greedy
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.8, seed=11),
    SamplingParams(temperature=1.0, top_k=VOCAB + 3),  # top_k past the vocabulary: no mask
    SamplingParams(temperature=2.0, top_p=1e-9, seed=5),  # below float32's resolution: the likeliest only
]


def captured_probs(monkeypatch: pytest.MonkeyPatch, logits: torch.Tensor) -> tuple[list[int], list[Any]]:
    """Sample the PARAMS rows once, recording every distribution handed to torch.multinomial."""
    seen: list[Any] = []
    real = torch.multinomial

    def recording(probs: torch.Tensor, n: int, **kw: Any) -> torch.Tensor:
        seen.append(probs.clone())
        return real(probs, n, **kw)

    monkeypatch.setattr(sampler_module.torch, "multinomial", recording)
    tokens = Sampler(CPU).sample(logits, [(f"r{i}", p) for i, p in enumerate(PARAMS)])
    monkeypatch.undo()
    return tokens, seen


def test_each_row_is_drawn_from_the_distribution_its_own_parameters_give(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    tokens, seen = captured_probs(monkeypatch, logits)
    free = [i for i, p in enumerate(PARAMS) if not p.greedy and p.seed is None]
    seeded = [i for i, p in enumerate(PARAMS) if not p.greedy and p.seed is not None]
    assert len(seen) == 1 + len(seeded)  # one draw for all unseeded rows, one per seeded row
    assert seen[0].shape == (len(free), VOCAB)
    drawn = dict(zip(free, seen[0], strict=True)) | dict(zip(seeded, seen[1:], strict=True))
    for i, probs in drawn.items():
        want = reference_probs(logits[i], PARAMS[i])
        torch.testing.assert_close(probs / probs.sum(), want / want.sum(), rtol=1e-6, atol=1e-7, msg=str(i))
        assert want[tokens[i]] > 0, f"row {i} drew a token its parameters exclude"
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[6] == int(logits[6].argmax())  # top_p below float32's resolution keeps the likeliest


def test_a_seeded_row_gives_the_same_tokens_alone_and_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randn(6, VOCAB, generator=gen) for _ in range(5)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    others = [SamplingParams(temperature=1.1, top_k=4), SamplingParams(temperature=0.0)]
    alone, crowd = Sampler(CPU), Sampler(CPU)
    got_alone, got_crowd = [], []
    for logits in steps:
        got_alone.append(alone.sample(logits[2:3], [("s", seeded)])[0])
        batch = [("a", others[0]), ("b", others[1]), ("s", seeded), ("c", others[0])]
        got_crowd.append(crowd.sample(logits[:4], batch)[2])
    assert got_alone == got_crowd


def test_a_row_without_a_distribution_fails_alone_and_the_others_are_sampled() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    logits[1] = float("nan")
    s = Sampler(CPU)
    reqs = [(f"r{i}", SamplingParams(temperature=1.0, seed=3 + i)) for i in range(4)]
    tokens = s.sample(logits, reqs)
    failures = s.take_failures()
    assert set(failures) == {"r1"} and "no valid next-token distribution" in failures["r1"]
    # the other seeded rows drew exactly what they draw without the bad row beside them
    clean = Sampler(CPU)
    keep = [0, 2, 3]
    again = clean.sample(logits[keep], [reqs[i] for i in keep])
    assert [tokens[i] for i in keep] == again and not clean.take_failures()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_greedy_row_without_a_distribution_fails_alone(bad: float) -> None:
    """Greedy rows get the same check as sampled ones (issue 38 item 3): an adapter whose finite weights
    overflow made a greedy request's logits NaN/inf, argmax picked token 0 (or the inf) and the request
    ended 200 with a wrong answer. A row of -inf everywhere but one token is a valid distribution."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[1, 7] = bad
    logits[2] = float("-inf")
    logits[3, :] = float("-inf")
    logits[3, 11] = 1.0
    s = Sampler(CPU)
    reqs = [(f"r{i}", SamplingParams(temperature=0.0)) for i in range(4)]
    tokens = s.sample(logits, reqs)
    failures = s.take_failures()
    assert set(failures) == {"r1", "r2"}
    assert all("no valid next-token distribution" in why for why in failures.values())
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] == 11


def test_an_error_in_the_batched_draw_is_found_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything else that raises for the batch: each row is sampled alone, and only the row that still
    raises fails."""
    real_topk = torch.topk

    def flaky(rows: torch.Tensor, k: int, **kw: Any) -> Any:
        if rows.shape[0] > 1 or k == 3:  # the batch, and the one request whose top_k is 3
            raise RuntimeError("kernel error")
        return real_topk(rows, k, **kw)

    monkeypatch.setattr(sampler_module.torch, "topk", flaky)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    s = Sampler(CPU)
    reqs = [("a", SamplingParams(top_k=5)), ("b", SamplingParams(top_k=3)), ("c", SamplingParams(top_k=7))]
    tokens = s.sample(logits, reqs)
    assert set(s.take_failures()) == {"b"}
    assert len(tokens) == 3


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=20, top_p=0.9), SamplingParams()])
def test_the_ops_of_a_step_do_not_grow_with_the_sampled_rows(params: SamplingParams) -> None:
    def ops(rows: int) -> int:
        logits = torch.randn(rows, VOCAB)
        with _Ops() as mode:
            Sampler(CPU).sample(logits, [(f"r{i}", params) for i in range(rows)])
        return sum(mode.count.values())

    few, many = ops(2), ops(64)
    assert many == few, (few, many)
