"""The API models: units, defaults, camelCase round trips, conditions, and bad input rejected by both the
CRD schema (what the apiserver refuses) and the models (what the operator refuses), naming the field."""

import copy
import re
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastune_contract.api import constants, crdcheck, units
from elastune_contract.api.common import Condition, get_condition, is_condition_true, set_condition
from elastune_contract.api.crds import render_crds
from elastune_contract.api.resources import InvalidResource, parse_resource
from elastune_contract.api.tuningjob import TuningJob, TuningJobSpec
from elastune_contract.api.warmpool import DEFAULT_WORKER_IMAGE, WarmPool
from elastune_contract.vocabulary import ConditionType, Reason

REPO = Path(__file__).resolve().parents[2]
CRDS = {
    yaml.safe_load(text)["spec"]["names"]["kind"]: yaml.safe_load(text) for text in render_crds().values()
}


def manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "manifests" / name).read_text())


def minimal_job(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "elastune.dev/v1alpha1",
        "kind": "TuningJob",
        "metadata": {"name": "job"},
        "spec": {
            "model": "elastune/tiny-gpt2",
            "dataset": "file:///data/train.jsonl",
            "termination": {"maxIterations": 100},
            "deadline": "10m",
        }
        | spec,
    }


def minimal_pool(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "elastune.dev/v1alpha1",
        "kind": "WarmPool",
        "metadata": {"name": "pool"},
        "spec": {"model": "elastune/tiny-gpt2"} | spec,
    }


def model_errors(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidResource) as info:
        parse_resource(obj)
    return info.value.errors


def names_field(error: str, path: str) -> bool:
    """Errors read "spec.deadline: <reason>" (or 'unknown field "spec.foo"' in the apiserver's words)."""
    return error.startswith(f"{path}: ") or error == f'unknown field "{path}"'


# -- bad input: both layers reject it and name the field ------------------------------------------


def _without_model(obj: dict[str, Any]) -> None:
    del obj["spec"]["model"]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = obj
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    return mutate


BAD_JOBS = [
    ("missing-model", _without_model, "spec.model"),
    ("deadline-zero", _set("spec.deadline", "0s"), "spec.deadline"),
    ("deadline-zero-minutes", _set("spec.deadline", "0h0m"), "spec.deadline"),
    ("deadline-negative", _set("spec.deadline", "-5m"), "spec.deadline"),
    ("deadline-words", _set("spec.deadline", "soon"), "spec.deadline"),
    ("deadline-integer", _set("spec.deadline", 600), "spec.deadline"),
    ("unknown-method", _set("spec.method", "fineTuning"), "spec.method"),
    (
        "exact-match-above-one",
        _set("spec.termination.target", {"metric": "exactMatch", "value": "1.5"}),
        "spec.termination.target.value",
    ),
    (
        "negative-loss",
        _set("spec.termination.target", {"metric": "loss", "value": "-1"}),
        "spec.termination.target.value",
    ),
    (
        "unknown-metric",
        _set("spec.termination.target", {"metric": "f1", "value": "0.5"}),
        "spec.termination.target.metric",
    ),
    ("unknown-spec-field", _set("spec.foo", "bar"), "spec.foo"),
    ("unknown-nested-field", _set("spec.termination.bar", 1), "spec.termination.bar"),
    ("zero-iterations", _set("spec.termination.maxIterations", 0), "spec.termination.maxIterations"),
    (
        "float-learning-rate",
        _set("spec.hyperparameters.learningRate", 0.3),
        "spec.hyperparameters.learningRate",
    ),
    (
        "zero-learning-rate",
        _set("spec.hyperparameters.learningRate", "0.0"),
        "spec.hyperparameters.learningRate",
    ),
    ("string-batch-size", _set("spec.hyperparameters.batchSize", "8"), "spec.hyperparameters.batchSize"),
    ("huge-batch-size", _set("spec.hyperparameters.batchSize", 4097), "spec.hyperparameters.batchSize"),
    (
        "endless-iterations",
        _set("spec.termination.maxIterations", 10**6 + 1),
        "spec.termination.maxIterations",
    ),
    (
        "too-many-virtual-tokens",
        _set("spec.hyperparameters.virtualTokens", 513),
        "spec.hyperparameters.virtualTokens",
    ),
    ("unknown-dataset-scheme", _set("spec.dataset", "ftp://host/train.jsonl"), "spec.dataset"),
    ("empty-model", _set("spec.model", ""), "spec.model"),
    ("unknown-prompt-bank-mode", _set("spec.promptBank", "sometimes"), "spec.promptBank"),
    ("unknown-status-field", _set("status.phase", "Running"), "status.phase"),
]


