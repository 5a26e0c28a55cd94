"""Next-token sampling for a batch: greedy rows by argmax, the others with temperature, top-k and
top-p, each seeded request from its own generator (same seed → same tokens, whatever the batch).

The sampled rows are computed together: one temperature division, one top-k, one softmax, one top-p,
one multinomial draw for the unseeded rows (a seeded row draws from its own generator). Row by
row, each sampled request cost 7 torch ops (temperature alone) to 22 (top_k and top_p), each a kernel
launched from Python on a GPU: 449-1,409 a step at batch 64; now 13-39 a step whatever the batch
(counted with a dispatch counter on this CPU; a seeded row still draws alone: 332 ops for 64 seeded
rows). Every operation is per row, so a row's probabilities do not depend on the rest of the batch.

Top-p without sorting the vocabulary (issue 42: the full sort made a temperature + top-p step 0.76x
greedy on an H200): the nucleus is looked for among each row's ``CANDIDATES`` likeliest tokens (one
``topk``); where it closes there, the kept set, its order and its running sums are those of the full
stable sort, so the result is the same (exact, not approximate); only the rows where it does not (flat
distributions: top_p's mass spread over more than ``CANDIDATES`` tokens) are sorted whole. vLLM's
PyTorch path sorts the whole vocabulary for top-p and uses ``topk`` alone for top-k only; its GPU paths
avoid the sort with a pivot search (Triton) or FlashInfer's rejection sampling, which draw from the
same distribution but not the same token for a seed (vllm/v1/sample/ops/topk_topp_sampler.py).

A row that fails is that request's failure alone: it is recorded in ``failures`` (the engine ends that
request with the error) and the other rows are sampled as usual (when the batched draw fails, the rows
are sampled one by one to find which).

Failpoint (fault tests, ``elastune bench chaos``): with ``ELASTUNE_FAILPOINT`` naming ``sampler-raise``,
sampling a request whose seed is ``FAILPOINT_SEED`` raises, as a sampling bug hit by one request would.
"""

from __future__ import annotations

import logging
import os

import torch

from elastune_worker.engine.core.sampling import SamplingParams

FAILPOINT_ENV = "ELASTUNE_FAILPOINT"
SAMPLER_RAISE = "sampler-raise"
FAILPOINT_SEED = 424242

log = logging.getLogger("elastune.serving")
NO_DISTRIBUTION = "no valid next-token distribution (NaN or inf in the logits)"


CANDIDATES = 256
"""Top-p looks for each row's nucleus among its 256 likeliest tokens (one ``topk``) before sorting the
whole vocabulary: a language model's next-token nucleus at the top_p clients send is mostly far smaller."""


