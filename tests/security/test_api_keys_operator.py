"""API keys, the publishing side (issue 25 item 2): the operator's ApiKeyPublisher turns labelled Secrets
(as the API server sends them: ``data`` in base64) into the hashed key map in a real Redis, which the
gateway's KeyTable reads. Only SHA-256 digests reach Redis; a deleted Secret, one whose label was removed,
or one changed to another key stops working within seconds; a key's scope never reaches another
namespace's models; a Secret that cannot be a key gives no key. And ``elastune serve`` reads key Secrets
from its -f files (a removed file revokes its key within seconds; without any it says it serves on
loopback only, unauthenticated), never handing them to workers."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from elastune_common.bus import Bus
from elastune_contract.api_keys import MAP_META_FIELD, api_keys_key
from elastune_contract.openai_api.errors import APIError
from elastune_gateway.server.auth import KeyTable
from elastune_gateway.server.metrics import GatewayMetrics
from elastune_operator.api_keys import ApiKeyPublisher
from serve_process import ElastuneServe, write_manifests


def secret(ns: str, name: str, labelled: bool = True, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"namespace": ns, "name": name,
                     "labels": {"elastune.dev/api-key": "true"} if labelled else {}},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }  # fmt: skip


@pytest.fixture
def publisher(redis_server: Any) -> Iterator[tuple[ApiKeyPublisher, KeyTable, Bus]]:
    bus = Bus(redis_server.url, f"keys{time.time_ns()}")
    models = {"team-a": {"llama", "summarizer"}, "team-b": {"mistral"}}
    pub = ApiKeyPublisher(bus.redis, bus.ns, lambda: models, period_s=1.0, grace_s=0.0)
    table = KeyTable(bus.redis, bus.ns, GatewayMetrics())
    pub.start()
    yield pub, table, bus
    pub.stop()
    bus.close()


def status(table: KeyTable, key: str) -> int | tuple[str, ...]:
    table.refresh()
    try:
        return table.authenticate(f"Bearer {key}").record.models
    except APIError as exc:
        return exc.status


def eventually(fn: Any, want: Any, within: float = 5.0) -> float:
    t0 = time.monotonic()
    while (got := fn()) != want:
        assert time.monotonic() - t0 < within, f"still {got!r}, not {want!r}, after {within} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_secrets_become_hashed_scoped_keys_and_revocation_takes_seconds(publisher: Any) -> None:
    pub, table, bus = publisher
    pub.seen(secret("team-a", "all", key="sk-a-all"))
    pub.seen(secret("team-a", "one", key="sk-a-one", models="summarizer, mistral", requestsPerMinute="60"))
    pub.seen(secret("team-b", "b", key="sk-b", models="llama"))  # another namespace's model: none
    pub.seen(secret("team-a", "bad", key="sk-bad", tokensPerMinute="lots"))  # invalid: no key
    pub.seen(secret("team-a", "plain", labelled=False, key="sk-plain"))  # not labelled: no key
    eventually(lambda: status(table, "sk-a-all"), ("llama", "summarizer"))
    assert status(table, "sk-a-one") == ("summarizer",)
    assert (
        table.keys[next(d for d, r in table.keys.items() if r.secret == "team-a/one")].requests_per_minute
        == 60
    )
    assert status(table, "sk-b") == ()
    assert status(table, "sk-bad") == 401 and status(table, "sk-plain") == 401
    stored = bus.redis.hgetall(api_keys_key(bus.ns))
    assert len(stored) == 4 and json.loads(stored.pop(MAP_META_FIELD))["keys"] == 3  # 3 keys, and the meta
    assert not any("sk-" in k or "sk-" in v for k, v in stored.items())  # digests only, never a key

    pub.deleted("team-a/all")  # the Secret was deleted
    took = eventually(lambda: status(table, "sk-a-all"), 401)
    pub.seen(secret("team-a", "one", labelled=False, key="sk-a-one"))  # its label removed
    eventually(lambda: status(table, "sk-a-one"), 401)
    pub.seen(secret("team-b", "b", key="sk-b-rotated"))  # changed: the old key stops, the new one works
    eventually(lambda: status(table, "sk-b"), 401)
    assert status(table, "sk-b-rotated") == ("mistral",)
    assert took < 2.0


def test_the_map_is_reasserted_after_redis_lost_it(publisher: Any) -> None:
    pub, table, bus = publisher
    pub.seen(secret("team-a", "k", key="sk-k"))
    eventually(lambda: status(table, "sk-k"), ("llama", "summarizer"))
    bus.redis.delete(api_keys_key(bus.ns))  # FLUSHALL, a Redis restarted empty
    eventually(lambda: status(table, "sk-k"), ("llama", "summarizer"), within=3.0)


# -- elastune serve ---------------------------------------------------------------------------------
MODEL = "elastune/tiny-llama"


def _manifests(tmp: Path, keys: list[dict[str, Any]]) -> Path:
    pool = {
        "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
        "metadata": {"name": "tiny-llama", "namespace": "default"},
        "spec": {"model": MODEL, "maxWarmGPUs": 1, "idleWindow": "600s",
                 "serving": {"minReplicas": 0, "holdTimeout": "5s"}},
    }  # fmt: skip
    return write_manifests(tmp / "manifests", [pool, *keys])


def test_serve_reads_key_secrets_from_its_files_and_a_removed_one_stops_working(tmp_path: Path) -> None:
    folder = _manifests(tmp_path, [
        secret("default", "mine", key="sk-local-mine"),
        secret("default", "other", key="sk-local-other", models="not-served"),
    ])  # fmt: skip
    serve = ElastuneServe(folder, tmp_path / "state").wait_up()
    url = serve.url
    try:
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        mine = {"Authorization": "Bearer sk-local-mine"}
        other = {"Authorization": "Bearer sk-local-other"}
        assert [m["id"] for m in httpx.get(url + "/v1/models", headers=mine, timeout=10).json()["data"]] == [
            MODEL
        ]
        assert httpx.get(url + "/v1/models", headers=other, timeout=10).json()["data"] == []
        r = httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=other, timeout=10
        )
        assert r.status_code == 403, r.text
        assert not list((tmp_path / "state").rglob("key")) or all(
            "sk-local" not in p.read_text() for p in (tmp_path / "state").rglob("key") if p.is_file()
        )  # never written for workers
        (folder / "secret-mine.yaml").unlink()
        eventually(lambda: httpx.get(url + "/v1/models", headers=mine, timeout=10).status_code, 401, within=8)
        assert httpx.get(url + "/v1/models", headers=other, timeout=10).status_code == 200
    finally:
        out = serve.stop(timeout=20)
    assert "requests need Authorization: Bearer" in out


def test_serve_without_keys_says_it_serves_on_loopback_only(tmp_path: Path) -> None:
    serve = ElastuneServe(_manifests(tmp_path, []), tmp_path / "state").wait_up()
    url = serve.url
    try:
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
    finally:
        out = serve.stop(timeout=20)
    assert "authentication is off, so the gateway listens on loopback (127.0.0.1) only" in out, out