@pytest.mark.parametrize(("case", "mutate", "path"), BAD_JOBS, ids=[case for case, _, _ in BAD_JOBS])
def test_bad_tuning_job_is_rejected_by_crd_and_model(
    case: str, mutate: Callable[[dict[str, Any]], None], path: str
) -> None:
    obj = minimal_job()
    mutate(obj)
    crd_errors = crdcheck.validate_against_crd(obj, CRDS["TuningJob"])
    assert crd_errors, f"{case}: the CRD schema accepted it"
    assert all(names_field(error, path) for error in crd_errors), crd_errors
    errors = model_errors(obj)
    assert errors, f"{case}: the model accepted it"
    assert all(names_field(error, path) for error in errors), errors


@pytest.mark.parametrize(
    ("metric", "value", "ok"),
    [
        ("loss", "0", True),
        ("loss", "3.25", True),
        ("loss", "-0.1", False),
        ("exactMatch", "0", True),
        ("accuracy", "1", True),
        ("bleu", "1.000", True),
        ("rougeL", "1.0001", False),
        ("exactMatch", "-0.5", False),
        ("accuracy", "2", False),
    ],
)
def test_target_range_agrees_between_crd_and_model(metric: str, value: str, ok: bool) -> None:
    obj = minimal_job(termination={"maxIterations": 5, "target": {"metric": metric, "value": value}})
    assert (crdcheck.validate_against_crd(obj, CRDS["TuningJob"]) == []) is ok
    if ok:
        parse_resource(obj)
    else:
        assert model_errors(obj)[0].startswith("spec.termination.target.value: ")


def test_every_problem_is_listed_in_readable_words() -> None:
    obj = minimal_job(deadline="soon", method="fineTuning", foo=1)
    del obj["spec"]["model"]
    with pytest.raises(InvalidResource) as info:
        parse_resource(obj)
    message = str(info.value)
    assert message.startswith("TuningJob 'job' is invalid:")
    for path in ("spec.model", "spec.deadline", "spec.method", "spec.foo"):
        assert f"- {path}: " in message
    assert "invalid duration 'soon'" in message
    assert "fineTuning" in message
    # Not pydantic's dump: no links, no "Input should", no type names of pydantic's own.
    assert "pydantic" not in message and "Input should" not in message
    assert isinstance(info.value, ValueError)
    assert len(info.value.errors) == 4


def test_bad_kind_api_version_and_shape() -> None:
    with pytest.raises(InvalidResource, match=r"kind: unsupported value \"Job\""):
        parse_resource(minimal_job() | {"kind": "Job"})
    with pytest.raises(InvalidResource, match="kind: required field is missing"):
        parse_resource({"apiVersion": constants.API_VERSION, "spec": {}})
    errors = model_errors(minimal_job() | {"apiVersion": "elastune.dev/v1"})
    assert errors == [
        "apiVersion: unsupported value \"elastune.dev/v1\": must be one of 'elastune.dev/v1alpha1'"
    ]
    with pytest.raises(InvalidResource, match="must be an object"):
        parse_resource(["not", "a", "dict"])  # type: ignore[arg-type]


def test_warm_pool_min_above_max_is_rejected_by_the_model() -> None:
    assert model_errors(minimal_pool(minWarmGPUs=9)) == [
        "spec.maxWarmGPUs: must be >= minWarmGPUs (9); got 8"
    ]
    assert model_errors(minimal_pool(minWarmGPUs=4, maxWarmGPUs=2))[0].startswith("spec.maxWarmGPUs: ")
    parse_resource(minimal_pool(minWarmGPUs=4, maxWarmGPUs=4))


