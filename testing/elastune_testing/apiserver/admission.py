"""A custom resource as the apiextensions-apiserver admits it on create and update.

Order, after kubernetes/kubernetes staging/src/k8s.io/apiextensions-apiserver/pkg/registry/customresource/
strategy.go (PrepareForCreate/Update, Validate/ValidateUpdate) and pkg/apiserver/schema/pruning and
schema/defaulting (run by the CR handler while decoding, before the strategy):

1. unknown fields are pruned (or, with `fieldValidation=Strict`, reported: the caller answers 400);
2. defaults are applied;
3. the OpenAPI v3 structural schema is validated (types, required, enum, min/max, lengths, patterns,
   formats, list-type map/set uniqueness: pkg/apiserver/validation);
4. only when step 3 found no *blocking* error (a wrong type, a missing required field, an unsupported
   enum value, too long, too many: `hasBlockingErr` in strategy.go) the `x-kubernetes-validations` CEL
   rules run (`cel`); otherwise one more error says the rules were not checked.

Steps 1-3 are `elastune_contract.api.crdcheck` (the same pure functions the operator's contract tests
use); this module orders them and adds CEL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from elastune_contract.api import crdcheck
from elastune_testing.apiserver import cel

# crdcheck's wording of the field error types that block CEL: field.ErrorTypeRequired, NotSupported and
# TypeInvalid here, TooLong and TooMany as "must have at most N characters/items" (_blocking).
_BLOCKING: Final = ("required field is missing", "unsupported value", "must be of type")
NOT_CHECKED: Final = (
    '<nil>: Invalid value: "null": some validation rules were not checked because the object was '
    "invalid; correct the existing errors to complete validation"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Admitted:
    obj: dict[str, Any]
    errors: list[str]
    unknown_fields: list[str]


def _blocking(line: str) -> bool:
    reason = line.partition(": ")[2]
    if reason.startswith("must have at most"):
        return True
    return any(marker in reason for marker in _BLOCKING)


def admit(obj: Mapping[str, Any], old: Mapping[str, Any] | None, crd: Mapping[str, Any]) -> Admitted:
    """Prune, default and validate `obj` (metadata left to the caller); `old` is the stored object on
    update (transition rules and ratcheting need it), None on create."""
    pruned, unknown = crdcheck.prune_unknown_fields(obj, crd)
    defaulted = crdcheck.apply_defaults(pruned, crd)
    errors = crdcheck.validate_against_crd(defaulted, crd, strict=False)
    if any(_blocking(line) for line in errors):
        errors.append(NOT_CHECKED)
    else:
        schema = crdcheck.version_schema(crd, defaulted.get("apiVersion"))
        errors += cel.validate(defaulted, old, schema)
    return Admitted(defaulted, errors, unknown)


def crd_errors(crd: Mapping[str, Any]) -> list[str]:
    """What the apiserver refuses in a CRD that this emulator can check: CEL rules that do not compile."""
    errors = []
    for index, version in enumerate((crd.get("spec") or {}).get("versions") or []):
        schema = ((version.get("schema") or {}).get("openAPIV3Schema")) or {}
        for line in cel.compile_errors(schema):
            errors.append(f"spec.versions[{index}].schema.openAPIV3Schema.{line}")
    return errors
