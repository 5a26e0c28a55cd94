"""Errors of the Prompt Bank, with CamelCase reasons ready for a TuningJob status condition."""

from __future__ import annotations

from typing import Final, Literal

#: The bank holds no candidate (built from nothing, or every prompt removed).
EMPTY_BANK: Final = "EmptyBank"
#: No features were extracted for this LLM yet (no bank on disk, or one built with another LLM).
NO_FEATURES: Final = "NoFeatures"
#: Evaluation samples are missing, or none carries a non-empty target: score(p) is undefined.
NO_TARGETS: Final = "NoTargets"

Reason = Literal["EmptyBank", "NoFeatures", "NoTargets"]
REASONS: Final[tuple[str, ...]] = (EMPTY_BANK, NO_FEATURES, NO_TARGETS)


class BankError(Exception):
    """A Prompt Bank operation that cannot run; the job falls back to its own initial prompt.

    ``reason`` is one of ``REASONS`` (machine-readable), ``message`` says what to do about it.
    """

    def __init__(self, reason: Reason, message: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown BankError reason {reason!r}; known: {', '.join(REASONS)}")
        super().__init__(f"{reason}: {message}")
        self.reason: Reason = reason
        self.message = message