def test_warm_pool_bad_fields_name_their_path() -> None:
    obj = minimal_pool(idleWindow="0s", tolerations=[{"key": "nvidia.com/gpu", "effect": "Sometimes"}])
    obj["status"] = {"iterationSeconds": {"0": "1.5"}}
    expected = {"spec.idleWindow", "spec.tolerations[0].effect", "status.iterationSeconds"}
    assert {error.split(":")[0] for error in model_errors(obj)} == expected
    crd_paths = {error.split(":")[0] for error in crdcheck.validate_against_crd(obj, CRDS["WarmPool"])}
    # Map keys cannot be constrained in a structural schema; only the model checks GPU-count keys.
    assert crd_paths == expected - {"status.iterationSeconds"}


def test_duplicate_condition_types_are_rejected_by_the_model() -> None:
    condition = {
        "type": "Ready",
        "status": "True",
        "reason": "PoolReady",
        "message": "",
        "lastTransitionTime": "2025-01-02T03:04:05Z",
    }
    obj = minimal_pool()
    obj["status"] = {"conditions": [condition, condition]}
    assert model_errors(obj) == ["status.conditions: duplicate condition type 'Ready'"]


# -- units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("10m", 600), ("1h30m", 5400), ("2h", 7200), ("1h0m1s", 3601), ("0h5m", 300), ("007s", 7)],
)
def test_parse_duration(text: str, seconds: int) -> None:
    assert units.parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["0s", "0m", "0h0m0s", "-5m", "soon", "", "10", "1m1h", "1.5h", " 10m", "10m\n", "1d"]
)
def test_parse_duration_rejects_and_names_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        units.parse_duration(text)


def test_duration_pattern_agrees_with_parse_duration() -> None:
    pattern = crdcheck._re2_semantics(units.DURATION_PATTERN)
    samples = [
        f"{h}{m}{s}" for h in ("", "0h", "1h", "00h") for m in ("", "0m", "5m") for s in ("", "0s", "09s")
    ]
    samples += ["-5m", "soon", "5", "h", "1h\n"]
    for sample in samples:
        try:
            units.parse_duration(sample)
            parsed = True
        except ValueError:
            parsed = False
        assert (pattern.search(sample) is not None) == parsed, sample


def test_format_duration_round_trips() -> None:
    assert [units.format_duration(s) for s in (0, 45, 60, 90, 3600, 5400, 3661)] == [
        "0s",
        "45s",
        "1m",
        "1m30s",
        "1h",
        "1h30m",
        "1h1m1s",
    ]
    for seconds in range(1, 20000, 97):
        assert units.parse_duration(units.format_duration(seconds)) == seconds
    with pytest.raises(ValueError, match="-1"):
        units.format_duration(-1)


