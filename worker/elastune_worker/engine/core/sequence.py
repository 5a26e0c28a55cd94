"""One request's state in the engine: its tokens, how many have KV in the cache, its blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from elastune_worker.engine.core.adapter_ref import AdapterRef
from elastune_worker.engine.core.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    priority: int = 0
    extra_key: str | None = None
    """Separates prefix caches of requests that see the same tokens differently (a LoRA adapter)."""
    adapter: AdapterRef | None = None
    """The LoRA adapter or soft prompt it is served with (None: the base model). A soft prompt's virtual
    tokens lead its prompt: the first ``num_virtual_tokens`` ids are placeholders whose embeddings the
    runner replaces."""
    num_virtual_tokens: int = 0
    tenant: str = ""
    """Whose request it is (the gateway's API key, ``namespace/name``; "" when none was given): the
    ``fair`` queue policy shares service across tenants."""
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (prefix hits included)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at the latest admission."""
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Chain hashes of this sequence's full blocks, computed as they fill."""
    num_registered_blocks: int = 0
    """Full blocks already offered to the prefix cache."""
    finish_reason: str | None = None
    num_preemptions: int = 0
    cpu_assisted: bool = False
    """Part of its prefill ran with its adapter's delta computed on the CPU (CaraServe's cold start)."""

    @property
    def lora(self) -> str | None:
        """The key of its LoRA adapter (the tiers' and the device slots' key); None without one."""
        a = self.adapter
        return a.key if a is not None and a.kind == "lora" else None

    @property
    def soft_prompt(self) -> str | None:
        """The key of its soft prompt; None without one."""
        a = self.adapter
        return a.key if a is not None and a.kind == "soft_prompt" else None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
