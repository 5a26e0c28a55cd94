"""Prompt Bank (PromptTuner §4.3, §5.2): pick an effective initial prompt among thousands in seconds.

API (what the scheduler / TuningJob wiring calls)::

    bank_dir(llm_key: str) -> Path
        $ELASTUNE_CACHE (default ~/.cache/elastune) /bank/<safe llm key>
    build_bank(model_dir, out_dir=None, candidates=None, k=50, seed=0, *, capacity=3000, llm_key=None,
               extractor=None, batch_size=64, calibrate=True) -> PromptBank
        features of every candidate under the LLM, cosine distance, FasterPAM k-medoids, saved
        (features.safetensors + bank.json); the project's demo set of 3,000 is
        elastune_demo.bank_candidates.default_candidates()
    ensure_bank(model_dir, llm_key=None, *, k=50, candidates=None, out_dir=None) -> PromptBank
        load, or (re)build when missing or when the LLM under that key changed (new features)
    load_bank(llm_key) -> PromptBank            # BankError(NoFeatures) if never built
    PromptBank.load(dir) / .save(dir=None) / len(bank) / .k / .capacity / .describe()
    PromptBank.insert(prompt, feature=None) -> InsertResult      # no scoring; replacement past capacity
    PromptBank.insert_many(prompts) -> list[InsertResult]
    lookup(bank, model, tokenizer, eval_records, max_samples=16, batch_size=256, *, layout="soft",
           virtual_tokens=20, separator=None, max_length=128) -> LookupResult
        LookupResult(prompt, score, evaluations, latency_s, cluster, cluster_size, medoid,
                     medoid_score, k, candidates, n_samples, layout).to_dict()
    predict_lookup_seconds(bank, n_samples=16, bound="expected"|"worst") -> float
        (K + mean|largest cluster − 1) × n_samples × seconds per scored row measured at build
    BankError(reason, message), reason ∈ {"EmptyBank", "NoFeatures", "NoTargets"}
    select_initial_prompt(bank | dir, model, tokenizer, eval_records, fallback, *, mode="auto"|"always"|
                          "never", budget_s=None, max_samples=16, **lookup_kwargs) -> Selection
        never raises BankError: falls back to ``fallback`` (the job's own prompt) and says why;
        Selection(prompt, source "bank"|"job", reason, message, predicted_s, result).to_report()
            -> PromptBankReport for the job status; reason PromptBankUsed | PromptBankDisabled |
            LatencyBudgetExceeded | a BankError reason

Scoring matches the tuning loop token for token (``score.Scorer``): for promptTuning pass the job's
``virtual_tokens`` (layout "soft": score(p) is the tuning run's loss before its first step); for other
methods use ``layout="text"`` (``prompt\\ninput →``, the tiny corpus layout).

CLI: ``python -m elastune_worker.bank build|lookup|insert|info --model DIR`` (``main(argv)``; ``elastune
bank`` fills in the tiny demo defaults first: ``elastune_demo/bank_cli.py``); benchmark:
``elastune bench bank`` (``elastune_bench.tuning.bank``).

Importing this package needs numpy only; torch and transformers load when a model is used.
"""

from __future__ import annotations

from elastune_worker.bank.errors import EMPTY_BANK, NO_FEATURES, NO_TARGETS, REASONS, BankError
from elastune_worker.bank.features import FeatureExtractor

# Eager on purpose: the function ``lookup`` must shadow the submodule of the same name.
from elastune_worker.bank.lookup import (
    LookupResult,
    Selection,
    lookup,
    predict_lookup_evaluations,
    predict_lookup_seconds,
    select_initial_prompt,
)
from elastune_worker.bank.score import Scorer
from elastune_worker.bank.store import (
    DEFAULT_CAPACITY,
    DEFAULT_K,
    InsertResult,
    PromptBank,
    bank_dir,
    build_bank,
    ensure_bank,
    load_bank,
)

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_K",
    "EMPTY_BANK",
    "NO_FEATURES",
    "NO_TARGETS",
    "REASONS",
    "BankError",
    "FeatureExtractor",
    "InsertResult",
    "LookupResult",
    "PromptBank",
    "Scorer",
    "Selection",
    "bank_dir",
    "build_bank",
    "ensure_bank",
    "load_bank",
    "lookup",
    "predict_lookup_evaluations",
    "predict_lookup_seconds",
    "select_initial_prompt",
]
