"""Lookup on the two-layer structure (PromptTuner §4.3.2) and its predicted cost (§4.4.3).

Score every medoid (layer 1), take the cluster whose medoid scores lowest, score every other member of
that cluster (layer 2), return the lowest-scoring prompt. The medoid's layer-1 score is reused in layer
2 (same prompt, same samples, same value), so a lookup costs K + |best cluster| − 1 evaluations; with
equal clusters that is ≈ K + C/K, minimal (2√C) at K = √C.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from elastune_contract.protocol import PromptBankReport
from elastune_contract.vocabulary import Reason
from elastune_worker.bank.errors import NO_FEATURES, BankError
from elastune_worker.bank.score import DEFAULT_VIRTUAL_TOKENS, Layout, Scorer
from elastune_worker.bank.store import PromptBank

__all__ = [
    "LookupResult",
    "Selection",
    "brute_force",
    "lookup",
    "predict_lookup_evaluations",
    "predict_lookup_seconds",
    "select_initial_prompt",
]

# Fixed cost of a lookup besides scoring (tokenising samples, Python overhead), seconds; measured ≈ 5 ms
# on the tiny model. The scheduler's budget is ≥ seconds, so a rough constant is enough.
_OVERHEAD_S = 0.05


@dataclass(frozen=True)
class LookupResult:
    """The chosen initial prompt and what it cost (what a TuningJob status records)."""

    prompt: str
    score: float
    evaluations: int
    """Prompts scored (each over all ``n_samples``): K + |cluster| − 1."""
    latency_s: float
    cluster: int
    cluster_size: int
    medoid: str
    medoid_score: float
    k: int
    candidates: int
    n_samples: int
    layout: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_model(bank: PromptBank, model: Any) -> None:
    """A bank's clusters are only meaningful for the LLM whose features built them."""
    from elastune_worker.bank.features import feature_dim

    try:
        dim = feature_dim(model)
    except (AttributeError, TypeError, ValueError):
        return  # not a transformers config: nothing to compare
    if bank.meta.feature_dim and dim != bank.meta.feature_dim:
        raise BankError(
            NO_FEATURES,
            f"the bank's features come from {bank.meta.llm} ({bank.meta.feature_dim} dims), not from this "
            f"model ({dim} dims); build the bank for this LLM first",
        )


def lookup(
    bank: PromptBank,
    model: Any,
    tokenizer: Any,
    eval_records: Sequence[Mapping[str, Any]],
    max_samples: int = 16,
    batch_size: int = 256,
    *,
    layout: Layout = "soft",
    virtual_tokens: int = DEFAULT_VIRTUAL_TOKENS,
    separator: str | None = None,
    max_length: int = 128,
) -> LookupResult:
    """The best initial prompt of ``bank`` for the task of ``eval_records`` ({"input", "target"} dicts).

    ``batch_size`` is the number of (candidate × sample) rows per forward pass. ``layout``/
    ``virtual_tokens``/``separator``/``max_length`` must match the tuning run that will use the prompt
    (see ``score.Scorer``). Raises BankError: EmptyBank, NoFeatures (bank built for another LLM),
    NoTargets (no sample with a target).
    """
    t0 = time.perf_counter()
    bank.require_nonempty()
    _check_model(bank, model)
    scorer = Scorer(
        model,
        tokenizer,
        eval_records,
        max_samples=max_samples,
        layout=layout,
        virtual_tokens=virtual_tokens,
        separator=separator,
        max_length=max_length,
        batch_rows=batch_size,
    )
    medoid_prompts = bank.medoid_prompts()
    first = scorer.score(medoid_prompts)
    c = int(np.argmin(first))  # ties → lowest cluster index
    members = bank.members(c)
    others = [int(i) for i in members if i != bank.medoids[c]]
    second = scorer.score([bank.prompts[i] for i in others]) if others else np.zeros(0)
    # Candidates in index order with their scores; the medoid's comes from layer 1.
    cand = [int(bank.medoids[c]), *others]
    scores = np.concatenate([[first[c]], second])
    j = int(np.argmin(scores))  # ties → the medoid, then the lowest index
    return LookupResult(
        prompt=bank.prompts[cand[j]],
        score=float(scores[j]),
        evaluations=scorer.evaluations,
        latency_s=time.perf_counter() - t0,
        cluster=c,
        cluster_size=len(members),
        medoid=medoid_prompts[c],
        medoid_score=float(first[c]),
        k=bank.k,
        candidates=len(bank),
        n_samples=scorer.n_samples,
        layout=layout,
    )


