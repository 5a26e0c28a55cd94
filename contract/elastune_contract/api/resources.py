"""Parsing any Elastune resource from a dict, with every problem reported against its field path."""

import json
import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from elastune_contract.api.common import JSON_TYPE_NAMES, format_path
from elastune_contract.api.constants import API_VERSION, KINDS
from elastune_contract.api.loraadapter import LoRAAdapter
from elastune_contract.api.tuningjob import TuningJob
from elastune_contract.api.warmpool import WarmPool

AnyResource = TuningJob | WarmPool | LoRAAdapter

RESOURCE_MODELS: Final[dict[str, type[TuningJob] | type[WarmPool] | type[LoRAAdapter]]] = {
    model.model_fields["kind"].default: model for model in (TuningJob, WarmPool, LoRAAdapter)
}


class InvalidResource(ValueError):
    """A resource that does not satisfy its model. `errors` holds one "path: reason" line per problem."""

    def __init__(self, errors: list[str], *, kind: str | None = None, name: str | None = None) -> None:
        self.errors = errors
        self.kind = kind
        self.name = name
        what = " ".join(part for part in (kind or "resource", repr(name) if name else None) if part)
        super().__init__(f"{what} is invalid:\n" + "\n".join(f"- {error}" for error in errors))


def _json(value: object) -> str:
    """Show a value as it appears in JSON/YAML: "0s", 12, true."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


_EXPECTED_BY_ERROR: Final = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "string_type": "a string",
    "bool_type": "a boolean",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dict_type": "an object",
    "list_type": "an array",
}


def _type_name(value: object) -> str:
    return JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated[...] and Optional[...] down to the type that holds the value."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [arg for arg in get_args(annotation) if arg is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def wire_path(model: type[BaseModel] | None, loc: Sequence[str | int]) -> list[str | int]:
    """Rewrite a pydantic error location with the wire (camelCase) names.

    pydantic reports by alias only what it read by alias; a default it validated (validate_default)
    or a field set by Python name comes back snake_case, so walk the model tree to translate.
    """
    path: list[str | int] = []
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        origin = get_origin(current)
        if isinstance(current, type) and issubclass(current, BaseModel) and isinstance(part, str):
            fields = current.model_fields
            name = part if part in fields else next((n for n, f in fields.items() if f.alias == part), None)
            if name is not None:
                path.append(fields[name].alias or name)
                current = fields[name].annotation
                continue
        elif origin is list and isinstance(part, int):
            current = get_args(current)[0]
        elif origin is dict:
            current = get_args(current)[1]
        else:
            current = None
        path.append(part)
    return path


def describe_error(error: ErrorDetails, model: type[BaseModel] | None = None) -> str:
    """One pydantic error as "path: reason", worded for people rather than as pydantic's dump."""
    loc = [part for part in error["loc"] if isinstance(part, str | int)]
    path = format_path(wire_path(model, loc))
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "missing":
        reason = "required field is missing"
    elif kind == "extra_forbidden":
        reason = "unknown field"
    elif kind == "literal_error":
        reason = f"unsupported value {_json(value)}: must be one of {ctx.get('expected')}"
    elif kind in _EXPECTED_BY_ERROR:
        reason = f"must be {_EXPECTED_BY_ERROR[kind]}; got {_type_name(value)} {_json(value)}"
    elif kind == "greater_than_equal":
        reason = f"must be >= {ctx.get('ge')}; got {_json(value)}"
    elif kind == "less_than_equal":
        reason = f"must be <= {ctx.get('le')}; got {_json(value)}"
    elif kind in ("string_too_short", "too_short"):
        minimum = ctx.get("min_length")
        reason = "must not be empty" if minimum == 1 else f"must have at least {minimum} elements"
    elif kind in ("string_too_long", "too_long"):
        reason = f"must have at most {ctx.get('max_length')} characters or elements"
    elif kind == "value_error":
        reason = str(ctx.get("error", error["msg"]))
    else:
        reason = error["msg"]
    return f"{path}: {reason}"


def describe_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """Every problem of a pydantic ValidationError of `model`, one "path: reason" line each, no repeats."""
    return list(dict.fromkeys(describe_error(error, model) for error in exc.errors()))


def parse_resource(obj: Mapping[str, Any]) -> AnyResource:
    """Validate a TuningJob, WarmPool or LoRAAdapter given as a dict (e.g. from YAML or the apiserver).

    Dispatches on `kind`; raises InvalidResource listing every problem as "spec.deadline: <reason>".
    """
    if not isinstance(obj, Mapping):
        raise InvalidResource([f"<root>: must be an object; got {_type_name(obj)}"])
    kind = obj.get("kind")
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    name = name if isinstance(name, str) else None
    model = RESOURCE_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        reason = "required field is missing" if kind is None else f"unsupported value {_json(kind)}"
        problems = [f"kind: {reason}: must be one of {', '.join(KINDS)}"]
        if obj.get("apiVersion") != API_VERSION:
            problems.append(f"apiVersion: must be {API_VERSION}; got {_json(obj.get('apiVersion'))}")
        raise InvalidResource(problems, name=name)
    try:
        return model.model_validate(dict(obj))
    except ValidationError as exc:
        raise InvalidResource(describe_validation_error(exc, model), kind=kind, name=name) from None
