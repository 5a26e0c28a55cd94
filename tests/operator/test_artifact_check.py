"""What the control plane checks of a pvc:// artifact: only a claim mounted in its own pod. A pod that
merely has the claim root (/mnt/pvc, e.g. from its image or node) leaves the check to the workers, which
mount the claim; found in the pod world, where the operator judged a published artifact missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastune_contract.api.loraadapter import LoRAAdapterSpec
from elastune_contract.vocabulary import Reason
from elastune_operator.control.artifacts import ArtifactInfo, Problem, inspect

SPEC = {"baseModel": "elastune/tiny-llama", "type": "promptTuning"}


def spec(url: str) -> LoRAAdapterSpec:
    return LoRAAdapterSpec.model_validate({**SPEC, "artifactURL": url})


def test_a_claim_this_pod_does_not_mount_is_left_to_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTUNE_PVC_ROOT", str(tmp_path))  # the root exists, the claim is not mounted
    got = inspect(spec("pvc://tuning/elastune/artifacts/team-a/author"), max_rank=64)
    assert isinstance(got, ArtifactInfo) and not got.checked, got


def test_a_mounted_claim_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTUNE_PVC_ROOT", str(tmp_path))
    (tmp_path / "tuning").mkdir()
    got = inspect(spec("pvc://tuning/missing"), max_rank=64)
    assert isinstance(got, Problem) and got.reason == Reason.ARTIFACT_NOT_FOUND, got
