"""The engine behind the OpenAI API: ``AsyncEngine`` or ``ProcessEngine`` (a ``RequestStreams``) as the
engine's one ``EngineClient`` (engine/client.py; the API hands the engine its own ``SamplingParams`` and
reads its ``RequestOutput``s), plus what the worker's server needs beside the API (its heartbeat's
serving state, closing the engine)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Sequence

from elastune_contract.protocol import AdapterState, ServingState
from elastune_worker.engine.client import EngineClient, LoRAInfo
from elastune_worker.engine.core.adapter_ref import DEFAULT_NAMESPACE, AdapterInfo, AdapterRef
from elastune_worker.engine.core.outputs import RequestOutput
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.frontend.messages import EngineOp
from elastune_worker.engine.frontend.streams import RequestStreams

#: Used when a model ships no chat template (GPT-2): role-tagged turns, then the assistant's tag.
FALLBACK_CHAT_TEMPLATE = "{role}: {content}\n"


class EngineServingClient(EngineClient):
    def __init__(self, engine: RequestStreams, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.tokenizer = engine.tokenizer
        self.adapter_error: str | None = None
        self.last_request_at: float | None = None
        self._busy_mark: tuple[float, float] | None = None  # (monotonic time, inference step seconds)

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """ValueError (the client's 400) when the model's chat template refuses the messages: templates
        raise jinja2's TemplateError, not a ValueError (Mistral's on a system turn or on roles that do
        not alternate), which reached the client as a 500."""
        turns = [{"role": role, "content": content} for role, content in messages]
        if getattr(self.tokenizer, "chat_template", None):
            from jinja2 import TemplateError

            try:
                ids = self.tokenizer.apply_chat_template(
                    turns, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            except TemplateError as exc:
                raise ValueError(f"the model's chat template refused these messages: {exc}") from exc
            return list(ids)
        text = "".join(FALLBACK_CHAT_TEMPLATE.format(**t) for t in turns) + "assistant:"
        return self.encode(text)

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
        self.last_request_at = time.time()
        return self.engine.generate(
            request_id, prompt_token_ids, params, priority=priority, adapter=adapter, tenant=tenant
        )

    def serving_state(self) -> ServingState:
        """What the worker publishes with its heartbeat for the gateway."""
        s = self.engine.stats()
        now, inference = time.monotonic(), s.step_seconds - s.coserve_seconds
        mark, self._busy_mark = self._busy_mark, (now, inference)
        utilization = 0.0
        if mark is not None and now > mark[0]:
            utilization = min(1.0, max(0.0, (inference - mark[1]) / (now - mark[0])))
        return ServingState(
            utilization=round(utilization, 4),
            model=self.model_name,
            max_model_len=self.max_model_len,
            running=s.num_requests_running,
            waiting=s.num_requests_waiting,
            kv_cache_usage=s.kv_cache_usage_perc,
            prefix_cache_hit_tokens=s.prefix_cache_hits_tokens,
            prefix_cache_queried_tokens=s.prefix_cache_queries_tokens,
            cost=self.engine.cost,
            max_num_seqs=self.engine.config.max_num_seqs,
            kv_capacity_tokens=self.engine.config.kv_blocks() * self.engine.config.block_size,
            max_loras=s.max_loras,
            adapters=[
                AdapterState(
                    name=a.name,
                    namespace=a.ref.namespace,
                    rank=a.rank,
                    tier=a.tier,
                    running=s.lora_running.get(a.ref.key, 0),
                )
                for a in s.loras
            ],
            adapter_error=self.adapter_error,
            last_request_at=self.last_request_at,
        )

    # -- adapters (vLLM's runtime LoRA API) ------------------------------------------------------
    def adapters(self) -> list[AdapterInfo]:
        return list(self.engine.stats().loras)

    async def load_lora(self, name: str, path: str, namespace: str = DEFAULT_NAMESPACE) -> AdapterInfo:
        """Registers an adapter or soft prompt, served as ``name`` in ``namespace`` (the LoRAAdapter's,
        from the placement; none for one loaded by hand); a failure is kept (published with the worker's
        record) until the next load succeeds."""
        try:
            info: AdapterInfo = await self.engine.call(EngineOp.LOAD_LORA, (name, path, namespace))
        except Exception as exc:
            self.adapter_error = f"{name} ({path}): {exc}"
            raise
        self.adapter_error = None
        return info

    async def unload_lora(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        await self.engine.call(EngineOp.UNLOAD_LORA, (name, namespace))

    def close(self) -> None:
        """Stop the engine (its thread or process) once nothing is in flight: the pod's last step."""
        self.engine.close()

    def stats(self) -> dict[str, float]:
        s = dataclasses.asdict(self.engine.stats())
        counters = s.pop("lora_counters", {})
        for key in ("extra", "loras", "lora_running", "lora_waiting"):
            s.pop(key, None)
        out = {k: float(v) for k, v in s.items()}
        out.update({f"lora_{k}": float(v) for k, v in counters.items()})
        return out

    def lora_info(self) -> LoRAInfo:
        """Adapters by tier and those of running and waiting requests (vllm:lora_requests_info)."""
        s = self.engine.stats()
        tiers = {"device": 0, "host": 0}
        for a in s.loras:
            if a.tier in tiers and a.ref.is_lora:  # soft prompts hold no LoRA slot
                tiers[a.tier] += 1
        return LoRAInfo(sorted(s.lora_running), sorted(s.lora_waiting), s.max_loras, tiers)
