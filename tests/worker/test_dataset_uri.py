"""A TuningJob's dataset on a claim (pvc://claim/path) is read from the claim's mount in the worker pod,
resolved like checkpoints and adapters; a path that leaves the claim is refused with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastune_contract.vocabulary import Reason
from elastune_worker.tuning.data import DatasetError, load_dataset


def test_a_pvc_dataset_is_read_from_the_claims_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTUNE_PVC_ROOT", str(tmp_path))
    (tmp_path / "jobs" / "data").mkdir(parents=True)
    (tmp_path / "jobs" / "data" / "d.jsonl").write_text('{"input": "a", "target": "b"}\n')
    assert load_dataset("pvc://jobs/data/d.jsonl") == [{"input": "a", "target": "b"}]


def test_a_pvc_dataset_outside_its_claim_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTUNE_PVC_ROOT", str(tmp_path))
    with pytest.raises(DatasetError) as err:
        load_dataset("pvc://jobs/../other/d.jsonl")
    assert err.value.reason == Reason.DATASET_UNSUPPORTED_SCHEME
