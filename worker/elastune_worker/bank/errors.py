"""Errors of the Prompt Bank, with CamelCase reasons ready for a TuningJob status condition."""

from __future__ import annotations

from typing import Final, Literal

from elastune_contract.vocabulary import PROMPT_BANK_ERROR_REASONS
from elastune_contract.vocabulary import Reason as _R

#: The bank holds no candidate (built from nothing, or every prompt removed).
EMPTY_BANK: Final = _R.PROMPT_BANK_EMPTY
#: No features were extracted for this LLM yet (no bank on disk, or one built with another LLM).
NO_FEATURES: Final = _R.PROMPT_BANK_NO_FEATURES
#: Evaluation samples are missing, or none carries a non-empty target: score(p) is undefined.
NO_TARGETS: Final = _R.PROMPT_BANK_NO_TARGETS

Reason = Literal["EmptyBank", "NoFeatures", "NoTargets"]
REASONS: Final[tuple[str, ...]] = PROMPT_BANK_ERROR_REASONS


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
