"""Building blocks shared by every Elastune resource: the base model, string formats, metadata, conditions.

Each string format is one Annotated type carrying both its Python check (with a readable error) and
its JSON schema (an RE2 pattern), so the models and the generated CRDs cannot disagree.
"""

import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from elastune_contract.api import units
from elastune_contract.api.constants import API_VERSION


class ApiModel(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields rejected, no type coercion.

    strict=True mirrors the apiserver, which rejects "8" for an integer and 0.3 for a string.
    Attribute docstrings become field descriptions and so the CRD descriptions (`kubectl explain`).
    """

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        strict=True,
        use_attribute_docstrings=True,
        validate_default=False,
    )


def _checked(check: Callable[[str], object]) -> AfterValidator:
    """A validator running ``check`` (which raises a readable ValueError) and keeping the string."""

    def validate(value: str) -> str:
        check(value)
        return value

    return AfterValidator(validate)


def _pattern(pattern: str, **schema: Any) -> WithJsonSchema:
    """The JSON schema of a string format: its RE2 pattern (plus any length bounds)."""
    return WithJsonSchema({"type": "string", "pattern": pattern, **schema})


def _regex_check(pattern: str, description: str) -> Callable[[str], None]:
    compiled = re.compile(pattern.removeprefix("^").removesuffix("$"))

    def check(value: str) -> None:
        if compiled.fullmatch(value) is None:
            raise ValueError(f"{description}; got {value!r}")

    return check


def _positive_decimal(value: str) -> None:
    if units.parse_decimal(value) <= 0:
        raise ValueError(f"invalid decimal {value!r}: must be greater than zero")


def _non_negative_decimal(value: str) -> None:
    if units.parse_decimal(value) < 0:
        raise ValueError(f"invalid decimal {value!r}: must not be negative")


# -- string formats ------------------------------------------------------------------------------

#: Where data lives: an absolute path (inside the worker pod), file:///…, pvc://<claim>/<path>,
#: s3://<bucket>/<key> or http(s)://<host>/….
URI_PATTERN: Final = (
    r"^(?:/\S+|file:///\S+|pvc://[a-z0-9](?:[-a-z0-9]*[a-z0-9])?/\S+|s3://[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/\S+"
    r"|https?://[^\s/]+(?:/\S*)?)$"
)
URI_DESCRIPTION: Final = (
    "must be an absolute path, file:///<path>, pvc://<claim>/<path>, s3://<bucket>/<key> or http(s)://<url>"
)
#: A dataset location: any URI above, or a relative path: `elastune run` resolves it against the manifest's
#: directory, a worker pod against its working directory (the worker image keeps the example datasets of
#: manifests/data/ there). A relative path has no ':' at all, which tells it from a URI without a
#: lookahead (RE2, the apiserver's regex engine, has none).
DATASET_URI_PATTERN: Final = URI_PATTERN[:-2] + r"|[^\s/:][^\s:]*)$"
DATASET_URI_DESCRIPTION: Final = (
    URI_DESCRIPTION
    + ", or a relative path (to the manifest with elastune run, to the worker's directory in a pod)"
)
#: A Hugging Face id ("elastune/tiny-gpt2") or a local path: non-empty, no whitespace.
MODEL_NAME_PATTERN: Final = r"^\S+$"
MODEL_NAME_DESCRIPTION: Final = (
    "must be a non-empty model name without whitespace, such as elastune/tiny-gpt2"
)
#: A resource's metadata.name as Kubernetes requires it (RFC 1123 label: what Services and pods accept).
RESOURCE_NAME_PATTERN: Final = r"^[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?$"
RESOURCE_NAME_DESCRIPTION: Final = (
    "must be a lower-case RFC 1123 name of at most 63 characters, such as sql-helper"
)
#: metav1.Condition.reason: CamelCase, starting with a letter.
REASON_PATTERN: Final = r"^[A-Za-z](?:[A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
REASON_DESCRIPTION: Final = "must be a CamelCase reason such as InvalidSpec"
#: metav1.Condition.type: an optionally domain-prefixed name such as Ready or elastune.dev/Warm.
CONDITION_TYPE_PATTERN: Final = (
    r"^(?:[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*/)?"
    r"(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"
)
CONDITION_TYPE_DESCRIPTION: Final = "must be a condition type such as Ready"
#: Environment variable names as Kubernetes accepts them.
ENV_NAME_PATTERN: Final = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
ENV_NAME_DESCRIPTION: Final = "must be an environment variable name such as HF_HOME"
#: resource.Quantity in its string form ("500m", "2Gi", "1").
QUANTITY_PATTERN: Final = (
    r"^(?:\+|-)?(?:(?:[0-9]+(?:\.[0-9]*)?)|(?:\.[0-9]+))"
    r"(?:(?:[KMGTPE]i)|[numkMGTPE]|(?:[eE](?:\+|-)?(?:(?:[0-9]+(?:\.[0-9]*)?)|(?:\.[0-9]+))))?$"
)
QUANTITY_DESCRIPTION: Final = "must be a Kubernetes quantity such as 500m, 2Gi or 1"

#: Every pattern the models publish, with the wording a schema error should use instead of the regex.
PATTERN_DESCRIPTIONS: Final = {
    **units.PATTERN_DESCRIPTIONS,
    URI_PATTERN: URI_DESCRIPTION,
    DATASET_URI_PATTERN: DATASET_URI_DESCRIPTION,
    MODEL_NAME_PATTERN: MODEL_NAME_DESCRIPTION,
    RESOURCE_NAME_PATTERN: RESOURCE_NAME_DESCRIPTION,
    REASON_PATTERN: REASON_DESCRIPTION,
    CONDITION_TYPE_PATTERN: CONDITION_TYPE_DESCRIPTION,
    ENV_NAME_PATTERN: ENV_NAME_DESCRIPTION,
    QUANTITY_PATTERN: QUANTITY_DESCRIPTION,
}

# Each string format: a str with its Python check (readable error) and its published pattern, written
# out as Annotated[...] so type checkers see plain str fields.
Duration = Annotated[str, _checked(units.parse_duration), _pattern(units.DURATION_PATTERN)]
DecimalString = Annotated[str, _checked(units.parse_decimal), _pattern(units.DECIMAL_PATTERN)]
NonNegativeDecimal = Annotated[
    str, _checked(_non_negative_decimal), _pattern(units.NON_NEGATIVE_DECIMAL_PATTERN)
]
PositiveDecimal = Annotated[str, _checked(_positive_decimal), _pattern(units.POSITIVE_DECIMAL_PATTERN)]
Uri = Annotated[str, _checked(_regex_check(URI_PATTERN, URI_DESCRIPTION)), _pattern(URI_PATTERN)]
DatasetUri = Annotated[
    str, _checked(_regex_check(DATASET_URI_PATTERN, DATASET_URI_DESCRIPTION)), _pattern(DATASET_URI_PATTERN)
]
ModelName = Annotated[
    str, _checked(_regex_check(MODEL_NAME_PATTERN, MODEL_NAME_DESCRIPTION)), _pattern(MODEL_NAME_PATTERN)
]
ResourceName = Annotated[
    str,
    _checked(_regex_check(RESOURCE_NAME_PATTERN, RESOURCE_NAME_DESCRIPTION)),
    _pattern(RESOURCE_NAME_PATTERN),
]
ReasonString = Annotated[
    str,
    _checked(_regex_check(REASON_PATTERN, REASON_DESCRIPTION)),
    _pattern(REASON_PATTERN, minLength=1, maxLength=1024),
]
ConditionTypeString = Annotated[
    str,
    _checked(_regex_check(CONDITION_TYPE_PATTERN, CONDITION_TYPE_DESCRIPTION)),
    _pattern(CONDITION_TYPE_PATTERN, maxLength=316),
]
EnvName = Annotated[
    str, _checked(_regex_check(ENV_NAME_PATTERN, ENV_NAME_DESCRIPTION)), _pattern(ENV_NAME_PATTERN)
]


def _check_timestamp(value: str) -> str:
    units.parse_timestamp(value)
    return value


# metav1.Time: published as format date-time like every Kubernetes timestamp.
Timestamp = Annotated[
    str,
    AfterValidator(_check_timestamp),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]

_check_quantity_string = _regex_check(QUANTITY_PATTERN, QUANTITY_DESCRIPTION)


def _check_quantity(value: object) -> int | str:
    # A Quantity is int-or-string on the wire; bool is an int subclass in Python but not in JSON.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        _check_quantity_string(value)
        return value
    raise ValueError(f"must be a Kubernetes quantity (integer or string such as 2Gi); got {value!r}")


Quantity = Annotated[
    int | str,
    BeforeValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]


# -- field paths ---------------------------------------------------------------------------------

_PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")


#: JSON type names of Python values, for error messages of both validation layers.
JSON_TYPE_NAMES: Final = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def format_path(parts: Sequence[str | int]) -> str:
    """Dotted camelCase path from the resource root: spec.tolerations[0].effect, spec.nodeSelector[a/b].

    Keys that are not plain identifiers (map keys such as nvidia.com/gpu) go in brackets, as kubectl
    prints them, so the dots of the path stay unambiguous.
    """
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            text += f".{part}" if text else part
        else:
            text += f"[{part}]"
    return text or "<root>"


# -- metadata ------------------------------------------------------------------------------------


class ObjectMeta(ApiModel):
    """The part of metav1.ObjectMeta the operator reads; every other server field passes through.

    extra="allow" because the apiserver owns metadata (uid, resourceVersion, managedFields, …):
    rejecting or dropping them would break updates written back from a parsed object.
    """

    model_config = ConfigDict(extra="allow", strict=False)

    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    finalizers: list[str] | None = None


# -- conditions ----------------------------------------------------------------------------------

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """One aspect of the object's observed state, shaped like metav1.Condition."""

    type: ConditionTypeString
    """Type of the condition in CamelCase, e.g. Succeeded or Ready."""
    status: ConditionStatus
    """Status of the condition: True, False or Unknown."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The .metadata.generation the condition was set from."""
    last_transition_time: Timestamp
    """When the condition last changed status (RFC 3339)."""
    reason: ReasonString
    """CamelCase, machine-readable reason for the last transition."""
    message: str = Field(max_length=32768)
    """Human-readable details of the last transition; may be empty."""


def _unique_condition_types(conditions: list[Condition]) -> list[Condition]:
    # The CRD declares conditions a list-map keyed by type; the apiserver refuses duplicates.
    seen: set[str] = set()
    for condition in conditions:
        if condition.type in seen:
            raise ValueError(f"duplicate condition type {condition.type!r}")
        seen.add(condition.type)
    return conditions


#: status.conditions: at most one condition per type, merged by type in server-side apply.
Conditions = Annotated[
    list[Condition],
    AfterValidator(_unique_condition_types),
    Field(json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}),
]


