"""Termination metrics of a TuningJob (``Target.metric``), pure Python, each in [0, 1] except loss.

Text is compared as whitespace tokens, case-sensitive: several tuning tasks *are* case or format
transformations, so folding case would call wrong answers right. Both-empty counts as a perfect match and
one-sided emptiness as a total miss, so every score is defined for every pair.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final

__all__ = [
    "HIGHER_IS_BETTER",
    "METRICS",
    "bleu4",
    "corpus_score",
    "exact_match",
    "is_better",
    "lcs_length",
    "normalize",
    "reached",
    "rouge_l_f1",
]

#: Direction of every metric name the TuningJob API knows (operator api/tuningjob.py TargetMetric).
HIGHER_IS_BETTER: Final[dict[str, bool]] = {
    "loss": False,
    "exactMatch": True,
    "accuracy": True,
    "bleu": True,
    "rougeL": True,
}
METRICS: Final[tuple[str, ...]] = tuple(HIGHER_IS_BETTER)


def normalize(text: str) -> str:
    """Collapse runs of whitespace and strip: formatting noise is not an error."""
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    return 1.0 if normalize(prediction) == normalize(reference) else 0.0


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence, O(len(a)·len(b)) time, O(len(b)) memory."""
    if len(b) > len(a):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, start=1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l_f1(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (β = 1) over whitespace tokens: 2PR / (P + R) with P = LCS/|pred|, R = LCS/|ref|."""
    pred, ref = prediction.split(), reference.split()
    if not pred or not ref:
        return 1.0 if not pred and not ref else 0.0
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(pred), lcs / len(ref)
    return 2 * p * r / (p + r)


def _ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def bleu4(prediction: str, reference: str) -> float:
    """Sentence BLEU-4 with uniform weights, brevity penalty and add-one smoothing (Lin & Och 2004).

    Add-one applies to the 2-, 3- and 4-gram precisions only, (matches + 1) / (candidate n-grams + 1),
    as in NLTK's ``SmoothingFunction().method2``: smoothing the unigram precision too would give a
    one-token answer sharing nothing with the reference a BLEU of 0.84. Consequences: a wrong single-token
    answer scores 0, a right one scores 1 (its empty higher-order precisions are 1/1).
    """
    pred, ref = prediction.split(), reference.split()
    if not pred or not ref:
        return 1.0 if not pred and not ref else 0.0
    log_sum = 0.0
    for n in range(1, 5):
        cand = _ngrams(pred, n)
        refc = _ngrams(ref, n)
        matches = sum(min(c, refc[g]) for g, c in cand.items())  # clipped counts
        total = max(0, len(pred) - n + 1)
        if n == 1:
            if matches == 0:
                return 0.0
            log_sum += math.log(matches / total)
        else:
            log_sum += math.log((matches + 1) / (total + 1))
    c, r = len(pred), len(ref)
    brevity = 1.0 if c > r else math.exp(1 - r / c)
    return min(1.0, brevity * math.exp(log_sum / 4))


_GENERATION_METRICS: Final[dict[str, Callable[[str, str], float]]] = {
    "exactMatch": exact_match,
    # The TuningJob API's "accuracy" is answer accuracy of generated text: the same as exact match.
    "accuracy": exact_match,
    "bleu": bleu4,
    "rougeL": rouge_l_f1,
}


def corpus_score(metric: str, predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean per-example score of a generation metric (macro average: every example weighs the same)."""
    try:
        fn = _GENERATION_METRICS[metric]
    except KeyError:
        raise ValueError(
            f"{metric!r} is not a generation metric; known: {', '.join(_GENERATION_METRICS)}"
        ) from None
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        raise ValueError("no examples to score")
    return sum(fn(p, r) for p, r in zip(predictions, references, strict=True)) / len(references)


def _direction(metric: str) -> bool:
    try:
        return HIGHER_IS_BETTER[metric]
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}") from None


def is_better(metric: str, a: float, b: float) -> bool:
    """Whether value ``a`` is strictly better than ``b`` for ``metric`` (loss: lower is better)."""
    return a < b if not _direction(metric) else a > b


def reached(metric: str, value: float, target: float) -> bool:
    """Whether ``value`` meets the target: loss <= target, any other metric >= target."""
    return value <= target if not _direction(metric) else value >= target
