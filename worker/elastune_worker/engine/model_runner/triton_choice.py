"""One rule for the engine's Triton options (attention_backend, elementwise_backend, lora_backend):
whether a Triton path serves or its torch fallback, decided once at start-up.

"triton" asked for must work (a ValueError naming the problem: the operator set it on purpose); "auto"
takes Triton on CUDA when a start-up check finds nothing wrong with it, the fallback otherwise (logged:
a Triton that compiles differently on an unseen GPU falls back instead of serving wrong tokens); the
fallback's own name never runs a check. On the CPU, Triton runs only in its interpreter (tests)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from elastune_worker.engine.model_runner import triton_attention

log = logging.getLogger(__name__)


def choose_triton(
    option: str, choice: str, device: torch.device, problem: Callable[[], str | None], fallback: str
) -> bool:
    """Whether ``option``'s Triton path serves, for its configured ``choice``; ``problem()`` is its
    start-up check (None: it works here), run only when Triton is a candidate."""
    if choice != "triton" and (choice != "auto" or device.type != "cuda"):
        return False
    why = problem()
    if why is None:
        return True
    if choice == "triton":
        raise ValueError(f"{option} triton: {why}")
    log.warning("%s: %s serves, the Triton path is not usable here (%s)", option, fallback, why)
    return False


def triton_unusable(device: torch.device) -> str | None:
    """Why no Triton kernel can run on ``device`` (None: one can); each check starts with this."""
    if not triton_attention.available():
        return "Triton is not installed"
    if device.type == "cpu" and not triton_attention.interpreted():
        return "on the CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1 before Triton's import)"
    return None