def nucleus_drop(sorted_p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which positions of descending probabilities fall outside the nucleus: those whose preceding mass
    already reaches top_p. The first token always stays (also for a top_p below float32's resolution);
    rows of top_p 1 keep all."""
    drop = (sorted_p.cumsum(-1) - sorted_p >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    return drop


def nucleus_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: the whole vocabulary sorted (stably: equal probabilities by token id), the
    smallest prefix whose mass reaches top_p kept, the rest zeroed."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    return probs.scatter(1, order, sorted_p.masked_fill(nucleus_drop(sorted_p, top_p), 0.0))


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.failures: dict[str, str] = {}
        """Requests whose row failed in a ``sample`` call since the last ``take_failures``: the why."""
        self.full_sorts = 0
        """Top-p rows whose nucleus did not close inside the candidates: sorted whole (flat rows)."""
        armed = os.environ.get(FAILPOINT_ENV, "")
        self.failpoint = SAMPLER_RAISE in (p.strip() for p in armed.split(","))
        if self.failpoint:
            log.warning("failpoint %s armed: seed %d fails in sampling", SAMPLER_RAISE, FAILPOINT_SEED)

    def _top_p(
        self, probs: torch.Tensor, top_p: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, list[bool]]:
        """The rows' probabilities with top-p applied (renormalised; rows of top_p 1 as they are), and
        which rows are valid. A row's nucleus is looked for among its candidates where it can close
        there: where the candidates' mass can reach top_p (at most CANDIDATES x the largest probability);
        the others, and those whose nucleus did not close there, are sorted whole. Both tell the same
        kept set, so which path a row takes changes no token."""
        applies = top_p[:, 0] < 1.0
        may_close = probs.amax(-1) * CANDIDATES >= top_p[:, 0]
        if probs.shape[-1] <= CANDIDATES:  # the candidates would be the whole vocabulary: sort it
            may_close = torch.zeros_like(applies)
        # one device-to-host copy for the invalid rows and which rows take which path
        valid_rows, fits, sorts = torch.stack([valid, applies & may_close, applies & ~may_close]).tolist()
        candidate_rows = [i for i, (ok, f) in enumerate(zip(valid_rows, fits, strict=True)) if ok and f]
        sort_rows = [i for i, (ok, f) in enumerate(zip(valid_rows, sorts, strict=True)) if ok and f]
        if len(sort_rows) == len(probs):  # every row sorted whole (flat rows): no copies of rows
            self.full_sorts += len(sort_rows)
            kept = nucleus_by_sort(probs, top_p)
            return torch.where(top_p < 1.0, kept / kept.sum(-1, keepdim=True), probs), valid_rows
        kept = probs.clone()  # rows of top_p 1, and invalid rows (reported failed), as they are
        if candidate_rows:
            kept[candidate_rows], closed = self._nucleus(probs[candidate_rows], top_p[candidate_rows])
            sort_rows += [i for i, c in zip(candidate_rows, closed.tolist(), strict=True) if not c]
        if sort_rows:
            self.full_sorts += len(sort_rows)
            kept[sort_rows] = nucleus_by_sort(probs[sort_rows], top_p[sort_rows])
        return torch.where(top_p < 1.0, kept / kept.sum(-1, keepdim=True), probs), valid_rows

    @staticmethod
    def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-p nucleus (its other probabilities zeroed, not renormalised) from its
        ``CANDIDATES`` likeliest tokens alone, and whether that row's nucleus closed inside them (else
        the caller recomputes the row with the full sort). Rows of top_p 1 count as closed."""
        # the K largest, ordered as the full stable sort orders them (ties: the lower token id first):
        # topk leaves the order of equal values unspecified, so by id first, then stably by value
        ids = torch.topk(probs, CANDIDATES, dim=-1).indices.sort(dim=-1).values
        cand, by_value = probs.gather(1, ids).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, by_value)
        drop = nucleus_drop(cand, top_p)
        last = cand.gather(1, (~drop).sum(-1, keepdim=True) - 1)
        # exact when the last kept value is above every token left out (all of which are <= the K-th):
        # then the full sort's first positions are these, in this order, with the same running sums
        closed = (last > cand[:, -1:])[:, 0] | (top_p[:, 0] >= 1.0)
        kept = torch.zeros_like(probs).scatter(1, ids, cand.masked_fill(drop, 0.0))
        return kept, closed

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def take_failures(self) -> dict[str, str]:
        failures, self.failures = self.failures, {}
        return failures

    def sample(self, logits: torch.Tensor, requests: list[tuple[str, SamplingParams]]) -> list[int]:
        logits = logits.float()
        out = logits.argmax(dim=-1)
        rows: list[int] = []
        greedy: list[int] = []
        for i, (rid, p) in enumerate(requests):
            if self.failpoint and p.seed == FAILPOINT_SEED:
                self._failed(rid, RuntimeError(f"failpoint {SAMPLER_RAISE}: seed {FAILPOINT_SEED}"))
            elif not p.greedy:
                rows.append(i)
            else:
                greedy.append(i)
        if greedy:
            # argmax answers for any row, NaN and inf included: a greedy row gets the check the sampled
            # rows' softmax makes (NaN or +inf anywhere, or no finite maximum, is no distribution)
            g = logits[greedy]
            greedy_ok = ~(g.isnan() | (g == float("inf"))).any(-1) & (g.amax(-1) > float("-inf"))
        if rows:
            try:
                out[rows], invalid = self._sample_rows(logits[rows], [requests[i] for i in rows])
            except Exception:  # which row: each alone (a failure is its request's, not the batch's)
                invalid = []
                for j, i in enumerate(rows):
                    try:
                        token, bad = self._sample_rows(logits[i : i + 1], [requests[i]])
                        out[i] = token[0]
                        invalid += [j] if bad else []
                    except Exception as exc:
                        self._failed(requests[i][0], exc)
            for j in invalid:
                self._failed(requests[rows[j]][0], ValueError(NO_DISTRIBUTION))
        if not greedy:
            return [int(t) for t in out.tolist()]
        # one device-to-host copy for the tokens and the greedy rows' check (each is a sync on a GPU)
        both = torch.cat([out, greedy_ok.to(out.dtype)]).tolist()
        for j, fine in enumerate(both[len(out) :]):
            if not fine:
                self._failed(requests[greedy[j]][0], ValueError(NO_DISTRIBUTION))
        return [int(t) for t in both[: len(out)]]

    def _failed(self, rid: str, exc: Exception) -> None:
        log.error("sampling request %s failed", rid, exc_info=exc)
        self.failures[rid] = f"sampling failed: {type(exc).__name__}: {exc}"
        self.generators.pop(rid, None)

    def _sample_rows(
        self, logits: torch.Tensor, requests: list[tuple[str, SamplingParams]]
    ) -> tuple[torch.Tensor, list[int]]:
        """One token per row of ``logits`` [R, V] (float32), each row with its request's parameters;
        and the rows whose distribution is not one (NaN, inf: their token is meaningless). Checked before
        any draw, so that no seeded generator advances for a draw that is thrown away."""
        params = [p for _, p in requests]
        dev, vocab = logits.device, logits.shape[-1]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(dev, non_blocking=True)[:, None]

        rows = logits / column([p.temperature for p in params])
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(ks):  # mask below each row's k-th largest value (ties with it stay); k 0: no mask
            top = torch.topk(rows, max(ks), dim=-1).values
            k = torch.tensor([max(x, 1) - 1 for x in ks], dtype=torch.long).to(dev, non_blocking=True)
            kth = top.gather(1, k[:, None])
            no_k = torch.tensor([x == 0 for x in ks]).to(dev, non_blocking=True)[:, None]
            kth = kth.masked_fill(no_k, float("-inf"))
            rows = rows.masked_fill(rows < kth, float("-inf"))
        probs = torch.softmax(rows, dim=-1)
        # NaN or inf logits in a row make its softmax, and so its sum, NaN (not > 0); top-p keeps that
        valid = probs.sum(-1) > 0
        if any(p.top_p < 1.0 for p in params):
            top_p = column([p.top_p for p in params])
            probs, valid_rows = self._top_p(probs, top_p, valid)
        else:
            valid_rows = valid.tolist()
        invalid = [i for i, ok in enumerate(valid_rows) if not ok]
        if invalid:  # drawn from a stand-in (uniform), reported as failed
            probs = torch.where(valid[:, None], probs, torch.ones_like(probs))
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        free = [i for i, p in enumerate(params) if p.seed is None]
        if not seeded:  # the common case: one draw for all
            return torch.multinomial(probs, 1)[:, 0], invalid
        out = torch.empty(len(params), dtype=torch.long, device=dev)
        if free:
            out[free] = torch.multinomial(probs[free], 1)[:, 0]
        for i in seeded:
            rid, p = requests[i]
            gen = self.generators.get(rid)
            if gen is None:
                gen = self.generators[rid] = torch.Generator(device=self.device).manual_seed(p.seed)  # type: ignore[arg-type]
            out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return out, invalid
