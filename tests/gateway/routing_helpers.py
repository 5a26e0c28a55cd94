"""Shared builders for the routing and routing-simulator tests.

The default cost model makes the arithmetic trivial: prefill 1 ms per uncached token (no fixed part
beyond a 10 ms iteration), decode 10 ms per iteration with no per-request or context cost, and the
LoRA kernels of CaraServe's Fig. 5 example when asked (``caraserve_cost``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from elastune_gateway.routing.cost import CostModel
from elastune_gateway.routing.policy import ActiveRequest, EndpointView, RequestView

SIMPLE = CostModel(
    iteration_base=0.010,
    decode_per_seq=0.0,
    decode_per_kv_token=0.0,
    prefill_per_token=0.001,
    prefill_lora_per_token_rank=0.0,
    lora_a_padded=0.0,
    lora_b_padded=0.0,
    lora_a_unpadded=0.0,
    lora_b_unpadded=0.0,
)
"""PREFILLTIME(n) = 10 ms + n ms (0 for n = 0); DECODETIME(n) = 10 ms × n."""


def caraserve_cost(kernel: str = "padded") -> CostModel:
    """CaraServe §2.3 / Fig. 5, read as our model with the base folded into b: padded (BGMV)
    t = a·(B × max rank) + b with 24 × r32 → 34.8 ms and 16 × r64 → 35.8 ms, so a = 1 ms / 256 and
    b = 31.8 ms; unpadded (MBGMV) t = a'·Σ ranks + b' with 768 → 35.3 ms and 1024 → 35.9 ms, so
    a' = 0.6 ms / 256 and b' = 33.5 ms."""
    return CostModel(
        iteration_base=0.0,
        decode_per_seq=0.0,
        decode_per_kv_token=0.0,
        lora_kernel=kernel,  # type: ignore[arg-type]
        lora_a_padded=0.001 / 256,
        lora_b_padded=0.0318,
        lora_a_unpadded=0.0006 / 256,
        lora_b_unpadded=0.0335,
    )


def make_endpoints(n: int = 4, **overrides: Any) -> list[EndpointView]:
    """``n`` endpoints e0 … e{n-1}; ``overrides`` apply to all, or per endpoint when given as a dict
    {endpoint index: value}."""
    endpoints = []
    for i in range(n):
        fields: dict[str, Any] = {"cost": SIMPLE, "kv_capacity_tokens": 10_000}
        for key, value in overrides.items():
            if isinstance(value, dict):
                if i in value:
                    fields[key] = value[i]
            else:
                fields[key] = value
        endpoints.append(EndpointView(f"e{i}", **fields))
    return endpoints


def batch(*ranks: int, slo: float | None = None, adapter: str | None = "x", prefill_left: int = 0) -> tuple:
    """Active requests of these ranks (all decoding unless ``prefill_left``)."""
    return tuple(ActiveRequest(r, adapter if r else None, slo, prefill_left) for r in ranks)


def tokens(*runs: tuple[int, int]) -> tuple[int, ...]:
    """A token sequence from (token, count) runs, e.g. tokens((1, 100), (2, 5))."""
    return tuple(t for t, n in runs for _ in range(n))


def make_requests(*specs: Iterable[int] | tuple[str, Iterable[int]], **fields: Any) -> list[RequestView]:
    """Requests r0, r1, … from token sequences (or (id, tokens) pairs), each with ``fields``."""
    out = []
    for i, spec in enumerate(specs):
        if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
            rid, toks = spec
        else:
            rid, toks = f"r{i}", spec
        out.append(RequestView(rid, tuple(toks), **fields))  # type: ignore[arg-type]
    return out


def make_request(rid: str = "r", toks: Iterable[int] = (), **fields: Any) -> RequestView:
    return RequestView(rid, tuple(toks), **fields)
