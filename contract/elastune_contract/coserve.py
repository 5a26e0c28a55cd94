"""Whether a TuningJob can be co-served on a serving pod's engine (FlexLLM co-serving, docs/design.md
§5): the control plane asks before it counts a serving pod's spare iteration budget as capacity for the
job."""

from __future__ import annotations

from typing import Final

from elastune_contract.api.tuningjob import TuningJobSpec

#: Methods the engine's co-serving runner tunes piecewise (token windows, layer-wise backward).
COSERVABLE_METHODS: Final[frozenset[str]] = frozenset({"promptTuning", "prefixTuning", "pTuning"})


def coservable(spec: TuningJobSpec, served_model: str) -> str | None:
    """None when ``spec`` can ride along the inference of a pool serving ``served_model``; otherwise the
    reason it cannot (a sentence for a status condition)."""
    if spec.model != served_model:
        return (
            f"the job tunes model {spec.model!r} but the pod serves {served_model!r}: a co-served job "
            "runs on the engine's own base model"
        )
    if spec.method not in COSERVABLE_METHODS:
        return f"method {spec.method!r} cannot be co-served (co-servable: {sorted(COSERVABLE_METHODS)})"
    if spec.termination.target is not None:
        # A co-served job evaluates only at its end: an evaluation between steps would stall inference.
        return "a job with termination.target evaluates between steps, which co-serving does not do"
    return None
