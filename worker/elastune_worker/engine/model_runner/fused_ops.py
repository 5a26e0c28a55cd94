"""The element-wise parts of a Llama layer: residual add + RMSNorm, rotary embedding, SiLU-and-mul.

Two implementations of one interface. ``TorchOps`` is the plain torch code (several kernels each: an
RMSNorm is eight in bfloat16, RoPE five per tensor). ``TritonOps`` is one Triton kernel each
(fused_kernels.py). Each small kernel costs a few microseconds of GPU time even when a CUDA graph
launches it, so on the first H200 run a layer's 37 kernels (~1,200 per 32-layer 8B step; counted in
test_fused_ops.py) were the likeliest part of the gap between the batch-1 decode step (6.95 ms) and its
bandwidth bound (3.58 ms). TritonOps brings a layer to 9 kernels: its RoPE kernel also writes the
step's keys and values into the KV cache (two index_copy_ kernels a layer in the torch ops).

The ``elementwise_backend`` setting picks one (model_runner.py): ``auto`` takes Triton on CUDA when
it imports and agrees with the torch ops on a start-up check, torch otherwise (on the CPU, Triton runs
only in its interpreter: tests). No module here imports Triton (see triton_attention.py for why)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from elastune_worker.engine.model_runner.triton_attention import next_pow2
from elastune_worker.engine.model_runner.triton_choice import choose_triton, triton_unusable

ElementwiseBackend = Literal["torch", "triton"]

KVWrite = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(K cache, V cache, slot of each token): caches [KV heads, slots, head_dim] (head-major), slots [T]."""


@dataclass(frozen=True)
class LayerShape:
    """What the kernels are compiled for: a Llama layer's widths."""

    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    intermediate: int


CHECK_SHAPE = LayerShape(hidden=96, n_heads=6, n_kv=2, head_dim=16, intermediate=40)
"""Widths that are not powers of two, for checks that need no model."""


