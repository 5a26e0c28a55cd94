"""Next-token sampling for a batch: greedy rows by argmax, the others with temperature, top-k and
top-p, each seeded request from its own generator (same seed → same tokens, whatever the batch)."""

from __future__ import annotations

import torch

from elastune_worker.serving.sampling import SamplingParams


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[tuple[str, SamplingParams]]) -> list[int]:
        logits = logits.float()
        out = logits.argmax(dim=-1)
        for i, (rid, p) in enumerate(requests):
            if p.greedy:
                continue
            row = logits[i] / p.temperature
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
            out[i] = torch.multinomial(probs, 1, generator=gen)[0]
        return [int(t) for t in out.tolist()]
