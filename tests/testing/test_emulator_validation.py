"""The API emulator admits custom resources as the apiextensions-apiserver does (elastune_testing.apiserver).

A test CRD (Widget) exercises each rule on its own; the shipped crds/*.yaml then show their own CEL rules
refused and accepted. Everything goes over HTTP; refusals are 422 `Status` bodies whose causes name the
fields. Sources: kubernetes/kubernetes staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/
cel/validation.go, pkg/registry/customresource/strategy.go (see the modules' docstrings).
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastune_testing.apiserver import cel
from elastune_testing.emulator import EmulatorHandle, start_emulator

REPO = Path(__file__).resolve().parents[2]
WIDGETS = "/apis/test.elastune.dev/v1/namespaces/default/widgets"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
MERGE = "application/merge-patch+json"

SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["size"],
    "properties": {
        "size": {"type": "integer", "minimum": 1, "maximum": 10},
        "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
        "code": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5},
        "when": {"type": "string", "format": "date-time"},
        "tags": {
            "type": "array",
            "items": {"type": "string"},
            "minItems": 1,
            "maxItems": 3,
            "x-kubernetes-list-type": "set",
        },
        "ports": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "port": {"type": "integer"}},
                "x-kubernetes-validations": [{"rule": "self.port > 0", "message": "port must be positive"}],
            },
        },
        "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "limits": {"type": "object", "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}}},
        "locked": {"type": "boolean"},
    },
    "x-kubernetes-validations": [
        {
            "rule": "!has(self.limits) || !has(self.limits.min) || !has(self.limits.max) "
            "|| self.limits.min <= self.limits.max",
            "fieldPath": ".limits.max",
            "message": "min must not exceed max",
        },
        {"rule": "self.size >= oldSelf.size", "message": "size may only grow"},
        {
            "rule": "!has(self.locked)",
            "fieldPath": ".locked",
            "reason": "FieldValueForbidden",
            "message": "no",
        },
    ],
}


def widget_crd(spec_schema: dict[str, Any] = SPEC_SCHEMA) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0}}},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.test.elastune.dev"},
        "spec": {
            "group": "test.elastune.dev",
            "scope": "Namespaced",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def widget(name: str = "w", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "test.elastune.dev/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": 2, **spec},
    }


def http(handle: EmulatorHandle, method: str, path: str, body: Any = None, ctype: str = "application/json"):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        handle.url + path, data=data, method=method, headers={"Content-Type": ctype}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def causes(answer: tuple[int, Any]) -> dict[str, tuple[str, str]]:
    """field -> (reason, message) of a 422 Invalid Status."""
    status, body = answer
    assert status == 422, f"HTTP {status} (a 422 Invalid was due): {json.dumps(body)[:300]}"
    assert (body["kind"], body["reason"]) == ("Status", "Invalid"), body
    return {c["field"]: (c["reason"], c["message"]) for c in body["details"]["causes"]}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[EmulatorHandle]:
    with start_emulator(tmp_path) as handle:
        assert http(handle, "POST", CRDS, widget_crd())[0] == 201
        yield handle


# -- the structural schema --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ({"size": "2"}, "spec.size", "FieldValueInvalid"),  # type
        ({"size": None}, "spec.size", "FieldValueRequired"),  # required (a null is pruned first)
        ({"size": 0}, "spec.size", "FieldValueInvalid"),  # minimum
        ({"size": 11}, "spec.size", "FieldValueInvalid"),  # maximum
        ({"mode": "c"}, "spec.mode", "FieldValueNotSupported"),  # enum
        ({"code": "Ab"}, "spec.code", "FieldValueInvalid"),  # pattern
        ({"code": "a"}, "spec.code", "FieldValueInvalid"),  # minLength
        ({"code": "abcdef"}, "spec.code", "FieldValueInvalid"),  # maxLength
        ({"when": "yesterday"}, "spec.when", "FieldValueInvalid"),  # format date-time
        ({"tags": []}, "spec.tags", "FieldValueInvalid"),  # minItems
        ({"tags": ["a", "b", "c", "d"]}, "spec.tags", "FieldValueInvalid"),  # maxItems
        ({"tags": ["a", "a"]}, "spec.tags[1]", "FieldValueDuplicate"),  # list-type set
        (
            {"ports": [{"name": "x", "port": 1}, {"name": "x", "port": 2}]},
            "spec.ports[1]",
            "FieldValueDuplicate",
        ),
        ({"ports": [{"port": 1}]}, "spec.ports[0].name", "FieldValueRequired"),
    ],
)
def test_each_schema_rule_is_refused_with_its_field(api: EmulatorHandle, spec, field, reason):
    found = causes(http(api, "POST", WIDGETS, widget(**spec)))
    assert found[field][0] == reason
    assert http(api, "GET", f"{WIDGETS}/w")[0] == 404  # nothing stored


def test_unknown_fields_pruned_nulls_dropped_defaults_applied(api: EmulatorHandle):
    body = widget(bogus=1, extra={"anything": {"goes": [1]}}, code=None)
    body["topLevel"] = True
    status, stored = http(api, "POST", WIDGETS, body)
    assert status == 201
    assert stored["spec"] == {"size": 2, "mode": "a", "extra": {"anything": {"goes": [1]}}}
    assert "topLevel" not in stored
    status, body = http(api, "POST", WIDGETS + "?fieldValidation=Strict", widget("s", bogus=1))
    assert (status, body["reason"]) == (400, "BadRequest") and 'unknown field "spec.bogus"' in body["message"]


# -- CEL (x-kubernetes-validations) ----------------------------------------------------------------


def test_cel_rule_refuses_at_its_field_path_and_accepts_when_it_holds(api: EmulatorHandle):
    found = causes(http(api, "POST", WIDGETS, widget(limits={"min": 3, "max": 2})))
    assert found == {
        "spec.limits.max": (
            "FieldValueInvalid",
            'spec.limits.max: Invalid value: "object": min must not exceed max',
        )
    }
    assert http(api, "POST", WIDGETS, widget(limits={"min": 2, "max": 2}))[0] == 201
    # The rule's `reason` picks the cause type (fieldErrorForReason).
    assert causes(http(api, "POST", WIDGETS, widget("l", locked=True))) == {
        "spec.locked": ("FieldValueForbidden", "spec.locked: Forbidden: no")
    }


def test_cel_rules_run_on_list_items(api: EmulatorHandle):
    found = causes(
        http(api, "POST", WIDGETS, widget(ports=[{"name": "a", "port": 1}, {"name": "b", "port": 0}]))
    )
    assert found == {
        "spec.ports[1]": (
            "FieldValueInvalid",
            'spec.ports[1]: Invalid value: "object": port must be positive',
        )
    }


def test_transition_rule_runs_on_update_only(api: EmulatorHandle):
    assert http(api, "POST", WIDGETS, widget(size=5))[0] == 201  # no oldSelf on create
    found = causes(http(api, "PATCH", f"{WIDGETS}/w", {"spec": {"size": 4}}, MERGE))
    assert found == {"spec": ("FieldValueInvalid", 'spec: Invalid value: "object": size may only grow')}
    status, grown = http(api, "PATCH", f"{WIDGETS}/w", {"spec": {"size": 6}}, MERGE)
    assert (status, grown["spec"]["size"], grown["metadata"]["generation"]) == (200, 6, 2)


def test_blocking_schema_errors_skip_cel(api: EmulatorHandle):
    # A wrong type blocks CEL (strategy.go hasBlockingErr): the CEL failure is not reported, a note is.
    found = causes(http(api, "POST", WIDGETS, widget(size="x", limits={"min": 3, "max": 2})))
    assert set(found) == {"spec.size", "<nil>"}
    assert "some validation rules were not checked" in found["<nil>"][1]
    # A pattern error does not block: both are reported.
    found = causes(http(api, "POST", WIDGETS, widget(code="X1", limits={"min": 3, "max": 2})))
    assert set(found) == {"spec.code", "spec.limits.max"}


def test_unchanged_values_ratchet_past_a_new_rule(api: EmulatorHandle):
    assert http(api, "POST", WIDGETS, widget(limits={"min": 1, "max": 9}))[0] == 201
    # The CRD gains a rule the stored object breaks.
    stricter = copy.deepcopy(SPEC_SCHEMA)
    stricter["properties"]["limits"]["x-kubernetes-validations"] = [
        {"rule": "self.max < 5", "message": "max < 5"}
    ]
    _, crd = http(api, "GET", f"{CRDS}/widgets.test.elastune.dev")
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"] = stricter
    assert http(api, "PUT", f"{CRDS}/widgets.test.elastune.dev", crd)[0] == 200
    # Writes that leave spec.limits as it was pass (CRDValidationRatcheting); changing it is checked.
    assert http(api, "PATCH", f"{WIDGETS}/w", {"metadata": {"labels": {"a": "b"}}}, MERGE)[0] == 200
    assert http(api, "PATCH", f"{WIDGETS}/w", {"spec": {"size": 3}}, MERGE)[0] == 200
    found = causes(http(api, "PATCH", f"{WIDGETS}/w", {"spec": {"limits": {"min": 2}}}, MERGE))
    assert found == {"spec.limits": ("FieldValueInvalid", 'spec.limits: Invalid value: "object": max < 5')}


def test_crd_with_a_rule_that_does_not_compile_is_refused(api: EmulatorHandle):
    broken = widget_crd({"type": "object", "x-kubernetes-validations": [{"rule": "self.("}]})
    broken["metadata"]["name"] = "gadgets.test.elastune.dev"
    broken["spec"]["names"] = {"kind": "Gadget", "plural": "gadgets", "singular": "gadget"}
    found = causes(http(api, "POST", CRDS, broken))
    assert list(found) == [
        "spec.versions[0].schema.openAPIV3Schema.properties.spec.x-kubernetes-validations[0].rule"
    ]


# -- the status subresource, generation and preconditions -------------------------------------------


def test_status_subresource_generation_and_stale_resource_version(api: EmulatorHandle):
    status, created = http(api, "POST", WIDGETS, {**widget(), "status": {"count": 3}})
    assert (status, created.get("status"), created["metadata"]["generation"]) == (201, None, 1)
    status, main = http(api, "PATCH", f"{WIDGETS}/w", {"spec": {"size": 3}, "status": {"count": 3}}, MERGE)
    assert (main["spec"]["size"], main.get("status"), main["metadata"]["generation"]) == (3, None, 2)
    status, sub = http(
        api, "PATCH", f"{WIDGETS}/w/status", {"spec": {"size": 9}, "status": {"count": 1}}, MERGE
    )
    assert (sub["spec"]["size"], sub["status"], sub["metadata"]["generation"]) == (3, {"count": 1}, 2)
    assert causes(http(api, "PATCH", f"{WIDGETS}/w/status", {"status": {"count": -1}}, MERGE)).keys() == {
        "status.count"
    }
    stale = {**main, "spec": {"size": 4}}  # main's resourceVersion is older than the status write
    status, body = http(api, "PUT", f"{WIDGETS}/w", stale)
    assert (status, body["kind"], body["reason"]) == (409, "Status", "Conflict")
    assert body["message"].startswith('Operation cannot be fulfilled on widgets.test.elastune.dev "w"')
    status, body = http(
        api, "PATCH", f"{WIDGETS}/w", {"metadata": {"resourceVersion": "1"}, "spec": {}}, MERGE
    )
    assert (status, body["reason"]) == (409, "Conflict")


# -- the CEL rules of crds/*.yaml ---------------------------------------------------------------------


def shipped_crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(path.read_text()) for path in sorted((REPO / "crds").glob("*.yaml"))]


@pytest.fixture
def shipped(tmp_path: Path) -> Iterator[EmulatorHandle]:
    with start_emulator(tmp_path, crds=shipped_crds()) as handle:
        yield handle


def test_every_shipped_rule_compiles():
    rules = [
        schema["openAPIV3Schema"]
        for crd in shipped_crds()
        for schema in (version["schema"] for version in crd["spec"]["versions"])
    ]
    assert "x-kubernetes-validations" in json.dumps(rules)
    assert [error for schema in rules for error in cel.compile_errors(schema)] == []


def test_shipped_warmpool_rule_min_not_above_max(shipped: EmulatorHandle):
    path = "/apis/elastune.dev/v1alpha1/namespaces/default/warmpools"
    pool = {"apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool", "metadata": {"name": "p"}}
    found = causes(
        http(shipped, "POST", path, {**pool, "spec": {"model": "m", "minWarmGPUs": 3, "maxWarmGPUs": 2}})
    )
    assert found["spec.maxWarmGPUs"][1].endswith("minWarmGPUs must not exceed maxWarmGPUs")
    assert (
        http(shipped, "POST", path, {**pool, "spec": {"model": "m", "minWarmGPUs": 2, "maxWarmGPUs": 2}})[0]
        == 201
    )
    volume = {"claimName": "c", "jobStorage": True, "readOnly": True}
    found = causes(http(shipped, "PATCH", f"{path}/p", {"spec": {"volumes": [volume]}}, MERGE))
    assert "spec.volumes[0].readOnly" in found


def test_shipped_loraadapter_rules(shipped: EmulatorHandle):
    path = "/apis/elastune.dev/v1alpha1/namespaces/default/loraadapters"
    adapter = {"apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": "a"}}
    base = {"baseModel": "m", "artifactURL": "pvc://claim/a"}
    found = causes(
        http(shipped, "POST", path, {**adapter, "spec": {**base, "type": "promptTuning", "rank": 8}})
    )
    assert list(found) == ["spec.rank"]
    found = causes(http(shipped, "POST", path, {**adapter, "spec": {**base, "artifactSecret": "creds"}}))
    assert list(found) == ["spec.artifactSecret"]
    s3 = {**base, "artifactURL": "s3://bucket/a", "artifactSecret": "creds"}
    assert http(shipped, "POST", path, {**adapter, "spec": s3})[0] == 201


def test_shipped_tuningjob_spec_is_immutable(shipped: EmulatorHandle):
    path = "/apis/elastune.dev/v1alpha1/namespaces/default/tuningjobs"
    job = {"apiVersion": "elastune.dev/v1alpha1", "kind": "TuningJob", "metadata": {"name": "j"}}
    job["spec"] = {
        "model": "m",
        "dataset": "/d.jsonl",
        "termination": {"maxIterations": 5},
        "deadline": "10m",
    }
    assert http(shipped, "POST", path, job)[0] == 201
    found = causes(http(shipped, "PATCH", f"{path}/j", {"spec": {"deadline": "20m"}}, MERGE))
    assert found == {
        "spec": (
            "FieldValueInvalid",
            'spec: Invalid value: "object": spec is immutable: delete and re-create the TuningJob',
        )
    }
    # Metadata and status writes (the operator's) leave spec alone and pass.
    assert http(shipped, "PATCH", f"{path}/j", {"metadata": {"finalizers": ["x/y"]}}, MERGE)[0] == 200
    assert http(shipped, "PATCH", f"{path}/j/status", {"status": {"iterations": 1}}, MERGE)[0] == 200