class ElementwiseOps(Protocol):
    name: ElementwiseBackend

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``weight * rmsnorm(x + residual)``, ``x + residual``); without a residual, the norm of x
        and x itself. x and residual are [T, hidden] with unit stride along hidden."""
        ...

    def rope(
        self,
        qkv: torch.Tensor,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_write: KVWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, n_heads, head_dim], k and v [T, n_kv, head_dim] of the fused projection ``qkv`` (query
        heads, then key heads, then value heads on each row), q and k rotated by RoPE (rotate-half) with
        this step's ``cos``/``sin`` rows [T, head_dim]; with ``kv_write``, k and v also written into the
        KV cache at the tokens' slots. TritonOps rotates in place inside ``qkv``."""
        ...

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` = [gate | up] ([T, 2 x intermediate])."""
        ...


class TorchOps:
    name: ElementwiseBackend = "torch"

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype), x

    def rope(
        self,
        qkv: torch.Tensor,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_write: KVWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = _split_heads(qkv, n_heads, n_kv, head_dim)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        if kv_write is not None:
            k_cache, v_cache, slots = kv_write
            k_cache.index_copy_(1, slots, k.transpose(0, 1))
            v_cache.index_copy_(1, slots, v.transpose(0, 1))
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        gate, up = gate_up.split(intermediate, dim=-1)
        return F.silu(gate) * up


def _split_heads(
    qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, q_size, kv_size = qkv.shape[0], n_heads * head_dim, n_kv * head_dim
    return (
        qkv[:, :q_size].view(t, n_heads, head_dim),
        qkv[:, q_size : q_size + kv_size].view(t, n_kv, head_dim),
        qkv[:, q_size + kv_size :].view(t, n_kv, head_dim),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


SILU_BLOCK = 1024
"""Columns per program of silu_mul (a 14,336-wide Llama-3-8B MLP row: 14 programs per token)."""


class TritonOps:
    name: ElementwiseBackend = "triton"

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from elastune_worker.engine.model_runner.fused_kernels import add_rms_norm_kernel

        _unit_stride(x, residual, weight)
        t, n = x.shape
        out = torch.empty_like(x)
        summed = torch.empty_like(x) if residual is not None else x
        if t:
            add_rms_norm_kernel[(t,)](
                x, x if residual is None else residual, out, summed, weight,
                x.stride(0), (x if residual is None else residual).stride(0), out.stride(0),
                summed.stride(0), n, eps, HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(n),
            )  # fmt: skip
        return out, summed

    def rope(
        self,
        qkv: torch.Tensor,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_write: KVWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from elastune_worker.engine.model_runner.fused_kernels import rope_kernel

        _unit_stride(qkv, cos, sin)
        if head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head size, not {head_dim}")
        t = qkv.shape[0]
        if kv_write is None:
            # the slot and cache arguments are not read without WRITE_KV: any tensor stands in
            k_cache, v_cache, slots, heads = qkv, qkv, qkv, n_heads + n_kv
        else:
            k_cache, v_cache, slots = kv_write
            _unit_stride(k_cache, v_cache)
            heads = n_heads + 2 * n_kv
        if t:
            half = head_dim // 2
            rope_kernel[(t, heads)](
                qkv, cos, sin, k_cache, v_cache, slots,
                qkv.stride(0), cos.stride(0), sin.stride(0),
                k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                N_HEADS=n_heads, N_KV=n_kv, HALF=half, HALF_P2=next_pow2(half),
                WRITE_KV=kv_write is not None,
            )  # fmt: skip
        return _split_heads(qkv, n_heads, n_kv, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        from elastune_worker.engine.model_runner.fused_kernels import silu_mul_kernel

        _unit_stride(gate_up)
        t = gate_up.shape[0]
        out = torch.empty(t, intermediate, dtype=gate_up.dtype, device=gate_up.device)
        if t:
            block = min(SILU_BLOCK, next_pow2(intermediate))
            grid = (t, -(-intermediate // block))
            silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), intermediate, BLOCK=block)
        return out


def _unit_stride(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.stride(-1) != 1:
            raise ValueError("the fused element-wise kernels need a unit stride along the last dimension")


TORCH_OPS = TorchOps()
TRITON_OPS = TritonOps()


def pick_elementwise_backend(
    choice: str, device: torch.device, dtype: torch.dtype, shape: LayerShape = CHECK_SHAPE
) -> ElementwiseOps:
    """torch, or triton: asked for (it must work: else a clear error), or auto (on CUDA when Triton
    imports and its kernels agree with the torch ops on a start-up check at the model's ``shape``,
    which also compiles them for it; torch otherwise)."""
    use_triton = choose_triton(
        "elementwise_backend", choice, device, partial(triton_problem, device, dtype, shape), "torch"
    )
    return TRITON_OPS if use_triton else TORCH_OPS


def triton_problem(device: torch.device, dtype: torch.dtype, shape: LayerShape = CHECK_SHAPE) -> str | None:
    """Why the fused kernels cannot serve here (None: they can): checked against the torch ops, so a
    Triton that compiles them differently on an unseen GPU, or cannot compile them at the model's
    widths, falls back instead of serving wrong tokens or failing at the first request."""
    if (unusable := triton_unusable(device)) is not None:
        return unusable
    try:
        pairs = check_outputs(device, dtype, shape=shape)
    except Exception as exc:  # any failure of an unseen Triton or GPU: use the torch ops
        return f"{type(exc).__name__}: {exc}"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, (got, expected) in pairs.items():
        if not torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol):
            err = (got.float() - expected.float()).abs().max().item()
            return f"its {name} differs from the torch ops (max abs error {err:.3g})"
    return None


def check_outputs(
    device: torch.device, dtype: torch.dtype, rows: int = 5, shape: LayerShape = CHECK_SHAPE
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(Triton's, torch's) output of every op on one random input of ``shape``: the start-up check, and
    the tests."""
    gen = torch.Generator().manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen).to(device, dtype)

    h, n_heads, n_kv, d, inter = shape.hidden, shape.n_heads, shape.n_kv, shape.head_dim, shape.intermediate
    x, res, w = rand(rows, h), rand(rows, h), rand(h)
    qkv = rand(rows, (n_heads + 2 * n_kv) * d)
    cos, sin = rand(rows, d), rand(rows, d)
    gate_up = rand(rows, 2 * inter)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, fused, plain in (
        ("add_rms_norm", TRITON_OPS.add_rms_norm(x, res, w, 1e-5), TORCH_OPS.add_rms_norm(x, res, w, 1e-5)),
        ("rms_norm", TRITON_OPS.add_rms_norm(x, None, w, 1e-5), TORCH_OPS.add_rms_norm(x, None, w, 1e-5)),
    ):
        out[name] = (torch.cat(fused, 1), torch.cat(plain, 1))
    # with the cache write: the rows' slots out of order, among slots no row writes
    slots = torch.randperm(rows + 3, generator=gen)[:rows].to(device)
    got: dict[str, list[torch.Tensor]] = {}
    for name, ops, x in (("fused", TRITON_OPS, qkv.clone()), ("plain", TORCH_OPS, qkv)):
        k_cache = torch.zeros(n_kv, rows + 3, d, device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        rotated = ops.rope(x, n_heads, n_kv, d, cos, sin, (k_cache, v_cache, slots))
        got[name] = [torch.cat([t.flatten(1) for t in rotated], 1), torch.cat([k_cache, v_cache]).flatten(1)]
    out["rope"] = (got["fused"][0], got["plain"][0])
    out["kv_write"] = (got["fused"][1], got["plain"][1])
    out["silu_mul"] = (TRITON_OPS.silu_mul(gate_up, inter), TORCH_OPS.silu_mul(gate_up, inter))
    return out
