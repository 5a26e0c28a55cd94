"""The CRDs in crds/ are generated from the models, structural, and checked the way an apiserver would."""

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
import yaml
from pydantic import Field, TypeAdapter

from elastune_contract.api import constants, crdcheck
from elastune_contract.api.crds import HEADER, render_crds, write_crds

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"
REGENERATE = "regenerate with `elastune crds --write crds/` and commit the result"

RENDERED = render_crds()
CRDS = {yaml.safe_load(text)["spec"]["names"]["kind"]: yaml.safe_load(text) for text in RENDERED.values()}
JUNCTORS = ("allOf", "anyOf", "oneOf", "not")


def schema_of(kind: str) -> dict[str, Any]:
    return CRDS[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: Any, path: str = "", in_junctor: bool = False) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """Every schema node with its path and whether it sits inside a junctor."""
    if not isinstance(node, dict):
        return
    yield path, node, in_junctor
    for name, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{name}".lstrip("."), in_junctor)
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]", in_junctor)
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}", in_junctor)
    for junctor in JUNCTORS:
        branches = node.get(junctor)
        if node.get("x-kubernetes-int-or-string"):
            continue  # [{type: integer}, {type: string}] is the one sanctioned exception
        for index, branch in enumerate(branches if isinstance(branches, list) else [branches]):
            yield from walk(branch, f"{path}<{junctor}{index}>", True)


def all_keys(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key
            yield from all_keys(value)
    elif isinstance(node, list):
        for item in node:
            yield from all_keys(item)


# -- drift ---------------------------------------------------------------------------------------


def test_crds_on_disk_equal_the_models() -> None:
    on_disk = {path.name: path.read_text(encoding="utf-8") for path in sorted(CRD_DIR.glob("*.yaml"))}
    assert sorted(on_disk) == sorted(RENDERED), (
        f"crds/ holds other files than the models produce; {REGENERATE}"
    )
    for name, text in RENDERED.items():
        assert on_disk[name] == text, f"crds/{name} drifted from the pydantic models; {REGENERATE}"


def test_render_is_deterministic_and_named_like_controller_gen() -> None:
    assert render_crds() == RENDERED
    assert sorted(RENDERED) == [
        "elastune.dev_loraadapters.yaml",
        "elastune.dev_tuningjobs.yaml",
        "elastune.dev_warmpools.yaml",
    ]
    assert all(text.startswith(HEADER) for text in RENDERED.values())


def test_write_crds_writes_exactly_the_rendered_text(tmp_path: Path) -> None:
    written = write_crds(tmp_path / "out")
    assert [path.name for path in written] == list(RENDERED)
    assert {path.name: path.read_text(encoding="utf-8") for path in written} == RENDERED


# -- structural schema rules ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", constants.KINDS)
def test_schema_is_structural(kind: str) -> None:
    schema = schema_of(kind)
    keys = set(all_keys(schema))
    assert not keys & {"$ref", "$defs", "title", "const"}, keys & {"$ref", "$defs", "title", "const"}
    for path, node, in_junctor in walk(schema):
        if in_junctor:
            forbidden = {"type", "description", "default", "additionalProperties", "nullable"} & node.keys()
            assert not forbidden, f"{path}: {forbidden} inside a junctor"
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), (
            f"{path}: both kinds of properties"
        )
        assert not isinstance(node.get("exclusiveMinimum"), int | float), f"{path}: numeric exclusiveMinimum"
        for junctor in JUNCTORS:
            if junctor in node and not node.get("x-kubernetes-int-or-string"):
                for branch in node[junctor] if isinstance(node[junctor], list) else [node[junctor]]:
                    # Fields constrained in a junctor must also be declared outside it (for pruning).
                    extra = set(branch.get("properties", {})) - set(node.get("properties", {}))
                    assert not extra, f"{path}: {junctor} names undeclared fields {extra}"
        if node.get("x-kubernetes-list-type") == "map":
            keys_required = set(node["x-kubernetes-list-map-keys"]) <= set(node["items"].get("required", []))
            assert keys_required, f"{path}: list-map keys must be required in the items"


def test_preserve_unknown_fields_only_where_needed() -> None:
    preserved = {
        (kind, path)
        for kind in constants.KINDS
        for path, node, _ in walk(schema_of(kind))
        if node.get("x-kubernetes-preserve-unknown-fields")
    }
    # valueFrom passes Kubernetes' EnvVarSource through; everything else is fully typed.
    assert preserved == {("WarmPool", "spec.worker.env[].valueFrom")}


@pytest.mark.parametrize("kind", constants.KINDS)
def test_root_follows_kubernetes_conventions(kind: str) -> None:
    schema = schema_of(kind)
    assert schema["type"] == "object"
    assert schema["required"] == ["spec"]
    assert schema["properties"]["metadata"] == {"type": "object"}
    assert schema["properties"]["apiVersion"]["type"] == "string"
    assert list(schema["properties"]) == ["apiVersion", "kind", "metadata", "spec", "status"]
    assert schema["description"], "the resource docstring becomes the CRD description"


