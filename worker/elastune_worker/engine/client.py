"""What the HTTP layer needs of an engine: the seam between the OpenAI API and the serving engine.

The API validates and shapes requests and responses; an ``EngineClient`` tokenizes, generates and
aborts. Keeping the seam this small lets the same routes front the engine in a worker process and
lets tests name exactly what they exercise.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from elastune_worker.engine.core.adapter_ref import DEFAULT_NAMESPACE, AdapterRef
from elastune_worker.engine.core.outputs import RequestOutput
from elastune_worker.engine.core.sampling import SamplingParams


class AdapterView(Protocol):
    """A loaded LoRA adapter or soft prompt: the reference requests are served with, its name,
    artifact, rank and tier (device | host | storage)."""

    @property
    def ref(self) -> AdapterRef: ...

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def tier(self) -> str: ...


@dataclass(frozen=True)
class LoRAInfo:
    """The engine's adapters for the metrics endpoint: requests running and waiting per adapter."""

    running: list[str]
    waiting: list[str]
    max_loras: int
    resident: dict[str, int]
    """LoRA adapters per tier (device, host)."""


class EngineBusy(Exception):
    """The engine cannot take the request now (not loaded yet, or shutting down): HTTP 503."""


class EngineClient(Protocol):
    model_name: str
    """The id clients send as ``model`` (also listed by /v1/models)."""
    max_model_len: int
    """Context length in tokens: prompt + generated tokens never exceed it."""

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the BOS token when the model expects one)."""
        ...

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Token ids of a chat: (role, content) pairs rendered with the model's chat template. ValueError
        (the client's 400) when the template refuses the messages."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        adapter: AdapterRef | None = None,
        *,
        tenant: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs until one is finished (served with ``adapter`` when given: a LoRA or a
        soft prompt; for ``tenant``, whom the ``fair`` queue policy shares service across). Closing the
        iterator early aborts the request and frees its KV blocks (a client that disconnects)."""
        ...

    def adapters(self) -> Sequence[AdapterView]:
        """The adapters (LoRAs and soft prompts) loaded now, each served under its own name."""
        ...

    async def load_lora(self, name: str, path: str) -> AdapterView:
        """Registers an adapter (ValueError: it cannot serve here, the client's 400)."""
        ...

    async def unload_lora(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """KeyError when it is not loaded; ValueError while requests use it."""
        ...

    def stats(self) -> dict[str, float]:
        """Gauges the metrics endpoint exports: num_requests_running, num_requests_waiting,
        kv_cache_usage_perc, prefix_cache_queries_tokens, prefix_cache_hits_tokens, preemptions."""
        ...
