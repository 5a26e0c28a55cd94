"""The engine's step hook: other work that rides the engine's iterations (FlexLLM co-serving: a tuning
job's forward windows and layer-wise backward beside the inference tokens; ``elastune_worker.coserve``
implements it). The engine knows only this protocol, never the co-serving package.

Each step the engine schedules its inference tokens, runs them, then calls ``run`` with their count
(the hook decides its share of the iteration), times it, and once the step's outputs are out calls
``observe`` with the step's inference and hook seconds (an online refit of the hook's latency model).
A hook that raises — in ``pending`` or ``run`` — is detached and told why (``drop``): inference never
fails because of it.
"""

from __future__ import annotations

from typing import Protocol


class StepHook(Protocol):
    def pending(self) -> bool:
        """Work left now: while True the engine steps even without requests (idle iterations run it)."""
        ...

    def run(self, inference_tokens: int) -> int:
        """Run this iteration's share beside ``inference_tokens``; what ran, in forward-token equivalents
        (0: nothing ran)."""
        ...

    def observe(self, inference_s: float, hook_s: float) -> None:
        """The iteration whose share ``run`` just ran took ``inference_s`` + ``hook_s`` seconds."""
        ...

    def drop(self, reason: str) -> None:
        """The engine detached the hook after it raised; ``reason`` says what failed."""
        ...
