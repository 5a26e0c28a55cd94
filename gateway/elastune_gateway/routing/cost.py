"""The performance model a worker publishes and every cost-based policy (and the simulator) reads.

One iteration of a continuous-batching engine runs the decode batch (one token per running request)
and, beside it, chunks of prompts being prefilled. Its time is modelled as

    iteration = base + per_seq·batch + per_kv_token·context            (the base model's decode)
              + LoRA(ranks of the decode batch)                          (CaraServe §5)
              + prefill_per_token·chunk_tokens + prefill_lora·Σ chunk·rank  (Preble §2.3: linear)

with the two LoRA kernels of docs/design.md §5 (CaraServe §5, Fig. 9):

    padded   (Punica BGMV):   LoRA = a·(batch × max rank) + b
    unpadded (S-LoRA MBGMV):  LoRA = a'·Σ ranks + b'

and no LoRA term when no request of the batch uses an adapter. CaraServe's single-line model is this
one with the base model's batch and context terms folded into b; Preble's PREFILLTIME and DECODETIME
regressions are ``prefill_seconds`` and ``decode_seconds``.

The defaults are PLACEHOLDERS, not measurements: the shape of a Llama-2-7B-class model on one A10-class
GPU read off the papers' figures (Preble Fig. 1–2: prefill linear in uncached tokens, decode linear in
context; CaraServe Fig. 5: BGMV 34.8 ms at 24 × rank 32 and 35.8 ms at 16 × rank 64, so a ≈ 1 ms per
256 rank-slots). They are to be replaced by the coefficients fitted from the real engine
(``worker/elastune_worker/engine``) by profiling on each pod's device; each worker publishes its own
and the simulator takes one ``CostModel`` per endpoint, so fitted values plug in here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

LoraKernel = Literal["padded", "unpadded"]
AdapterTier = Literal["device", "host", "storage"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-endpoint regressions, all in seconds (placeholder defaults; see the module docstring)."""

    iteration_base: float = 0.025
    """Fixed time of one engine iteration (weights read once per step): a decode step's floor."""
    decode_per_seq: float = 1.0e-4
    """Added per request in the decode batch (sampling, per-sequence bookkeeping)."""
    decode_per_kv_token: float = 2.0e-7
    """Added per token of context attended by the decode batch (Preble Fig. 2: linear in context)."""
    prefill_per_token: float = 1.2e-4
    """Per uncached prompt token computed (Preble Fig. 1: prefill is linear in the prompt length)."""
    prefill_lora_per_token_rank: float = 1.0e-7
    """Added per prefill token per LoRA rank (the x·A·B of a prompt chunk)."""
    lora_kernel: LoraKernel = "padded"
    """The engine's multi-LoRA kernel: padded (BGMV, ranks padded to the batch's max) or unpadded."""
    lora_a_padded: float = 3.9e-6
    """a of the padded model: per (batch × max rank) slot (CaraServe Fig. 5: 1 ms / 256 slots)."""
    lora_b_padded: float = 5.0e-4
    """b of the padded model: the kernel's fixed cost once any request in the batch uses LoRA."""
    lora_a_unpadded: float = 2.3e-6
    """a' of the unpadded model: per rank summed over the batch (CaraServe Fig. 5: 0.6 ms / 256)."""
    lora_b_unpadded: float = 2.0e-3
    """b' of the unpadded model: higher than b (MBGMV's overhead on homogeneous ranks, CaraServe §5)."""
    adapter_load_base: float = 2.0e-3
    """Host → device copy of an adapter: fixed part (docs/design.md §5: a few to tens of ms)."""
    adapter_load_per_rank: float = 1.5e-4
    """Host → device per rank (a rank-64 adapter of a 7B model's attention ≈ 100 MiB ≈ 11.6 ms)."""
    storage_load_base: float = 2.0e-2
    """Storage → host (artifact read): fixed part, then the host → device copy follows."""
    storage_load_per_rank: float = 1.5e-3
    """Storage → host per rank (ten times slower than the PCIe copy)."""

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, float) and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.lora_kernel not in ("padded", "unpadded"):
            raise ValueError(f"lora_kernel must be padded or unpadded, got {self.lora_kernel!r}")

    # -- decode --------------------------------------------------------------------------------------
    def lora_seconds(self, ranks: Sequence[int]) -> float:
        """The LoRA term of a decode batch with these ranks (0 = a base-model request)."""
        top = max(ranks, default=0)
        if top <= 0:
            return 0.0
        if self.lora_kernel == "padded":
            return self.lora_a_padded * len(ranks) * top + self.lora_b_padded
        return self.lora_a_unpadded * sum(ranks) + self.lora_b_unpadded

    def decode_iteration(self, ranks: Sequence[int], context_tokens: int = 0) -> float:
        """One decode iteration of a batch whose requests use these ranks (its per-token latency)."""
        if not ranks:
            return 0.0
        return (
            self.iteration_base
            + self.decode_per_seq * len(ranks)
            + self.decode_per_kv_token * context_tokens
            + self.lora_seconds(ranks)
        )

    def decode_seconds(self, tokens: float, rank: int = 0) -> float:
        """DECODETIME (Preble Alg. 2): ``tokens`` decode iterations of a lone request."""
        return max(0.0, tokens) * self.decode_iteration((rank,))

    # -- prefill -------------------------------------------------------------------------------------
    def prefill_seconds(self, tokens: int, rank: int = 0) -> float:
        """PREFILLTIME (Preble Alg. 2): computing ``tokens`` uncached prompt tokens alone (0 → 0)."""
        if tokens <= 0:
            return 0.0
        return self.iteration_base + self.prefill_token_seconds(tokens, tokens * rank)

    def prefill_token_seconds(self, tokens: int, rank_tokens: int = 0) -> float:
        """The prefill part of an iteration: ``tokens`` chunk tokens, Σ chunk × rank = ``rank_tokens``."""
        return self.prefill_per_token * tokens + self.prefill_lora_per_token_rank * rank_tokens

    # -- one engine iteration --------------------------------------------------------------------------
    def iteration_seconds(
        self,
        decode_ranks: Sequence[int],
        context_tokens: int = 0,
        prefill_tokens: int = 0,
        prefill_rank_tokens: int = 0,
    ) -> float:
        """A mixed iteration: the decode batch plus prefill chunks (0 when there is nothing to do)."""
        if not decode_ranks and prefill_tokens <= 0:
            return 0.0
        decode = self.decode_iteration(decode_ranks, context_tokens) if decode_ranks else self.iteration_base
        return decode + self.prefill_token_seconds(prefill_tokens, prefill_rank_tokens)

    # -- adapters ------------------------------------------------------------------------------------
    def adapter_load_seconds(self, rank: int, tier: AdapterTier) -> float:
        """Time until an adapter of this rank is on the device, from the tier it is in now."""
        if tier == "device" or rank <= 0:
            return 0.0
        to_device = self.adapter_load_base + self.adapter_load_per_rank * rank
        if tier == "host":
            return to_device
        return self.storage_load_base + self.storage_load_per_rank * rank + to_device
