"""The Prompt Bank latency budget (PromptTuner §4.4.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastune_contract.vocabulary import Reason

BankMode = Literal["auto", "always", "never"]

DEFAULT_BUDGET_FRACTION = 0.2
"""Run the bank only if its lookup fits in 20 % of the SLO: the bank's minimum observed speedup
(1.2×) then still outweighs its overhead (paper §4.4.3)."""


@dataclass(frozen=True, slots=True)
class BankChoice:
    use: bool
    reason: str


def decide_prompt_bank(
    mode: BankMode,
    predicted_lookup_seconds: float,
    slo_seconds: float,
    budget_fraction: float = DEFAULT_BUDGET_FRACTION,
) -> BankChoice:
    """Whether a job runs the Prompt Bank before tuning, and why (recorded in the job's status)."""
    return bank_verdict(mode, predicted_lookup_seconds, budget_fraction * slo_seconds)


def bank_verdict(mode: BankMode, predicted_lookup_seconds: float, budget_seconds: float) -> BankChoice:
    """``decide_prompt_bank`` for a budget the caller computed already (a policy computes a job's
    budget once, at admission, and keeps it on the job)."""
    if mode == "never":
        return BankChoice(False, Reason.PROMPT_BANK_DISABLED)
    if mode == "always":
        return BankChoice(True, Reason.PROMPT_BANK_REQUESTED)
    if predicted_lookup_seconds <= budget_seconds:
        return BankChoice(True, Reason.WITHIN_LATENCY_BUDGET)
    return BankChoice(False, Reason.LATENCY_BUDGET_EXCEEDED)
