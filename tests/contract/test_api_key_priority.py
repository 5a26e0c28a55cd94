"""A key Secret's ``allowPriority`` (issue 25: a client-set ``priority`` is honoured only for keys allowed
to set it): read from the Secret, carried in the published record (hash-only), and absent from the
record of a key without it, so a gateway that predates the field still reads those keys."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from elastune_contract.api_keys import (
    ApiKeyRecord,
    InvalidApiKeySecret,
    _record_json,
    key_map,
    parse_map,
    read_secret,
)


def secret(name: str, **data: str) -> dict[str, Any]:
    return {
        "kind": "Secret",
        "metadata": {"namespace": "team-a", "name": name, "labels": {"elastune.dev/api-key": "true"}},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


@pytest.mark.parametrize(("raw", "want"), [(None, False), ("true", True), ("True", True), ("false", False)])
def test_allow_priority_is_read_from_the_secret(raw: str | None, want: bool) -> None:
    data = {"key": "sk-1"} | ({"allowPriority": raw} if raw is not None else {})
    assert read_secret(secret("k", **data)).allow_priority is want


def test_allow_priority_that_is_not_a_boolean_makes_no_key() -> None:
    with pytest.raises(InvalidApiKeySecret, match="allowPriority"):
        read_secret(secret("k", key="sk-1", allowPriority="yes please"))


def test_the_published_record_carries_it_only_when_set_and_never_the_key() -> None:
    secrets = [
        read_secret(secret("plain", key="sk-plain")),
        read_secret(secret("vip", key="sk-vip", allowPriority="true")),
    ]
    records = key_map(secrets, {"team-a": ["llama"]})
    published = {d: _record_json(r) for d, r in records.items()}
    assert not any("sk-" in d or "sk-" in v for d, v in published.items())
    by_secret = {json.loads(v)["secret"]: json.loads(v) for v in published.values()}
    assert "allow_priority" not in by_secret["team-a/plain"]  # what a gateway older than the field reads
    assert by_secret["team-a/vip"]["allow_priority"] is True
    parsed, bad = parse_map(published)
    assert bad == 0 and parsed == records
    # An older record (no such field) is a key without it.
    old = ApiKeyRecord(secret="team-a/old", models=("llama",)).model_dump_json(exclude={"allow_priority"})
    assert parse_map({"d": old})[0]["d"].allow_priority is False
