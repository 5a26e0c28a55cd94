"""``EndpointView``s for the routing policies, from what a worker published and the gateway's ledger."""

from __future__ import annotations

from elastune_contract.protocol import ServingCost, adapter_id

from ..routing.cost import CostModel
from ..routing.policy import EndpointView
from .directory import Endpoint
from .ledger import Ledger

DEFAULT_MAX_RUNNING = 128
DEFAULT_KV_CAPACITY_TOKENS = 65_536
DEFAULT_MAX_ADAPTERS = 8


_DEFAULT_COST = CostModel()
_COSTS: dict[int, tuple[ServingCost, CostModel]] = {}
"""id(published fit) → (that fit, its model): a fit changes only when a worker re-publishes it (the
registry refresh then brings a new object), so each request does not rebuild it."""


def cost_model(published: ServingCost | None) -> CostModel:
    """The routing cost model from the worker's profiled fit (step time = base + per_seq × batch,
    prefill linear in tokens); the LoRA and load terms keep their defaults until workers publish them.
    Without a published fit, the placeholder defaults of ``CostModel``."""
    if published is None:
        return _DEFAULT_COST
    held = _COSTS.get(id(published))
    if held is not None and held[0] is published:
        return held[1]
    model = _cost_model(published)
    if len(_COSTS) > 1024:  # fits of workers gone
        _COSTS.clear()
    _COSTS[id(published)] = (published, model)
    return model


def _cost_model(published: ServingCost) -> CostModel:
    lora: dict[str, object] = {}
    if published.lora_kernel == "padded":
        lora = {
            "lora_kernel": "padded",
            "lora_a_padded": published.lora_a_s,
            "lora_b_padded": published.lora_b_s,
        }
    elif published.lora_kernel == "unpadded":
        lora = {
            "lora_kernel": "unpadded",
            "lora_a_unpadded": published.lora_a_s,
            "lora_b_unpadded": published.lora_b_s,
        }
    return CostModel(
        iteration_base=published.decode_step_base_s,
        decode_per_seq=published.decode_step_per_seq_s,
        decode_per_kv_token=0.0,  # not in the worker's fit: its decode cost does not grow with context
        prefill_per_token=published.prefill_s_per_token,
        **lora,  # type: ignore[arg-type]
    )


def endpoint_view(ep: Endpoint, ledger: Ledger) -> EndpointView:
    """Outstanding = the larger of the worker's published queue (other gateways' requests included) and
    the gateway's in-flight count (fresher than the last heartbeat)."""
    s = ep.serving
    max_running = s.max_num_seqs or DEFAULT_MAX_RUNNING
    capacity = s.kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS
    outstanding = max(ledger.count(ep.id), s.running + s.waiting)
    running = min(outstanding, max_running)
    return EndpointView(
        id=ep.id,
        num_running=running,
        num_waiting=outstanding - running,
        kv_usage=s.kv_cache_usage,
        kv_capacity_tokens=capacity,
        max_running=max_running,
        context_tokens=int(s.kv_cache_usage * capacity),
        device_adapters=frozenset(adapter_id(a.namespace, a.name) for a in s.adapters if a.tier == "device"),
        host_adapters=frozenset(adapter_id(a.namespace, a.name) for a in s.adapters if a.tier == "host"),
        max_adapters=s.max_loras or DEFAULT_MAX_ADAPTERS,
        active=ledger.active(ep.id),
        cost=cost_model(s.cost),
    )
