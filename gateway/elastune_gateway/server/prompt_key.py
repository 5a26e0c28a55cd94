"""What prefix-aware routing matches on when the gateway holds no tokenizer.

The routing policies match token sequences (Preble's radix tree). The gateway does not load the model's
tokenizer (it serves many models and stays light); like vllm-router's and SGLang's cache-aware routers,
which match characters, it matches the prompt's UTF-8 bytes, packed four to a key element so a key is
about as long as the prompt is in BPE tokens (≈ 4 bytes per token of English text) and costs scale
like tokens. Two prompts share a key prefix exactly when they share that many leading bytes (to the
4-byte element), which is what an engine's prefix cache reuses, up to its block granularity. A prompt
sent as token ids is matched on those ids.
"""

from __future__ import annotations

from collections.abc import Sequence

BYTES_PER_ELEMENT = 4


def text_key(text: str) -> tuple[int, ...]:
    data = text.encode("utf-8")
    step = BYTES_PER_ELEMENT
    return tuple(int.from_bytes(data[i : i + step], "little") for i in range(0, len(data), step))


def chat_key(messages: Sequence[tuple[str, str]]) -> tuple[int, ...]:
    """The conversation in order, each turn tagged with its role (a chat template renders it that way,
    so conversations sharing a system prompt or earlier turns share a key prefix)."""
    return text_key("".join(f"\x1e{role}\x1f{content}" for role, content in messages))
