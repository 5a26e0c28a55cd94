"""Prompt tuning of a TuningJob on one worker: datasets, metrics, the data-parallel PEFT trainer.

``data`` and ``metrics`` are pure Python; the trainer names are loaded lazily so importing this package
(e.g. for dataset validation) does not pull in torch.
"""

from __future__ import annotations

from typing import Any

from elastune_worker.tuning.data import DatasetError, Record, load_dataset, split
from elastune_worker.tuning.metrics import HIGHER_IS_BETTER, bleu4, exact_match, reached, rouge_l_f1

_TRAINER_NAMES = (
    "MAX_ITERATIONS",
    "TARGET_REACHED",
    "CheckpointMismatch",
    "StepInfo",
    "Trainer",
    "TuningConfig",
    "TuningResult",
    "build_peft_model",
    "evaluate_artifact",
    "global_batch_indices",
    "load_artifact",
)

__all__ = [
    "HIGHER_IS_BETTER",
    "DatasetError",
    "Record",
    "bleu4",
    "exact_match",
    "load_dataset",
    "reached",
    "rouge_l_f1",
    "split",
    *_TRAINER_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _TRAINER_NAMES:
        from elastune_worker.tuning import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
