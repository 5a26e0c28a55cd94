"""What a Kubernetes apiserver does to a custom resource with a structural schema, as pure functions.

Order on the server: prune unknown fields (strict field validation reports them instead) and nulls,
apply defaults, then validate against the openAPIV3Schema. Dicts in, dicts and lists of messages out,
so a Kubernetes API emulator in the tests can reuse it as is.

Not covered: x-kubernetes-validations (CEL) rules are not evaluated, and metadata is left to the caller
(the apiserver validates ObjectMeta itself). The models enforce the CEL rules' intent (e.g.
minWarmGPUs <= maxWarmGPUs) when the operator parses the object.
"""

import copy
import json
import re
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any, Final

from jsonschema import Draft4Validator, FormatChecker, ValidationError
from jsonschema.validators import extend

from elastune_contract.api import units
from elastune_contract.api.common import JSON_TYPE_NAMES, PATTERN_DESCRIPTIONS, format_path

# Fields of the root the apiserver handles itself; the CRD only says `metadata: {type: object}`.
_ROOT_PASSTHROUGH: Final = frozenset({"apiVersion", "kind", "metadata"})


# -- schema lookup -------------------------------------------------------------------------------


def _group_versions(crd: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    group = crd["spec"]["group"]
    return {f"{group}/{version['name']}": version for version in crd["spec"]["versions"]}


def version_schema(crd: Mapping[str, Any], api_version: str | None = None) -> dict[str, Any]:
    """The openAPIV3Schema for `api_version`, or of the storage version when it is None or not found."""
    versions = _group_versions(crd)
    version = versions.get(api_version or "")
    if version is None:
        version = next((v for v in versions.values() if v.get("storage")), next(iter(versions.values())))
    return version["schema"]["openAPIV3Schema"]


# -- pruning -------------------------------------------------------------------------------------


def _prune(value: Any, schema: Mapping[str, Any], path: list[str | int], unknown: list[str]) -> Any:
    if schema.get("x-kubernetes-int-or-string"):
        return copy.deepcopy(value)
    preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        properties: Mapping[str, Any] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        result = {}
        for key, item in value.items():
            if key in properties:
                sub = properties[key]
            elif isinstance(additional, Mapping):
                sub = additional
            elif preserve:
                result[key] = copy.deepcopy(item)
                continue
            else:
                unknown.append(format_path([*path, key]))
                continue
            # The apiserver drops nulls of non-nullable fields before defaulting rather than failing.
            if item is None and not sub.get("nullable"):
                continue
            result[key] = _prune(item, sub, [*path, key], unknown)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [_prune(item, schema["items"], [*path, index], unknown) for index, item in enumerate(value)]
    # Scalars, and values of the wrong type (validation reports those), stay as they are.
    return copy.deepcopy(value)


def prune_unknown_fields(obj: Mapping[str, Any], crd: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Drop the fields the schema does not know, as the apiserver does; return (pruned copy, their paths).

    Paths read like the apiserver's ("spec.termination.bar", "spec.tolerations[0].foo"). Fields under
    x-kubernetes-preserve-unknown-fields are kept; metadata is passed through untouched.
    """
    schema = version_schema(crd, obj.get("apiVersion"))
    unknown: list[str] = []
    body = {key: value for key, value in obj.items() if key not in _ROOT_PASSTHROUGH}
    pruned = _prune(body, schema, [], unknown)
    passthrough = {key: copy.deepcopy(value) for key, value in obj.items() if key in _ROOT_PASSTHROUGH}
    # Keep the caller's key order so a round trip does not reshuffle the object.
    ordered = {key: (passthrough | pruned)[key] for key in obj if key in passthrough or key in pruned}
    return ordered, unknown


# -- defaulting ----------------------------------------------------------------------------------


def _default(value: Any, schema: Mapping[str, Any]) -> Any:
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties") or {}
        for key, sub in properties.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, item in value.items():
            sub = properties.get(key)
            if sub is None and isinstance(schema.get("additionalProperties"), Mapping):
                sub = schema["additionalProperties"]
            if sub is not None:
                value[key] = _default(item, sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [_default(item, schema["items"]) for item in value]
    return value


def apply_defaults(obj: Mapping[str, Any], crd: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `obj` with the schema's defaults filled in, recursively (a defaulted {} gets its own)."""
    schema = version_schema(crd, obj.get("apiVersion"))
    result = copy.deepcopy(dict(obj))
    for key, sub in (schema.get("properties") or {}).items():
        if key in _ROOT_PASSTHROUGH:
            continue
        if key not in result and "default" in sub:
            result[key] = copy.deepcopy(sub["default"])
        if key in result:
            result[key] = _default(result[key], sub)
    return result


# -- validation ----------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _re2_semantics(pattern: str) -> re.Pattern[str]:
    """Compile an RE2 pattern for Python: RE2's `$` (no multi-line flag) matches only at the very end,
    Python's also before a final newline, so unescaped `$` outside classes becomes `\\Z`."""
    out = []
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "[":
            in_class = True
        elif char == "]":
            in_class = False
        elif char == "$" and not in_class:
            out.append(r"\Z")
            continue
        out.append(char)
    return re.compile("".join(out))


def _pattern(
    validator: Any, pattern: str, instance: Any, schema: Mapping[str, Any]
) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _re2_semantics(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


_FORMATS: Final = FormatChecker(formats=())


@_FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    # Only strings carry a format; the type keyword reports anything else.
    return not isinstance(value, str) or bool(units.parse_timestamp(value))


# Draft 4 is closest to OpenAPI v3.0 (boolean exclusiveMinimum, no const), as the apiserver reads it.
_Validator: Final = extend(Draft4Validator, {"pattern": _pattern})


def _nullable_to_type(schema: Any) -> Any:
    """OpenAPI `nullable: true` is JSON Schema `type: [t, "null"]`."""
    if isinstance(schema, list):
        return [_nullable_to_type(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: _nullable_to_type(value) for key, value in schema.items()}
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _json(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _branch_rank(errors: list[ValidationError]) -> tuple[int, int]:
    # The branch the user meant is the one whose selectors (enum/const, e.g. metric: loss) matched:
    # fewest selector mismatches first, then fewest errors (the apiserver also reports the best branch).
    return sum(error.validator in ("enum", "const") for error in errors), len(errors)


def _describe(error: ValidationError) -> list[str]:
    parts = list(error.absolute_path)
    path = format_path(parts)
    keyword = error.validator
    value = error.validator_value
    instance = error.instance
    if keyword == "required":
        present = instance if isinstance(instance, Mapping) else {}
        return [
            f"{format_path([*parts, name])}: required field is missing"
            for name in value
            if name not in present
        ]
    if keyword in ("anyOf", "oneOf") and error.context:
        branches: dict[int, list[ValidationError]] = {}
        for sub in error.context:
            branches.setdefault(int(sub.relative_schema_path[0]), []).append(sub)
        best = min(branches.values(), key=_branch_rank)
        return [line for sub in best for line in _describe(sub)]
    if keyword == "enum":
        allowed = ", ".join(_json(item) for item in value)
        reason = f"unsupported value {_json(instance)}: must be one of {allowed}"
    elif keyword == "pattern":
        wording = PATTERN_DESCRIPTIONS.get(value, f"must match the pattern {value}")
        reason = f"{wording}; got {_json(instance)}"
    elif keyword == "type":
        expected = " or ".join(value) if isinstance(value, list) else value
        reason = (
            f"must be of type {expected}; got {JSON_TYPE_NAMES.get(type(instance), '?')} {_json(instance)}"
        )
        if expected == "string" and isinstance(instance, int | float) and not isinstance(instance, bool):
            # YAML reads `learningRate: 0.01` as a number; the API keeps decimals as strings (no floats
            # in spec), so show the form it takes (issue 41 item 6).
            field = parts[-1] if parts else "value"
            reason = f'must be a string: write it quoted, {field}: "{instance}" (YAML reads it as a number)'

    elif keyword == "minimum":
        exclusive = error.schema.get("exclusiveMinimum") is True
        reason = f"must be {'>' if exclusive else '>='} {value}; got {_json(instance)}"
    elif keyword == "maximum":
        exclusive = error.schema.get("exclusiveMaximum") is True
        reason = f"must be {'<' if exclusive else '<='} {value}; got {_json(instance)}"
    elif keyword == "minLength":
        reason = "must not be empty" if value == 1 else f"must have at least {value} characters"
    elif keyword == "maxLength":
        reason = f"must have at most {value} characters"
    elif keyword == "minItems":
        reason = f"must have at least {value} items"
    elif keyword == "maxItems":
        reason = f"must have at most {value} items"
    elif keyword == "format" and value == "date-time":
        reason = f"{units.PATTERN_DESCRIPTIONS[units.TIMESTAMP_PATTERN]}; got {_json(instance)}"
    else:
        reason = error.message
    return [f"{path}: {reason}"]


def _list_map_duplicates(value: Any, schema: Mapping[str, Any], path: list[str | int]) -> Iterator[str]:
    """x-kubernetes-list-type map/set forbid duplicate keys/items; JSON Schema cannot say that."""
    if isinstance(value, list):
        raw_items = schema.get("items")
        items: Mapping[str, Any] = raw_items if isinstance(raw_items, Mapping) else {}
        list_type = schema.get("x-kubernetes-list-type")
        seen: set[str] = set()
        for index, item in enumerate(value):
            if list_type == "map" and isinstance(item, Mapping):
                key = _json({name: item.get(name) for name in schema.get("x-kubernetes-list-map-keys", [])})
            elif list_type == "set":
                key = _json(item)
            else:
                key = None
            if key is not None:
                if key in seen:
                    yield f"{format_path([*path, index])}: duplicate entry {key}"
                seen.add(key)
            yield from _list_map_duplicates(item, items, [*path, index])
    elif isinstance(value, Mapping):
        properties: Mapping[str, Any] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key, additional if isinstance(additional, Mapping) else None)
            if sub is not None:
                yield from _list_map_duplicates(item, sub, [*path, key])


def validate_against_crd(obj: Mapping[str, Any], crd: Mapping[str, Any], *, strict: bool = True) -> list[str]:
    """Every reason the apiserver would refuse `obj` under `crd`, one "path: reason" line each.

    strict=True is kubectl's default server-side field validation: unknown fields are errors
    ('unknown field "spec.foo"'). With strict=False they are silently pruned, as with --validate=false.
    """
    names = crd["spec"]["names"]
    errors: list[str] = []
    if obj.get("kind") != names["kind"]:
        errors.append(f"kind: must be {_json(names['kind'])}; got {_json(obj.get('kind'))}")
    served = {gv: v for gv, v in _group_versions(crd).items() if v.get("served", True)}
    if obj.get("apiVersion") not in served:
        errors.append(f"apiVersion: must be one of {', '.join(served)}; got {_json(obj.get('apiVersion'))}")
        return errors
    schema = _nullable_to_type(version_schema(crd, obj["apiVersion"]))
    pruned, unknown = prune_unknown_fields(obj, crd)
    if strict:
        errors.extend(f'unknown field "{path}"' for path in unknown)
    defaulted = apply_defaults(pruned, crd)
    validator = _Validator(schema, format_checker=_FORMATS)
    found = sorted(validator.iter_errors(defaulted), key=lambda error: [str(p) for p in error.absolute_path])
    errors.extend(line for error in found for line in _describe(error))
    errors.extend(_list_map_duplicates(defaulted, schema, []))
    return list(dict.fromkeys(errors))
