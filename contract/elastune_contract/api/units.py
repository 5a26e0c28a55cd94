"""Durations, decimals and timestamps as they appear in Elastune resources.

Kubernetes API conventions keep floats out of specs, so fractional numbers travel as decimal strings
("0.46") and durations as strings ("10m"). Every pattern here is written for RE2 (the apiserver's
regexp engine): no lookaround and no backreferences, so the same text works in the CRD schemas.
"""

import re
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Final

# -- durations -----------------------------------------------------------------------------------

_NONZERO: Final = "0*[1-9][0-9]*"
_ANY: Final = "[0-9]+"
_ZERO: Final = "0+"

#: A positive duration of whole hours, minutes and seconds in that order ("90s", "10m", "1h30m").
#: RE2 has no lookahead, so "not zero" is spelled out by which component carries the non-zero digit:
#: the hours, else the minutes (hours zero or absent), else the seconds (hours and minutes zero or absent).
DURATION_PATTERN: Final = (
    f"^(?:{_NONZERO}h(?:{_ANY}m)?(?:{_ANY}s)?"
    f"|(?:{_ZERO}h)?{_NONZERO}m(?:{_ANY}s)?"
    f"|(?:{_ZERO}h)?(?:{_ZERO}m)?{_NONZERO}s)$"
)
_DURATION_RE: Final = re.compile(r"(?:(?P<h>[0-9]+)h)?(?:(?P<m>[0-9]+)m)?(?:(?P<s>[0-9]+)s)?")


def parse_duration(value: str) -> int:
    """Return the number of seconds in a positive duration such as "90s", "10m", "1h30m" or "2h".

    Raises ValueError naming the value for anything else, including zero and negative durations.
    """
    if not isinstance(value, str):
        raise ValueError(f"invalid duration {value!r}: must be a string such as 90s, 10m or 1h30m")
    match = _DURATION_RE.fullmatch(value)
    # The regex matches "" too (every component is optional), hence the explicit emptiness check.
    if match is None or not value:
        raise ValueError(
            f"invalid duration {value!r}: expected whole hours, minutes and seconds in that order, "
            "such as 90s, 10m or 1h30m"
        )
    seconds = int(match["h"] or 0) * 3600 + int(match["m"] or 0) * 60 + int(match["s"] or 0)
    if seconds <= 0:
        raise ValueError(f"invalid duration {value!r}: must be longer than zero")
    return seconds


def format_duration(seconds: int) -> str:
    """Format whole seconds as the shortest duration string: 5400 -> "1h30m", 90 -> "1m30s", 0 -> "0s".

    "0s" is for display only; parse_duration rejects it because every duration in a spec must be positive.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
        raise ValueError(f"invalid number of seconds {seconds!r}: must be a non-negative integer")
    if seconds == 0:
        return "0s"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(hours, "h"), (minutes, "m"), (secs, "s")]
    return "".join(f"{amount}{unit}" for amount, unit in parts if amount)


# -- decimals ------------------------------------------------------------------------------------

#: Fixed-point decimal, optionally negative. No exponent: "3e-4" is written "0.0003".
DECIMAL_PATTERN: Final = r"^-?[0-9]+(?:\.[0-9]+)?$"
NON_NEGATIVE_DECIMAL_PATTERN: Final = r"^[0-9]+(?:\.[0-9]+)?$"
#: Greater than zero: a non-zero digit before the point, or any integer part and a non-zero fraction.
POSITIVE_DECIMAL_PATTERN: Final = r"^(?:[0-9]*[1-9][0-9]*(?:\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)$"
#: In [0, 1]: zero with any fraction, or one with an all-zero fraction.
UNIT_INTERVAL_DECIMAL_PATTERN: Final = r"^(?:0+(?:\.[0-9]+)?|0*1(?:\.0+)?)$"

_DECIMAL_RE: Final = re.compile(DECIMAL_PATTERN.removeprefix("^").removesuffix("$"))


def parse_decimal(value: str) -> Decimal:
    """Parse a fixed-point decimal string such as "0.46" or "-2" into an exact Decimal.

    Rejects floats (their binary rounding is why specs carry strings), exponents, NaN and infinities.
    """
    if not isinstance(value, str):
        raise ValueError(f'invalid decimal {value!r}: must be a string such as "0.46"')
    if _DECIMAL_RE.fullmatch(value) is None:
        raise ValueError(f"invalid decimal {value!r}: expected a fixed-point number such as 0.46 or 12")
    try:
        return Decimal(value)
    except InvalidOperation as exc:  # unreachable after the regex; kept so a pattern slip fails loudly
        raise ValueError(f"invalid decimal {value!r}") from exc


def format_decimal(value: Decimal | int | float, places: int | None = None) -> str:
    """Format a number as a fixed-point decimal string for status fields ("0.457", "12").

    `places` rounds half-even to that many fractional digits; trailing zeros are dropped either way.
    """
    number = value if isinstance(value, Decimal) else Decimal(str(value))
    if not number.is_finite():
        raise ValueError(f"cannot format {value!r} as a decimal string")
    if places is not None:
        number = number.quantize(Decimal(1).scaleb(-places))
    text = format(number, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


# -- timestamps ----------------------------------------------------------------------------------

#: RFC 3339 date-time, the wire format of metav1.Time.
TIMESTAMP_PATTERN: Final = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:[Zz]|[+-][0-9]{2}:[0-9]{2})$"
)
_TIMESTAMP_RE: Final = re.compile(TIMESTAMP_PATTERN.removeprefix("^").removesuffix("$"))


def parse_timestamp(value: str) -> datetime:
    """Parse an RFC 3339 timestamp ("2025-01-02T03:04:05Z") into a timezone-aware datetime."""
    if not isinstance(value, str) or _TIMESTAMP_RE.fullmatch(value) is None:
        raise ValueError(f"invalid timestamp {value!r}: expected RFC 3339 such as 2025-01-02T03:04:05Z")
    try:
        return datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError as exc:  # e.g. month 13
        raise ValueError(f"invalid timestamp {value!r}: {exc}") from exc


def format_timestamp(moment: datetime) -> str:
    """Format a datetime the way metav1.Time serialises: UTC, whole seconds, "Z" suffix."""
    if moment.tzinfo is None:
        raise ValueError(f"timestamp {moment!r} has no timezone; pass an aware datetime")
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_timestamp() -> str:
    """The current time as an RFC 3339 string (whole seconds, UTC)."""
    return format_timestamp(datetime.now(UTC))


#: Human wording of each pattern, so schema errors read "must be a positive duration…", not a regex.
PATTERN_DESCRIPTIONS: Final = {
    DURATION_PATTERN: "must be a positive duration of whole hours, minutes and seconds such as 90s, 10m "
    "or 1h30m",
    DECIMAL_PATTERN: 'must be a fixed-point decimal string such as "0.46"',
    NON_NEGATIVE_DECIMAL_PATTERN: 'must be a non-negative decimal string such as "0.46"',
    POSITIVE_DECIMAL_PATTERN: 'must be a decimal string greater than zero such as "0.3"',
    UNIT_INTERVAL_DECIMAL_PATTERN: 'must be a decimal string between 0 and 1 such as "0.8"',
    TIMESTAMP_PATTERN: "must be an RFC 3339 timestamp such as 2025-01-02T03:04:05Z",
}
