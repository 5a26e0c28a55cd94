"""Next-token sampling for a batch: greedy rows by argmax, the others with temperature, top-k and
top-p, each seeded request from its own generator (same seed → same tokens, whatever the batch).

A row that fails is that request's failure alone: it is recorded in ``failures`` (the engine ends that
request with the error) and the other rows are sampled as usual.

Failpoint (fault tests, ``elastune bench chaos``): with ``ELASTUNE_FAILPOINT`` naming ``sampler-raise``,
sampling a request whose seed is ``FAILPOINT_SEED`` raises, as a sampling bug hit by one request would.
"""

from __future__ import annotations

import logging
import os

import torch

from elastune_batching.sampling import SamplingParams

FAILPOINT_ENV = "ELASTUNE_FAILPOINT"
SAMPLER_RAISE = "sampler-raise"
FAILPOINT_SEED = 424242

log = logging.getLogger("elastune.serving")


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.failures: dict[str, str] = {}
        """Requests whose row failed in a ``sample`` call since the last ``take_failures``: the why."""
        armed = os.environ.get(FAILPOINT_ENV, "")
        self.failpoint = SAMPLER_RAISE in (p.strip() for p in armed.split(","))
        if self.failpoint:
            log.warning("failpoint %s armed: seed %d fails in sampling", SAMPLER_RAISE, FAILPOINT_SEED)

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def take_failures(self) -> dict[str, str]:
        failures, self.failures = self.failures, {}
        return failures

    def sample(self, logits: torch.Tensor, requests: list[tuple[str, SamplingParams]]) -> list[int]:
        logits = logits.float()
        out = logits.argmax(dim=-1)
        for i, (rid, p) in enumerate(requests):
            if p.greedy and not self.failpoint:
                continue
            try:
                if self.failpoint and p.seed == FAILPOINT_SEED:
                    raise RuntimeError(f"failpoint {SAMPLER_RAISE}: seed {FAILPOINT_SEED}")
                if p.greedy:
                    continue
                out[i] = self._sample_row(logits[i], rid, p)
            except Exception as exc:  # this request's failure, not the batch's
                log.exception("sampling request %s failed", rid)
                self.failures[rid] = f"sampling failed: {type(exc).__name__}: {exc}"
                self.generators.pop(rid, None)
        return [int(t) for t in out.tolist()]

    def _sample_row(self, logits: torch.Tensor, rid: str, p: SamplingParams) -> torch.Tensor:
        row = logits / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (the first token always stays)
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            drop[0] = False  # a top_p below float32's resolution still keeps the likeliest token
            probs = probs.scatter(0, order[drop], 0.0)
            probs = probs / probs.sum()
        gen = None
        if p.seed is not None:
            gen = self.generators.get(rid)
            if gen is None:
                gen = self.generators[rid] = torch.Generator(device=self.device).manual_seed(p.seed)
        return torch.multinomial(probs, 1, generator=gen)[0]
