"""Every example manifest is accepted by its CRD (as an apiserver would) and by the models."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from elastune_contract.api import constants, crdcheck
from elastune_contract.api.resources import parse_resource

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "manifests").glob("*.yaml"))
CRDS = {
    crd["spec"]["names"]["kind"]: crd
    for crd in (yaml.safe_load(path.read_text()) for path in sorted((REPO / "crds").glob("*.yaml")))
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def test_there_is_an_example_of_every_kind() -> None:
    kinds = sorted(doc["kind"] for path in MANIFESTS for doc in documents(path))
    assert kinds == sorted(constants.KINDS)
    assert {path.name for path in MANIFESTS} >= {"tuningjob.yaml", "warmpool.yaml", "loraadapter.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_manifest_is_valid_for_the_crd_and_the_models(path: Path) -> None:
    for doc in documents(path):
        assert doc["apiVersion"] == constants.API_VERSION
        assert crdcheck.validate_against_crd(doc, CRDS[doc["kind"]]) == []
        resource = parse_resource(doc)
        assert type(resource).__name__ == doc["kind"]
        assert resource.metadata.name == doc["metadata"]["name"]
        # Written in full: nothing the apiserver would prune or the models would drop.
        assert crdcheck.prune_unknown_fields(doc, CRDS[doc["kind"]])[1] == []
        assert resource.to_dict() == doc


def test_tuning_job_example_is_the_documented_one() -> None:
    job = parse_resource(yaml.safe_load((REPO / "manifests" / "tuningjob.yaml").read_text()))
    assert job.kind == "TuningJob"
    assert job.spec.model == "elastune/tiny-gpt2"
    assert job.spec.deadline_seconds == 600
    assert job.spec.termination.max_iterations == 200
    assert job.spec.termination.target is not None
    assert (job.spec.termination.target.metric, job.spec.termination.target.value) == ("exactMatch", "0.6")
    # The dataset ships next to the manifest (elastune run resolves it there; the worker image copies it).
    assert (REPO / "manifests" / job.spec.dataset).is_file()


def test_warm_pool_example_targets_the_cold_gpu_pool() -> None:
    pool = parse_resource(yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text()))
    assert pool.kind == "WarmPool"
    assert pool.spec.node_selector == {constants.LABEL_POOL: constants.POOL_COLD}
    assert pool.spec.tolerations is not None
    assert [t.key for t in pool.spec.tolerations] == ["nvidia.com/gpu"]
    assert pool.spec.idle_window_seconds == 60
    assert pool.spec.min_warm_gpus <= pool.spec.max_warm_gpus
