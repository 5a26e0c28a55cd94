"""How a request samples and when it stops (validated at construction, so errors name the field)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""torch.Generator.manual_seed's inclusive range: a seed outside it fails while sampling."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    """Tokens to generate at most (finish reason ``length``)."""
    temperature: float = 1.0
    """0 is greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 or 0: no top-k cut."""
    seed: int | None = None
    """Per-request generator: the same seed and prompt give the same tokens, whatever the batch."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the output stops before them (as OpenAI's API and vLLM do)."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # (NaN fails this too)
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        # Temperatures this small overflow logits / T (inf, then NaN probabilities): they mean argmax.
        return self.temperature < 1e-5 or self.top_k == 1