def test_decimals() -> None:
    assert units.parse_decimal("0.46") == Decimal("0.46")
    assert units.parse_decimal("-2") == Decimal(-2)
    for bad in ("1e-3", "NaN", "Infinity", ".5", "1.", "", "0,5"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            units.parse_decimal(bad)
    with pytest.raises(ValueError, match=r"0\.5"):
        units.parse_decimal(0.5)  # type: ignore[arg-type]
    assert units.format_decimal(Decimal("0.4567"), 3) == "0.457"
    assert units.format_decimal(12.0) == "12"
    assert units.format_decimal(1e-7) == "0.0000001"


@pytest.mark.parametrize(
    "text", ["0", "0.0", "0.01", "00.10", "1", "1.000", "1.0001", "2", "10.5", "01", "0010", "99.000"]
)
def test_decimal_patterns_agree_with_their_numbers(text: str) -> None:
    number = Decimal(text)

    def matches(pattern: str) -> bool:
        return crdcheck._re2_semantics(pattern).search(text) is not None

    assert matches(units.NON_NEGATIVE_DECIMAL_PATTERN)
    assert matches(units.POSITIVE_DECIMAL_PATTERN) is (number > 0)
    assert matches(units.UNIT_INTERVAL_DECIMAL_PATTERN) is (0 <= number <= 1)
    assert not matches(units.NON_NEGATIVE_DECIMAL_PATTERN.replace("^", "^-"))


def test_timestamps() -> None:
    moment = units.parse_timestamp("2025-01-02T03:04:05.5+02:00")
    assert units.format_timestamp(moment) == "2025-01-02T01:04:05Z"
    for bad in ("2025-01-02", "2025-13-02T03:04:05Z", "yesterday", "2025-01-02T03:04:05"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            units.parse_timestamp(bad)


# -- defaults and round trips --------------------------------------------------------------------


def test_tuning_job_defaults() -> None:
    job = parse_resource(minimal_job())
    assert isinstance(job, TuningJob)
    spec = job.spec
    assert (spec.method, spec.prompt_bank, spec.initial_prompt, spec.output) == (
        "promptTuning",
        "auto",
        None,
        None,
    )
    hyper = spec.hyperparameters
    assert (hyper.batch_size, hyper.learning_rate, hyper.optimizer, hyper.virtual_tokens) == (
        8,
        "0.3",
        "adamw",
        20,
    )
    assert spec.termination.target is None
    assert spec.deadline_seconds == 600
    assert job.status is None


def test_warm_pool_defaults() -> None:
    pool = parse_resource(minimal_pool())
    assert isinstance(pool, WarmPool)
    spec = pool.spec
    assert (spec.gpus_per_pod, spec.min_warm_gpus, spec.max_warm_gpus) == (1, 0, 8)
    assert (spec.idle_window, spec.idle_window_seconds) == ("60s", 60)
    assert spec.worker.image == DEFAULT_WORKER_IMAGE == "ghcr.io/elastune/worker:0.1.0"
    assert spec.profile is None and spec.tolerations is None


@pytest.mark.parametrize("obj", [minimal_job(), minimal_pool()], ids=["TuningJob", "WarmPool"])
def test_crd_defaults_equal_model_defaults(obj: dict[str, Any]) -> None:
    """What the apiserver stores after defaulting is exactly what the models fill in."""
    crd = CRDS[obj["kind"]]
    assert crdcheck.apply_defaults(obj, crd) == parse_resource(obj).to_dict()


@pytest.mark.parametrize("name", ["tuningjob.yaml", "warmpool.yaml", "loraadapter.yaml"])
def test_camel_case_round_trip(name: str) -> None:
    original = manifest(name)
    resource = parse_resource(original)
    dumped = resource.model_dump(by_alias=True, exclude_none=True)
    assert parse_resource(dumped) == resource
    assert crdcheck.validate_against_crd(dumped, CRDS[original["kind"]]) == []
    assert all("_" not in key for key in dumped["spec"]), "snake_case leaked onto the wire"


def test_acronym_aliases_and_population_by_name() -> None:
    pool = parse_resource(minimal_pool(minWarmGPUs=1, maxWarmGPUs=2)).to_dict()
    assert (pool["spec"]["minWarmGPUs"], pool["spec"]["maxWarmGPUs"]) == (1, 2)
    spec = TuningJobSpec(
        model="m",
        dataset="s3://bucket/train.jsonl",
        termination={"max_iterations": 3},  # type: ignore[arg-type]
        deadline="1h",
    )
    assert spec.termination.max_iterations == 3
    job = TuningJob(metadata={"name": "j"}, spec=spec)  # type: ignore[arg-type]
    job_dict = job.to_dict()
    assert job_dict["apiVersion"] == constants.API_VERSION and job_dict["kind"] == "TuningJob"
    assert job_dict["spec"]["termination"] == {"maxIterations": 3}


def test_full_status_round_trips_through_crd_and_model() -> None:
    obj = manifest("tuningjob.yaml")
    obj["status"] = {
        "conditions": [
            {
                "type": "Succeeded",
                "status": "True",
                "observedGeneration": 1,
                "lastTransitionTime": "2025-01-02T03:14:05Z",
                "reason": "SLOMet",
                "message": "target reached after 120 iterations",
            }
        ],
        "observedGeneration": 1,
        "allocatedGPUs": 2,
        "pods": ["tiny-gpt2-00001-a", "tiny-gpt2-00001-b"],
        "iterations": 120,
        "currentMetric": "0.82",
        "predictedCompletionTime": "2025-01-02T03:13:00Z",
        "promptBank": {
            "used": True,
            "prompt": "Write SQL:",
            "score": "1.73",
            "evaluations": 66,
            "latencySeconds": "4.2",
            "reason": "PromptBankUsed",
        },
        "optimizedPrompt": "Translate to SQL",
        "artifactURI": "pvc://elastune-artifacts/prompts/nl2sql-tiny/prompt.safetensors",
        "gpuSeconds": "1180.5",
        "sloMet": True,
        "startTime": "2025-01-02T03:04:10Z",
        "completionTime": "2025-01-02T03:14:05Z",
    }
    assert crdcheck.validate_against_crd(obj, CRDS["TuningJob"]) == []
    job = parse_resource(obj)
    assert isinstance(job, TuningJob) and job.status is not None
    assert job.status.allocated_gpus == 2 and job.status.artifact_uri is not None
    assert job.to_dict() == obj


def test_metadata_passes_server_fields_through() -> None:
    obj = minimal_job()
    obj["metadata"] |= {
        "uid": "0d4c",
        "resourceVersion": "42",
        "generation": 3,
        "creationTimestamp": "2025-01-02T03:04:05Z",
        "managedFields": [{"manager": "kubectl", "operation": "Apply"}],
        "finalizers": [constants.FINALIZER],
    }
    job = parse_resource(obj)
    assert job.metadata.generation == 3
    assert job.to_dict()["metadata"] == obj["metadata"]


def test_api_version_literal_is_the_constant() -> None:
    assert TuningJob.model_fields["api_version"].default == constants.API_VERSION == "elastune.dev/v1alpha1"
    assert constants.FINALIZER == "elastune.dev/finalizer"


# -- conditions ----------------------------------------------------------------------------------

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
T1 = datetime(2025, 1, 2, 3, 9, 0, tzinfo=UTC)


def test_set_condition_keeps_transition_time_when_status_is_unchanged() -> None:
    first = set_condition([], ConditionType.ACCEPTED, "True", Reason.VALIDATED, now=T0)
    again = set_condition(first, ConditionType.ACCEPTED, "True", Reason.VALIDATED, now=T1)
    assert again == first, "same outcome twice must be a no-op"
    reworded = set_condition(first, ConditionType.ACCEPTED, "True", Reason.UNKNOWN_MODEL, "hm", now=T1)
    assert reworded[0].last_transition_time == "2025-01-02T03:04:05Z"
    assert (reworded[0].reason, reworded[0].message) == (Reason.UNKNOWN_MODEL, "hm")


def test_set_condition_moves_transition_time_when_status_changes() -> None:
    conditions = set_condition(None, ConditionType.SUCCEEDED, "Unknown", Reason.TUNING, now=T0)
    conditions = set_condition(conditions, ConditionType.READY, "True", Reason.VALIDATED, now=T0)
    before = copy.deepcopy(conditions)
    done = set_condition(
        conditions, ConditionType.SUCCEEDED, "True", Reason.TARGET_REACHED, observed_generation=2, now=T1
    )
    assert conditions == before, "the input list must not be modified"
    assert [c.type for c in done] == ["Succeeded", "Ready"]
    succeeded = get_condition(done, ConditionType.SUCCEEDED)
    assert succeeded is not None
    assert (succeeded.status, succeeded.last_transition_time) == ("True", "2025-01-02T03:09:00Z")
    assert succeeded.observed_generation == 2
    assert is_condition_true(done, ConditionType.SUCCEEDED)
    assert not is_condition_true(done, ConditionType.FAILED)
    assert get_condition(done, ConditionType.READY) == before[1]


def test_set_condition_validates_reason() -> None:
    with pytest.raises(ValueError, match="CamelCase"):
        set_condition([], ConditionType.FAILED, "True", "not camel case", now=T0)


def test_condition_constants_fit_the_schema() -> None:
    reasons = [value for key, value in vars(Reason).items() if key.isupper()]
    types = [value for key, value in vars(ConditionType).items() if key.isupper()]
    assert len(set(reasons)) == len(reasons) >= 20
    assert {"InvalidSpec", "UnknownModel", "DatasetNotFound", "LatencyBudgetExceeded"} <= set(reasons)
    assert set(types) == {
        "Accepted", "Scheduled", "Running", "Succeeded", "Failed", "Ready", "Loaded", "Published",
        "ModelReady",
    }  # fmt: skip
    for reason in reasons:
        for type_ in types:
            Condition(
                type=type_,
                status="False",
                reason=reason,
                message="",
                last_transition_time="2025-01-02T03:04:05Z",
            )