def test_every_pattern_is_re2_compatible_and_matches_like_rust() -> None:
    """pydantic-core compiles patterns with Rust's regex crate, which (like RE2) has no lookaround or
    backreferences; and crdcheck's Python matching must agree with it, including RE2's `$`."""
    patterns = {
        node["pattern"]
        for kind in constants.KINDS
        for _, node, _ in walk(schema_of(kind))
        if "pattern" in node
    }
    assert len(patterns) >= 8
    samples = [
        "10m",
        "10m\n",
        "0s",
        "1h0m",
        "0.8",
        "1.5",
        "-1",
        "s3://b/k",
        "nvidia.com/gpu",
        "500m",
        "",
        "a b",
    ]
    for pattern in patterns:
        rust = TypeAdapter(Annotated[str, Field(pattern=pattern)])
        for sample in samples:
            try:
                rust.validate_python(sample)
                rust_ok = True
            except ValueError:
                rust_ok = False
            python_ok = crdcheck._re2_semantics(pattern).search(sample) is not None
            assert rust_ok == python_ok, (pattern, sample)


# -- names, subresources, printer columns --------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "plural", "short", "columns"),
    [
        (
            "TuningJob",
            "tuningjobs",
            ["tj"],
            ["Model", "Method", "Succeeded", "GPUs", "Iterations", "Metric", "Deadline", "Age"],
        ),
        ("WarmPool", "warmpools", ["wp"], ["Model", "Warm", "Busy", "Idle", "Age"]),
        (
            "LoRAAdapter",
            "loraadapters",
            ["lora"],
            ["Base", "Type", "Rank", "Ready", "Replicas", "Reason", "Age"],
        ),
    ],
)
def test_crd_names_and_columns(kind: str, plural: str, short: list[str], columns: list[str]) -> None:
    crd = CRDS[kind]
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == f"{plural}.elastune.dev"
    spec = crd["spec"]
    assert spec["group"] == constants.GROUP
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": kind,
        "listKind": f"{kind}List",
        "plural": plural,
        "singular": kind.lower(),
        "shortNames": short,
        "categories": ["elastune"],
    }
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    assert [column["name"] for column in version["additionalPrinterColumns"]] == columns


