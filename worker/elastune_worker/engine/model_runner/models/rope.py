"""Rotary position embeddings as a checkpoint's config.json asks for them: the base frequency and the
scaling (``rope_scaling`` beside a top-level ``rope_theta`` in configs written by transformers 4.x and
on most hub checkpoints; ``rope_parameters`` holding both from 5.x; ``type`` in old ones).

Served: ``default``; ``linear`` (positions divided by ``factor``: every frequency divided by it);
``llama3`` (Llama 3.1 and 3.2: frequencies whose wavelength exceeds the original context divided by
``factor``, those shorter than ``original / high_freq_factor`` kept, a smooth mix between; Meta's
published scaling). The other types (dynamic, yarn, longrope, ...) change the attention's scale too or
depend on the sequence's length: refused by name rather than served with the wrong rotation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SERVED = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Rope:
        """ValueError naming the type when the engine does not compute it."""
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        kind = params.get("rope_type") or params.get("type") or "default"
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if kind not in SERVED:
            raise ValueError(f"rope_type {kind!r} is not supported (supported: {', '.join(SERVED)})")
        if kind == "default":
            return cls(theta)
        factor = float(params["factor"])
        if kind == "linear":
            return cls(theta, kind, factor)
        return cls(
            theta,
            kind,
            factor,
            float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)),
            int(params.get("original_max_position_embeddings", 8192)),
        )

    def inv_freq(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """One frequency per pair of dimensions, float32."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        freq = 1.0 / (self.theta**exponents)
        if self.kind == "linear":
            return freq / self.factor
        if self.kind == "llama3":
            wavelength = 2 * math.pi / freq
            long_limit = self.original_context / self.low_freq_factor  # longer: scaled down fully
            short_limit = self.original_context / self.high_freq_factor  # shorter: kept
            mix = (self.original_context / wavelength - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            between = (1 - mix) * freq / self.factor + mix * freq
            scaled = torch.where(wavelength > long_limit, freq / self.factor, between)
            return torch.where(wavelength < short_limit, freq, scaled)
        return freq

    def table(self, head_dim: int, max_pos: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's angles, [max_pos, head_dim] (each frequency twice, halves
        rotated as transformers' Llama does)."""
        freqs = torch.outer(torch.arange(max_pos, device=device).float(), self.inv_freq(head_dim, device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