def brute_force(prompts: Sequence[str], scorer: Scorer) -> tuple[np.ndarray, float]:
    """Every prompt's score and the seconds it took (K = 1: the ideal the bank approximates)."""
    t0 = time.perf_counter()
    scores = scorer.score(list(prompts))
    return scores, time.perf_counter() - t0


def predict_lookup_evaluations(bank: PromptBank, bound: Literal["expected", "worst"] = "expected") -> int:
    """Evaluations of a lookup before running it: K + (mean or largest cluster size) − 1."""
    if not len(bank):
        return 0
    sizes = bank.cluster_sizes()
    second = float(sizes.mean()) if bound == "expected" else float(sizes.max())
    return round(bank.k + second - 1)


def predict_lookup_seconds(
    bank: PromptBank, n_samples: int = 16, bound: Literal["expected", "worst"] = "expected"
) -> float:
    """Predicted lookup latency, for the scheduler's budget (run the bank only if ≤ 20 % of the SLO).

    ``n_samples``: the samples the lookup will score on, i.e. min(labelled eval samples, max_samples).

    evaluations × samples × the seconds per scored row measured when the bank was built (on the
    build machine's device; a GPU pod is faster, so the prediction errs on the safe side there).
    """
    rows = predict_lookup_evaluations(bank, bound) * max(1, n_samples)
    return _OVERHEAD_S + rows * bank.meta.seconds_per_row


# ------------------------------------------------------------------------------ job-facing wrapper
Mode = Literal["auto", "always", "never"]


@dataclass(frozen=True)
class Selection:
    """The initial prompt a TuningJob starts from, and why (what its status records)."""

    prompt: str | None
    """The bank's pick, or the job's own initial prompt (None: the job has none, PEFT's random init)."""
    source: Literal["bank", "job"]
    reason: str
    """A vocabulary reason: PromptBankUsed | PromptBankDisabled (promptBank: never) |
    LatencyBudgetExceeded | a BankError reason (EmptyBank, NoFeatures, NoTargets)."""
    message: str
    predicted_s: float | None = None
    result: LookupResult | None = None

    def to_report(self) -> PromptBankReport:
        """The typed report rank 0 posts on the job's event stream (the TuningJob's status.promptBank)."""
        r = self.result
        return PromptBankReport(
            source=self.source,
            reason=self.reason,
            message=self.message,
            prompt=self.prompt,
            predicted_seconds=round(self.predicted_s, 3) if self.predicted_s is not None else None,
            score=r.score if r else None,
            evaluations=r.evaluations if r else None,
            latency_seconds=round(r.latency_s, 3) if r else None,
            cluster=r.cluster if r else None,
            candidates=r.candidates if r else None,
        )


def select_initial_prompt(
    bank: PromptBank | str | Any,
    model: Any,
    tokenizer: Any,
    eval_records: Sequence[Mapping[str, Any]],
    fallback: str | None,
    *,
    mode: Mode = "auto",
    budget_s: float | None = None,
    max_samples: int = 16,
    **lookup_kwargs: Any,
) -> Selection:
    """``promptBank: auto | always | never`` in one call; never raises a BankError.

    ``bank`` is a PromptBank or the directory of one. Under ``auto`` the lookup runs only if its
    predicted latency fits ``budget_s`` (the scheduler passes 20 % of the job's SLO, §4.4.3; None =
    no budget). Any BankError (EmptyBank, NoFeatures, NoTargets) falls back to ``fallback`` and says why.
    """
    from pathlib import Path

    if mode == "never":
        why = "promptBank is never: the job's own initial prompt"
        return Selection(fallback, "job", Reason.PROMPT_BANK_DISABLED, why)
    try:
        pb = bank if isinstance(bank, PromptBank) else PromptBank.load(Path(bank))
        pb.require_nonempty()
        n = sum(1 for r in eval_records if isinstance(r, Mapping) and str(r.get("target") or "").strip())
        predicted = predict_lookup_seconds(pb, min(max(n, 1), max_samples))
        if mode == "auto" and budget_s is not None and predicted > budget_s:
            return Selection(
                fallback,
                "job",
                Reason.LATENCY_BUDGET_EXCEEDED,
                f"predicted lookup {predicted:.1f} s exceeds the budget {budget_s:.1f} s (20 % of the SLO)",
                predicted,
            )
        res = lookup(pb, model, tokenizer, eval_records, max_samples, **lookup_kwargs)
    except BankError as exc:
        return Selection(fallback, "job", exc.reason, f"{exc.message}; using the job's own initial prompt")
    msg = (
        f"picked from {res.candidates} candidates with {res.evaluations} evaluations in {res.latency_s:.2f} s"
    )
    return Selection(res.prompt, "bank", Reason.PROMPT_BANK_USED, msg, predicted, res)
