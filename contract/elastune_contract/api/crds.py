"""CustomResourceDefinitions generated from the pydantic models, the single source of truth
(docs/design.md §3).

pydantic emits JSON Schema 2020-12; the apiserver wants a *structural* OpenAPI v3 schema. The conversion
inlines every $ref, drops titles, turns Optional[X] into "X, not required", const into enum, open maps
into x-kubernetes-preserve-unknown-fields, and refuses any keyword it does not know, so a new pydantic
feature cannot slip a non-structural construct into crds/ unnoticed.
"""

from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel

from elastune_contract.api.constants import (
    CATEGORIES,
    GROUP,
    KIND_LORA_ADAPTER,
    KIND_TUNING_JOB,
    KIND_WARM_POOL,
    PLURALS,
    SHORT_NAMES,
    SINGULARS,
    VERSION,
)
from elastune_contract.api.resources import RESOURCE_MODELS

HEADER: Final = (
    "# Generated from the pydantic models in contract/elastune_contract/api/ -- do not edit by hand.\n"
    "# Regenerate with: elastune crds --write crds/\n"
)

# Scalar keywords kept as they are (after their values are converted), in output order. Anything else
# is an error.
_SCALAR_ORDER: Final = (
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "nullable",
)
_SCALAR_KEYWORDS: Final = frozenset((*_SCALAR_ORDER, "required"))
_JUNCTORS: Final = ("allOf", "anyOf", "oneOf", "not")
# Output order of keywords in a schema node; properties keep the models' field order.
_KEY_ORDER: Final = (
    *_SCALAR_ORDER,
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "required",
    "properties",
    "additionalProperties",
    "items",
    "x-kubernetes-validations",
    *_JUNCTORS,
)

_ROOT_FIELD_DESCRIPTIONS: Final = {
    "apiVersion": "APIVersion defines the versioned schema of this representation of an object. Servers "
    "should convert recognized schemas to the latest internal value, and may reject unrecognized values.",
    "kind": "Kind is a string value representing the REST resource this object represents. Servers may "
    "infer this from the endpoint the client submits requests to. Cannot be updated. In CamelCase.",
}


def _description(text: str) -> str:
    # Docstrings wrap at the source's line length; kubectl explain re-wraps, so store one line.
    return " ".join(text.split())


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    rank = {key: index for index, key in enumerate(_KEY_ORDER)}
    return {key: node[key] for key in sorted(node, key=lambda key: (rank.get(key, len(rank)), key))}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline a $ref, letting the referring node's keys (a field's description) win over the target's."""
    while "$ref" in node:
        name = node["$ref"].removeprefix("#/$defs/")
        node = {**defs[name], **{key: value for key, value in node.items() if key != "$ref"}}
    return node


def _convert(node: dict[str, Any], defs: dict[str, Any], *, in_junctor: bool = False) -> dict[str, Any]:
    node = _resolve(node, defs)
    node = {key: value for key, value in node.items() if key != "title"}
    if node.get("x-kubernetes-int-or-string"):
        # The one place Kubernetes allows types inside anyOf: [{type: integer}, {type: string}].
        return _ordered(node)

    # Optional[X] (anyOf X | null) becomes X; not being in `required` is what makes it optional.
    if "anyOf" in node and "type" not in node and not node.get("x-kubernetes-int-or-string"):
        branches = [branch for branch in node["anyOf"] if branch != {"type": "null"}]
        if len(branches) != 1:
            raise ValueError(f"unions other than Optional[X] are not structural: {node['anyOf']}")
        outer = {key: value for key, value in node.items() if key != "anyOf"}
        if outer.get("default", ...) is None:
            del outer["default"]
        node = {**_resolve(branches[0], defs), **outer}
        node = {key: value for key, value in node.items() if key != "title"}

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "const":
            out["enum"] = [value]
        elif key == "description":
            out[key] = _description(value)
        elif key == "properties":
            out[key] = {name: _convert(sub, defs, in_junctor=in_junctor) for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, in_junctor=in_junctor)
        elif key == "additionalProperties":
            if value is True or value == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out[key] = _convert(value, defs, in_junctor=in_junctor)
            # False (extra="forbid") is dropped: structural schemas forbid it next to properties, and
            # unknown fields are pruned (or rejected by strict field validation) anyway.
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [_convert(sub, defs, in_junctor=True) for sub in value]
        elif key == "not":
            out[key] = _convert(value, defs, in_junctor=True)
        elif key in _SCALAR_KEYWORDS or key.startswith("x-kubernetes-"):
            out[key] = value
        else:
            raise ValueError(f"JSON schema keyword {key!r} has no structural equivalent: {node}")

    if in_junctor:
        # Structural rule: inside allOf/anyOf/oneOf/not only value constraints, no type or description.
        forbidden = {"type", "description", "default", "additionalProperties", "nullable"} & out.keys()
        if forbidden:
            raise ValueError(f"{sorted(forbidden)} not allowed inside a junctor: {out}")
        return _ordered(out)
    if "type" not in out:
        raise ValueError(f"schema node without a type is not structural: {out}")
    if out["type"] == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return _ordered(out)


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The openAPIV3Schema of a resource model: spec and status from the model, Kubernetes' standard
    apiVersion/kind/metadata at the root (the apiserver validates metadata itself)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema = _convert(raw, defs)
    properties = schema["properties"]
    for name, description in _ROOT_FIELD_DESCRIPTIONS.items():
        properties[name] = {"description": description, "type": "string"}
    properties["metadata"] = {"type": "object"}
    schema["required"] = [name for name in schema.get("required", []) if name in ("spec",)]
    return _ordered(schema)


