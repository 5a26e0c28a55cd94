"""The scheduler's settings: what continuous batching reads, and nothing about the device.

The engine's ``EngineConfig`` (worker) also holds the runner's settings (device, dtype, CUDA graphs,
attention backend, LoRA kernels and loading); the simulator has no use for those, so the scheduler
takes this smaller object, which ``EngineConfig.scheduler_config()`` fills from the engine's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

QueuePolicyName = Literal["fcfs", "priority", "sjf", "fair"]
BatchingName = Literal["continuous", "dynamic", "none"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_kv_blocks: int
    """KV-cache size in blocks (resolved: the engine sizes it from its settings or the device)."""
    block_size: int = 16
    """Tokens per KV-cache block: the unit of allocation and of prefix sharing."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes + prefill chunks)."""
    max_num_seqs: int = 128
    """Requests in the running batch at most."""
    long_prefill_token_threshold: int = 0
    """Chunk size cap of one request's prefill per step (0: only the budget caps it)."""
    enable_prefix_caching: bool = True
    queue_policy: QueuePolicyName = "fcfs"
    """fcfs, priority, sjf, or fair (VTC across ``Sequence.tenant``: ``queue_policy.VTCQueue``)."""
    sjf_max_bypass: int = 64
    sjf_max_wait_s: float = 0.0
    batching: BatchingName = "continuous"
    max_loras: int = 4
    """The most distinct LoRA adapters among running requests (the device's adapter slots)."""
    check_invariants: bool = True
    """Assert the step's invariants after each ``schedule``; the simulator, which runs millions of
    steps, checks them only when asked."""
    block_check_interval: int = 1
    """With ``check_invariants``: the block manager's own invariants (every block's reference count
    against the sequences' tables: O(blocks in use), a third of a decode step's host time at 256 x
    512-token contexts) every this many steps, and at every step that leaves nothing running. The
    engine checks every 16th (EngineConfig); the tests of this package every step."""

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_loras",
                     "block_check_interval"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.sjf_max_bypass < 0 or self.sjf_max_wait_s < 0:
            raise ValueError("sjf_max_bypass and sjf_max_wait_s must be >= 0 (0: off)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