@pytest.mark.parametrize("kind", constants.KINDS)
def test_printer_columns_point_at_real_fields(kind: str) -> None:
    schema = schema_of(kind)
    for column in CRDS[kind]["spec"]["versions"][0]["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".metadata."):
            continue
        node = schema
        for part in path.split("[?(")[0].lstrip(".").split("."):
            node = node["properties"][part]
            if node["type"] == "array":
                node = node["items"]
        if "[?(" not in path:
            expected = {"string": "string", "integer": "integer", "date": "string"}[column["type"]]
            assert node["type"] == expected, f"{kind} column {column['name']}: {path} is {node['type']}"


def test_succeeded_column_reads_the_succeeded_condition() -> None:
    columns = CRDS["TuningJob"]["spec"]["versions"][0]["additionalPrinterColumns"]
    succeeded = next(column for column in columns if column["name"] == "Succeeded")
    assert succeeded["jsonPath"] == '.status.conditions[?(@.type=="Succeeded")].status'


def test_warm_pool_min_max_rule_is_a_cel_validation() -> None:
    spec = schema_of("WarmPool")["properties"]["spec"]
    (rule,) = [r for r in spec["x-kubernetes-validations"] if "minWarmGPUs" in r["rule"]]
    assert "self.minWarmGPUs <= self.maxWarmGPUs" in rule["rule"]
    assert rule["fieldPath"] == ".maxWarmGPUs"


def test_target_range_depends_on_metric_through_anyof() -> None:
    target = schema_of("TuningJob")["properties"]["spec"]["properties"]["termination"]["properties"]["target"]
    branches = {tuple(b["properties"]["metric"]["enum"]): b["properties"]["value"] for b in target["anyOf"]}
    assert set(branches) == {("loss",), ("exactMatch", "accuracy", "bleu", "rougeL")}


# -- crdcheck: what the apiserver does -----------------------------------------------------------


def tuning_job(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": "elastune/tiny-gpt2",
        "dataset": "file:///data/train.jsonl",
        "termination": {"maxIterations": 10},
        "deadline": "10m",
    }
    return {
        "apiVersion": constants.API_VERSION,
        "kind": "TuningJob",
        "metadata": {"name": "job", "uid": "1234", "resourceVersion": "7", "managedFields": [{"x": 1}]},
        "spec": base | spec,
    }


def test_prune_reports_and_drops_unknown_fields_but_keeps_metadata() -> None:
    obj = tuning_job(foo=1, termination={"maxIterations": 10, "bar": True})
    obj["extra"] = "x"
    original = copy.deepcopy(obj)
    pruned, unknown = crdcheck.prune_unknown_fields(obj, CRDS["TuningJob"])
    assert sorted(unknown) == ["extra", "spec.foo", "spec.termination.bar"]
    assert "foo" not in pruned["spec"] and "bar" not in pruned["spec"]["termination"]
    assert "extra" not in pruned
    assert pruned["metadata"] == original["metadata"]
    assert obj == original, "the input must not be modified"


def test_prune_honours_preserve_unknown_fields_and_maps() -> None:
    pool = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    pool["spec"]["worker"]["env"][1]["valueFrom"]["secretKeyRef"]["optional"] = True
    pool["spec"]["tolerations"][0]["bogus"] = 1
    pruned, unknown = crdcheck.prune_unknown_fields(pool, CRDS["WarmPool"])
    assert unknown == ["spec.tolerations[0].bogus"]
    assert pruned["spec"]["worker"]["env"][1]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert pruned["spec"]["nodeSelector"] == {"elastune.dev/pool": "cold"}


def test_nulls_are_dropped_before_validation() -> None:
    obj = tuning_job(initialPrompt=None, output=None)
    pruned, unknown = crdcheck.prune_unknown_fields(obj, CRDS["TuningJob"])
    assert unknown == []
    assert "initialPrompt" not in pruned["spec"] and "output" not in pruned["spec"]
    assert crdcheck.validate_against_crd(obj, CRDS["TuningJob"]) == []


def test_defaults_fill_nested_objects() -> None:
    defaulted = crdcheck.apply_defaults(tuning_job(), CRDS["TuningJob"])
    assert defaulted["spec"]["method"] == "promptTuning"
    assert defaulted["spec"]["promptBank"] == "auto"
    assert defaulted["spec"]["hyperparameters"] == {
        "batchSize": 8,
        "learningRate": "0.3",
        "optimizer": "adamw",
        "virtualTokens": 20,
    }
    assert "status" not in defaulted and "output" not in defaulted["spec"]


def test_strict_false_prunes_silently() -> None:
    obj = tuning_job(foo=1)
    assert crdcheck.validate_against_crd(obj, CRDS["TuningJob"], strict=False) == []
    assert crdcheck.validate_against_crd(obj, CRDS["TuningJob"]) == ['unknown field "spec.foo"']


def test_wrong_kind_or_version_is_reported() -> None:
    obj = tuning_job()
    obj["apiVersion"] = "elastune.dev/v1"
    errors = crdcheck.validate_against_crd(obj, CRDS["WarmPool"])
    assert errors[0].startswith('kind: must be "WarmPool"')
    assert errors[1].startswith("apiVersion: must be one of elastune.dev/v1alpha1")


def test_dollar_anchor_has_re2_semantics() -> None:
    # Python's `$` would accept a trailing newline; Go's RE2 does not.
    errors = crdcheck.validate_against_crd(tuning_job(deadline="10m\n"), CRDS["TuningJob"])
    assert errors == [
        "spec.deadline: must be a positive duration of whole hours, minutes and seconds such as "
        '90s, 10m or 1h30m; got "10m\\n"'
    ]


def test_status_is_validated_including_list_map_keys() -> None:
    obj = tuning_job()
    condition = {
        "type": "Succeeded",
        "status": "True",
        "reason": "SLOMet",
        "message": "",
        "lastTransitionTime": "2025-01-02T03:04:05Z",
    }
    obj["status"] = {"conditions": [condition, condition], "allocatedGPUs": -1, "gpuSeconds": 12}
    errors = crdcheck.validate_against_crd(obj, CRDS["TuningJob"])
    assert "status.allocatedGPUs: must be >= 0; got -1" in errors
    quoted = 'status.gpuSeconds: must be a string: write it quoted, gpuSeconds: "12" (YAML reads it as a'
    quoted += " number)"
    assert quoted in errors
    assert 'status.conditions[1]: duplicate entry {"type": "Succeeded"}' in errors
    assert len(errors) == 3, errors


def test_int_or_string_quantities() -> None:
    pool = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    pool["spec"]["worker"]["resources"]["limits"]["cpu"] = "two"
    pool["spec"]["worker"]["resources"]["limits"]["nvidia.com/gpu"] = 2.5
    errors = crdcheck.validate_against_crd(pool, CRDS["WarmPool"])
    assert any(
        error.startswith("spec.worker.resources.limits.cpu: must be a Kubernetes quantity")
        for error in errors
    )
    assert any(error.startswith("spec.worker.resources.limits[nvidia.com/gpu]:") for error in errors), errors