def _printer_columns(kind: str) -> list[dict[str, Any]]:
    age = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    if kind == KIND_TUNING_JOB:
        return [
            {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
            {"name": "Method", "type": "string", "jsonPath": ".spec.method"},
            {
                "name": "Succeeded",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="Succeeded")].status',
            },
            {"name": "GPUs", "type": "integer", "jsonPath": ".status.allocatedGPUs"},
            {"name": "Iterations", "type": "integer", "jsonPath": ".status.iterations"},
            {"name": "Metric", "type": "string", "jsonPath": ".status.currentMetric"},
            {"name": "Deadline", "type": "string", "jsonPath": ".spec.deadline"},
            age,
        ]
    if kind == KIND_WARM_POOL:
        return [
            {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
            {"name": "Warm", "type": "integer", "jsonPath": ".status.warmGPUs"},
            {"name": "Busy", "type": "integer", "jsonPath": ".status.busyGPUs"},
            {"name": "Idle", "type": "integer", "jsonPath": ".status.idleGPUs"},
            age,
        ]
    if kind == KIND_LORA_ADAPTER:
        return [
            {"name": "Base", "type": "string", "jsonPath": ".spec.baseModel"},
            {"name": "Type", "type": "string", "jsonPath": ".spec.type"},
            {"name": "Rank", "type": "integer", "jsonPath": ".status.rank"},
            {
                "name": "Ready",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
            },
            {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {
                "name": "Reason",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
                "priority": 1,
            },
            age,
        ]
    raise ValueError(f"unknown kind {kind!r}")


def build_crd(model: type[BaseModel]) -> dict[str, Any]:
    """The CustomResourceDefinition of one resource model, as a dict."""
    kind: str = model.model_fields["kind"].default
    plural = PLURALS[kind]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "elastune"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": SINGULARS[kind],
                "shortNames": list(SHORT_NAMES[kind]),
                "categories": list(CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(kind),
                    "schema": {"openAPIV3Schema": structural_schema(model)},
                }
            ],
        },
    }


def crd_filename(crd: dict[str, Any]) -> str:
    """controller-gen's file naming: <group>_<plural>.yaml."""
    return f"{crd['spec']['group']}_{crd['spec']['names']['plural']}.yaml"


class _Dumper(yaml.SafeDumper):
    """Block-style YAML whose lists are indented under their key, as kubectl and controller-gen write."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)

    def ignore_aliases(self, data: Any) -> bool:
        # Shared sub-dicts (e.g. the Condition schema) must be written out in full, never as &anchors.
        return True


def to_yaml(document: dict[str, Any]) -> str:
    """Deterministic YAML: key order as built, no aliases, no line folding."""
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=1 << 16, allow_unicode=True)


def render_crds() -> dict[str, str]:
    """Every CRD as YAML text, keyed by file name (e.g. "elastune.dev_tuningjobs.yaml"), sorted by name."""
    crds = [build_crd(model) for model in RESOURCE_MODELS.values()]
    rendered = {crd_filename(crd): HEADER + to_yaml(crd) for crd in crds}
    return dict(sorted(rendered.items()))


def write_crds(directory: Path) -> list[Path]:
    """Write render_crds() into `directory` (created if missing); returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_crds().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
