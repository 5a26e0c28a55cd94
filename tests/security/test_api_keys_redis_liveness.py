"""Authentication does not follow Redis's liveness (issue 38 item 2), against a real redis-server:

- after a FLUSHALL (or a Redis restarted empty) valid keys keep working: no published map is not an
  empty one, so nothing is revoked until the operator re-publishes (before: a non-retryable 401 for
  every key until the next publish);
- with Redis unreachable, the last confirmed map stays in force only for the staleness bound; past it
  every request gets 503 with Retry-After (before: the last map held forever, so a key removed during
  the outage kept working: fail-open);
- a published empty map (every key revoked) is a 401, as it must be.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastune_common.bus import Bus
from elastune_contract.api_keys import KeySecret, key_map, publish
from elastune_contract.openai_api.errors import APIError
from elastune_gateway.server.auth import KeyTable
from elastune_gateway.server.metrics import GatewayMetrics
from real_servers import start_redis, stop

KEY = "sk-team-a-valid"
STALE_S = 1.0


def outcome(table: KeyTable, key: str = KEY) -> int:
    table.refresh()
    try:
        table.authenticate(f"Bearer {key}")
    except APIError as exc:
        return exc.status
    return 200


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Any]:
    server = start_redis(tmp_path / "redis")
    yield server
    stop(server.proc)


def _publish(bus: Bus, *keys: str) -> None:
    secrets = [
        KeySecret(
            namespace="team-a",
            name=f"k{i}",
            key=k,
            models=None,
            requests_per_minute=None,
            tokens_per_minute=None,
        )
        for i, k in enumerate(keys)
    ]
    publish(bus.redis, bus.ns, key_map(secrets, {"team-a": ["llama"]}))


def test_a_flushall_revokes_no_valid_key(own_redis: Any) -> None:
    bus = Bus(own_redis.url, "auth")
    table = KeyTable(bus.redis, bus.ns, GatewayMetrics(), stale_s=STALE_S)
    _publish(bus, KEY)
    assert outcome(table) == 200
    bus.redis.flushall()
    assert outcome(table) == 200, "a valid key was refused after FLUSHALL"
    assert outcome(table, "sk-never-issued") == 401
    _publish(bus)  # the operator publishes again: an empty map, every key revoked
    assert outcome(table) == 401
    bus.close()


def test_with_redis_down_a_removed_key_is_refused_within_the_bound(own_redis: Any) -> None:
    bus = Bus(own_redis.url, "auth")
    table = KeyTable(bus.redis, bus.ns, GatewayMetrics(), stale_s=STALE_S, retry_after_s=3)
    _publish(bus, KEY)
    assert outcome(table) == 200
    stop(own_redis.proc)  # Redis down: the key's Secret may be deleted meanwhile, unseen
    assert outcome(table) == 200, "within the bound the last confirmed map serves"
    time.sleep(STALE_S + 0.2)
    table.refresh()
    with pytest.raises(APIError) as info:
        table.authenticate(f"Bearer {KEY}")
    assert info.value.status == 503 and info.value.headers == {"Retry-After": "3"}
    assert "cannot be confirmed" in str(info.value)
    bus.close()


def test_before_any_map_is_confirmed_requests_are_told_to_retry(own_redis: Any) -> None:
    bus = Bus(own_redis.url, "auth-empty")
    table = KeyTable(bus.redis, bus.ns, GatewayMetrics(), stale_s=STALE_S)
    assert outcome(table) == 503  # no publisher yet: not a 401 for a key that may be valid
    _publish(bus, KEY)
    assert outcome(table) == 200
    bus.close()
