"""`x-kubernetes-validations` rules of a CRD, evaluated as the apiextensions-apiserver evaluates them.

Followed: kubernetes/kubernetes staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel/
validation.go (Validator.validate, validateExpressions, validateMap/validateArray, fieldErrorForReason,
ruleMessageOrDefault, ruleErrorString). The rules this reproduces:

- a rule runs at its schema node for every non-null value there (`self`); rules of absent fields never run;
- a transition rule (one that names `oldSelf`) runs only on update and only where the old object has a
  correlatable value at the same place: object properties (unless `x-kubernetes-map-type: atomic`) and
  items of `x-kubernetes-list-type: map` lists by their keys; never on create;
- ratcheting (feature CRDValidationRatcheting, on by default since 1.30): a failing rule without `oldSelf`
  on a value equal to its old value is a warning, not an error, so old objects stay writable;
- a false rule is `field.Invalid(path[+fieldPath], <schema type>, message)`, or Forbidden/Required when
  the rule names that `reason`; the message is `message`, else "failed rule: <rule>"; an evaluation error
  is "<error> evaluating rule: <message or rule>";
- a CRD whose rule does not compile is refused when it is created (`compile_errors`).

CEL itself is PyPI `common-expression-language` (Python bindings of the maintained cel-rust interpreter).
Not reproduced: the apiserver type-checks rules against the schema at CRD creation (here a type error
shows up when a rule runs), the cost budget, `messageExpression`, `optionalOldSelf`, and the Kubernetes
CEL libraries (lists, regex, urls, quantity...). The rules in crds/ use none of them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

import cel

from elastune_contract.api.common import format_path

_MISSING: Final = object()
Path = list[str | int]


@functools.lru_cache(maxsize=512)
def _program(rule: str) -> Any:
    return cel.compile(rule)


def _uses_old_self(rule: str) -> bool:
    return "oldSelf" in (_program(rule).variables() or [])


def compile_errors(schema: Mapping[str, Any], path: Path | None = None) -> list[str]:
    """Rules that do not compile, as the CRD's validation reports them (the CRD is refused)."""
    path = path or []
    errors = []
    for index, rule in enumerate(schema.get("x-kubernetes-validations") or []):
        try:
            _program(str(rule.get("rule", "")))
        except (ValueError, RuntimeError) as exc:
            where = ".".join(str(part) for part in [*path, "x-kubernetes-validations"]) + f"[{index}].rule"
            errors.append(
                f"{where}: Invalid value: {json.dumps(rule.get('rule'))}: compilation failed: {exc}"
            )
    for key, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, Mapping):
            errors += compile_errors(sub, [*path, "properties", key])
    for key in ("items", "additionalProperties"):
        sub = schema.get(key)
        if isinstance(sub, Mapping):
            errors += compile_errors(sub, [*path, key])
    return errors


def _rule_text(rule: Mapping[str, Any]) -> str:
    # ruleErrorString: the message when there is one, else the rule.
    return str(rule.get("message") or rule.get("rule", "")).strip()


def _field_error(path: str, schema_type: str, detail: str, reason: str | None) -> str:
    """field.Error.Error() of fieldErrorForReason: "path: Invalid value: "object": detail" and kin."""
    if reason == "FieldValueForbidden":
        return f"{path}: Forbidden: {detail}"
    if reason == "FieldValueRequired":
        return f"{path}: Required value: {detail}"
    return f"{path}: Invalid value: {json.dumps(schema_type)}: {detail}"


def _node_errors(value: Any, old: Any, schema: Mapping[str, Any], path: Path, ratchet: bool) -> Iterator[str]:
    schema_type = str(schema.get("type", "object"))
    here = format_path(path)
    for rule in schema.get("x-kubernetes-validations") or []:
        source = str(rule.get("rule", ""))
        transition = _uses_old_self(source)
        if transition and old is _MISSING:
            continue  # transition rules need a comparable existing value
        if not transition and ratchet:
            continue  # unchanged since the old object: the apiserver only warns
        activation = {"self": value} | ({"oldSelf": old} if transition else {})
        try:
            result = _program(source).execute(activation)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            yield _field_error(here, schema_type, f"{exc} evaluating rule: {_rule_text(rule)}", None)
            continue
        if result is True:
            continue
        field_path = str(rule.get("fieldPath") or "").lstrip(".")
        at = f"{here}.{field_path}" if field_path else here
        message = str(rule.get("message") or "").strip() or f"failed rule: {source.strip()}"
        yield _field_error(at, schema_type, message, rule.get("reason"))


def _list_key(item: Any, keys: list[str]) -> str | None:
    return json.dumps([item.get(key) for key in keys]) if isinstance(item, Mapping) else None


def _walk(value: Any, old: Any, schema: Mapping[str, Any], path: Path, ratchet: bool) -> Iterator[str]:
    if value is None:
        return  # only non-null values are validated
    yield from _node_errors(value, old, schema, path, ratchet)
    if isinstance(value, Mapping):
        # Properties correlate with the old object's unless the map is atomic.
        correlatable = schema.get("x-kubernetes-map-type") != "atomic" and isinstance(old, Mapping)
        properties: Mapping[str, Any] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key, additional if isinstance(additional, Mapping) else None)
            if not isinstance(sub, Mapping):
                continue
            old_item = old.get(key, _MISSING) if correlatable else _MISSING
            child_ratchet = (old_item is not _MISSING and old_item == item) if correlatable else ratchet
            yield from _walk(item, old_item, sub, [*path, key], child_ratchet)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        keys = list(schema.get("x-kubernetes-list-map-keys") or [])
        by_key: dict[str, Any] = {}
        if schema.get("x-kubernetes-list-type") == "map" and isinstance(old, list):
            by_key = {k: item for item in old if (k := _list_key(item, keys)) is not None}
        for index, item in enumerate(value):
            key = _list_key(item, keys)
            old_item = by_key.get(key, _MISSING) if key is not None and by_key else _MISSING
            child_ratchet = (old_item == item) if old_item is not _MISSING else ratchet
            yield from _walk(item, old_item, schema["items"], [*path, index], child_ratchet)


def validate(obj: Mapping[str, Any], old: Mapping[str, Any] | None, schema: Mapping[str, Any]) -> list[str]:
    """Every failed rule of `schema` (an openAPIV3Schema) on `obj`, one apiserver field error line each.

    `obj` is the pruned and defaulted object; `old` the stored one on update, None on create.
    """
    root_old: Any = _MISSING if old is None else old
    ratchet = old is not None and obj == old
    return list(dict.fromkeys(_walk(obj, root_old, schema, [], ratchet)))