def get_condition(conditions: Sequence[Condition] | None, type_: str) -> Condition | None:
    """The condition of that type, or None."""
    return next((c for c in conditions or () if c.type == type_), None)


def is_condition_true(conditions: Sequence[Condition] | None, type_: str) -> bool:
    """Whether the condition of that type exists with status True."""
    condition = get_condition(conditions, type_)
    return condition is not None and condition.status == "True"


def set_condition(
    conditions: Sequence[Condition] | None,
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    *,
    observed_generation: int | None = None,
    now: datetime | None = None,
) -> list[Condition]:
    """Return `conditions` with the condition of `type_` set, leaving the input untouched.

    Idempotent the way meta.SetStatusCondition is: lastTransitionTime moves only when the status
    changes, so re-running a reconcile with the same outcome yields an equal list (and no patch).
    """
    updated = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observed_generation=observed_generation,
        last_transition_time=units.format_timestamp(now or datetime.now(UTC)),
    )
    result = list(conditions or ())
    for index, existing in enumerate(result):
        if existing.type == type_:
            if existing.status == status:
                updated = updated.model_copy(update={"last_transition_time": existing.last_transition_time})
            result[index] = updated
            return result
    result.append(updated)
    return result


class Resource(ApiModel):
    """Fields every Elastune resource has; subclasses pin `kind` and add spec and status."""

    api_version: Literal["elastune.dev/v1alpha1"] = API_VERSION
    """APIVersion of the object: elastune.dev/v1alpha1."""
    kind: str
    """Kind of the object."""
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    """Standard object metadata."""

    def to_dict(self) -> dict[str, Any]:
        """The object as the apiserver would store it: camelCase keys, unset optional fields omitted."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
