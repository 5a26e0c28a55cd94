"""Redis users per role (issue 25 item 4): against a real redis-server started with the ACL file of
``elastune_contract.redis_acl``. The worker credential - the only one copied into WarmPool namespaces -
cannot FLUSHALL, CONFIG, ACL, nor write pool records, placements, assignments or demand; the gateway
only reads the registry and writes its traffic signals; the operator does the control plane's work but
no FLUSHALL; every role's real calls through ``Bus`` (username from ELASTUNE_REDIS_USERNAME) still work,
and so does a real worker process and gateway with their own users."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from elastune_common.bus import Bus
from elastune_contract.protocol import (
    Assignment,
    Event,
    PlacedAdapter,
    ServingPoolRecord,
    WorkerRecord,
    placement_key,
    pools_key,
)
from elastune_contract.redis_acl import DEFAULT_USERS, ROLES, Role, acl_file
from real_servers import start_redis, stop

NS = "elastune"
PASSWORDS: dict[Role, str] = {r: f"{r}-pw-{i}" for i, r in enumerate(ROLES)}


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("acl-redis")
    (tmp / "users.acl").write_text(acl_file(PASSWORDS, NS))
    server = start_redis(tmp, "--aclfile", str(tmp / "users.acl"))
    yield server
    stop(server.proc)


def raw(server: Any, role: Role) -> redis.Redis:
    return redis.Redis.from_url(server.url, username=DEFAULT_USERS[role], password=PASSWORDS[role])


def bus(server: Any, role: Role, monkeypatch: pytest.MonkeyPatch) -> Bus:
    """A Bus as the role's user, named the way pods name it: ELASTUNE_REDIS_USERNAME/PASSWORD."""
    monkeypatch.setenv("ELASTUNE_REDIS_USERNAME", DEFAULT_USERS[role])
    monkeypatch.setenv("ELASTUNE_REDIS_PASSWORD", PASSWORDS[role])
    return Bus(server.url, NS)


def refused(call: Any) -> None:
    with pytest.raises((redis.exceptions.NoPermissionError, redis.exceptions.ResponseError)) as info:
        call()
    assert "NOPERM" in str(info.value) or "permission" in str(info.value).lower(), info.value


def test_anonymous_and_default_user_get_nothing(acl_redis: Any) -> None:
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(acl_redis.url).set("x", "1")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(acl_redis.url, password=PASSWORDS["operator"]).ping()  # default user is off


def test_the_worker_credential_cannot_flush_configure_or_rewrite_the_control_plane(acl_redis: Any) -> None:
    op, w = raw(acl_redis, "operator"), raw(acl_redis, "worker")
    op.hset(pools_key(NS), "p", '{"pool": "p"}')
    op.hset(placement_key(NS, "w-2"), "a", "{}")
    refused(w.flushall)
    refused(w.flushdb)
    refused(lambda: w.config_get("*"))
    refused(lambda: w.config_set("requirepass", "x"))
    refused(lambda: w.acl_setuser("evil", enabled=True, passwords=["+x"], commands=["+@all"], keys=["*"]))
    refused(lambda: w.acl_list())
    refused(lambda: w.keys("*"))
    refused(lambda: w.hset(pools_key(NS), "p", '{"pool": "p", "url": "http://evil"}'))  # pool records
    refused(lambda: w.hdel(pools_key(NS), "p"))
    refused(lambda: w.hset(placement_key(NS, "w-2"), "a", "{}"))  # placements
    refused(lambda: w.rpush(f"{NS}:assign:w-2", "{}"))  # other workers' assignments
    refused(lambda: w.set(f"{NS}:demand:m", "{}"))
    refused(lambda: w.set("other:key", "1"))
    refused(lambda: w.eval("return redis.call('flushall')", 0))
    assert op.hget(pools_key(NS), "p") == b'{"pool": "p"}'
    assert op.hget(placement_key(NS, "w-2"), "a") == b"{}"


def test_the_gateway_reads_and_writes_only_its_traffic_signals(acl_redis: Any, monkeypatch) -> None:
    g = raw(acl_redis, "gateway")
    refused(g.flushall)
    refused(lambda: g.set(f"{NS}:worker:w-9", '{"id": "w-9", "url": "http://evil"}'))  # no registering
    refused(lambda: g.sadd(f"{NS}:workers", "w-9"))
    refused(lambda: g.hset(pools_key(NS), "p", "{}"))
    refused(lambda: g.rpush(f"{NS}:assign:w-1", "{}"))
    refused(lambda: g.hset(placement_key(NS, "w-1"), "a", "{}"))
    refused(lambda: g.xadd(f"{NS}:job:j:events", {"event": "{}"}))
    gw = bus(acl_redis, "gateway", monkeypatch)
    assert isinstance(gw.workers(), dict) and isinstance(gw.serving_pools(), dict)
    gw.count_requests({"m": 2})
    assert gw.popularity()["m"] >= 2


def test_each_role_does_its_part_of_the_protocol(acl_redis: Any, monkeypatch) -> None:
    op = bus(acl_redis, "operator", monkeypatch)
    worker = bus(acl_redis, "worker", monkeypatch)
    gateway = bus(acl_redis, "gateway", monkeypatch)
    # worker: registers and heartbeats
    worker.publish_worker(
        WorkerRecord(
            id="w-1", pool="p", model="m", state="ready", url="http://10.0.0.1:8080", started_at=time.time()
        )
    )
    assert set(op.workers()) == {"w-1"} and gateway.workers()["w-1"].url == "http://10.0.0.1:8080"
    # operator: places an adapter, assigns a job; worker reads and pops them
    op.set_placement("w-1", {"a": PlacedAdapter.model_validate({"url": "/mnt/a"})})
    assert set(worker.placement("w-1")) == {"a"}
    evil = {"a": PlacedAdapter.model_validate({"url": "s3://evil/a"})}
    refused(lambda: worker.set_placement("w-1", evil))
    assert op.placement("w-1")["a"].url == "/mnt/a"  # the whole transaction was refused
    refused(lambda: worker.publish_pool(ServingPoolRecord.model_validate(_pool_fields(op))))
    op.assign("w-1", Assignment.model_validate(_assignment_fields()))
    assert worker.pop_assignment("w-1", timeout=1) is not None
    # worker: events and cancel flags of its job
    worker.post(Event.model_validate(_event_fields()))
    assert len(op.events("j-1")) == 1
    assert worker.cancelled("j-1", 0) is False
    op.cancel("j-1", 0)
    assert worker.cancelled("j-1", 0) is True
    # gateway: demand for a pool at zero; operator reads it
    from elastune_contract.protocol import ServingDemand

    gateway.post_demand(ServingDemand.model_validate(_demand_fields()))
    assert op.demand("m") is not None
    # operator: pool records; the operator itself cannot flush either
    op.publish_pool(ServingPoolRecord.model_validate(_pool_fields(op)))
    assert "p" in gateway.serving_pools()
    refused(op.redis.flushall)
    # worker: leaves cleanly
    worker.forget_worker("w-1")
    assert op.workers() == {}


def test_same_named_pods_and_pools_of_two_namespaces_keep_their_own_records(
    acl_redis: Any, monkeypatch
) -> None:
    """Issue 25 item 1: pod names repeat across namespaces (Knative names them after the Service, i.e. the
    WarmPool), and so do WarmPool names. Each worker registers as ``<namespace>/<pod>``, so its record,
    placement and queue are its own; each pool record is the hash field ``<namespace>/<pool>``. The worker
    ACL user does all of it with the same rules."""
    from elastune_worker.server.agent import default_worker_id

    op = bus(acl_redis, "operator", monkeypatch)
    gateway = bus(acl_redis, "gateway", monkeypatch)
    worker = bus(acl_redis, "worker", monkeypatch)
    op.redis.delete(pools_key(NS))  # what the tests before left
    pod = "tiny-00001-deployment-abc12"
    ids = {}
    for ns, ip in (("team-a", "10.0.0.1"), ("team-b", "10.0.0.2")):
        monkeypatch.setenv("POD_NAME", pod)
        monkeypatch.setenv("POD_NAMESPACE", ns)
        ids[ns] = default_worker_id("tiny")
        worker.publish_worker(
            WorkerRecord(id=ids[ns], pool="tiny", model="m", state="ready", url=f"http://{ip}:8080",
                         started_at=time.time())
        )  # fmt: skip
    assert ids == {"team-a": f"team-a/{pod}", "team-b": f"team-b/{pod}"}
    got = gateway.workers()
    assert set(got) == set(ids.values())
    assert (
        got[ids["team-a"]].url == "http://10.0.0.1:8080" and got[ids["team-b"]].url == "http://10.0.0.2:8080"
    )
    op.set_placement(ids["team-a"], {"team-a/s": PlacedAdapter.model_validate({"url": "/mnt/a"})})
    op.set_placement(ids["team-b"], {"team-b/s": PlacedAdapter.model_validate({"url": "/mnt/b"})})
    assert set(worker.placement(ids["team-a"])) == {"team-a/s"}
    assert set(worker.placement(ids["team-b"])) == {"team-b/s"}
    for ns in ("team-a", "team-b"):
        op.publish_pool(ServingPoolRecord(pool="tiny", model=f"m-{ns}", namespace=ns))
    pools = gateway.serving_pools()
    assert {k: v.model for k, v in pools.items()} == {"team-a/tiny": "m-team-a", "team-b/tiny": "m-team-b"}
    op.forget_pool("tiny", "team-b")
    assert set(gateway.serving_pools()) == {"team-a/tiny"}
    worker.forget_worker(ids["team-b"])  # leaving touches only its own record and placement
    assert set(op.workers()) == {ids["team-a"]} and set(op.placement(ids["team-a"])) == {"team-a/s"}
    worker.forget_worker(ids["team-a"])
    op.forget_pool("tiny", "team-a")


def test_gradients_flow_through_the_channel_as_the_worker(acl_redis: Any, monkeypatch) -> None:
    import numpy as np

    from elastune_worker.comm.allreduce import grad_key
    from elastune_worker.comm.channel import RedisChannel

    monkeypatch.setenv("ELASTUNE_REDIS_USERNAME", DEFAULT_USERS["worker"])
    monkeypatch.setenv("ELASTUNE_REDIS_PASSWORD", PASSWORDS["worker"])
    ch = RedisChannel(acl_redis.url)
    key = grad_key("job-1", 0, 0, 1)
    ch.set_many({key: np.arange(4, dtype=np.float32).tobytes()}, 60)
    assert ch.get_many([key])[key] == np.arange(4, dtype=np.float32).tobytes()
    ch.delete([key])
    ch.close()


def _pool_fields(_: Bus) -> dict[str, Any]:
    return {"pool": "p", "model": "m"}


def _assignment_fields() -> dict[str, Any]:
    return {
        "job": "j-1", "attempt": 1, "rank": 0, "world": 1, "model": "m", "spec": {}, "dataset": "d",
        "comm_job": "j-1-a1", "checkpoint_dir": "/tmp/c", "artifact_dir": "/tmp/a",
    }  # fmt: skip


def _event_fields() -> dict[str, Any]:
    return {"type": "progress", "job": "j-1", "attempt": 1, "rank": 0, "worker": "w-1", "iterations": 1}


def _demand_fields() -> dict[str, Any]:
    return {"model": "m", "waiting": 1, "oldest_since": time.time(), "updated_at": time.time()}


def test_a_real_worker_and_gateway_serve_with_their_own_users(
    acl_redis: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker process as the worker user registers and serves; a gateway process as the gateway user
    routes a completion to it; the test reads the registry as the operator (the URL names that user)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("torch")
    from elastune_bench.processes import (
        start_gateway,
        start_worker,
        wait_for_endpoints,
        wait_for_worker,
    )
    from elastune_demo import build as B

    host = acl_redis.url.removeprefix("redis://")
    operator_url = f"redis://{DEFAULT_USERS['operator']}:{PASSWORDS['operator']}@{host}"
    procs = []
    try:
        with monkeypatch.context() as env:
            env.setenv("ELASTUNE_REDIS_USERNAME", DEFAULT_USERS["worker"])
            env.setenv("ELASTUNE_REDIS_PASSWORD", PASSWORDS["worker"])
            model = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
            w = start_worker(acl_redis.url, NS, "w-acl", model, "tiny", tmp_path, "--kv-cache-tokens", "2048",
                             "--max-model-len", "128", wait=False)  # fmt: skip
            procs.append(w)
        wait_for_worker(w, operator_url, NS)
        with monkeypatch.context() as env:
            env.setenv("ELASTUNE_REDIS_USERNAME", DEFAULT_USERS["gateway"])
            env.setenv("ELASTUNE_REDIS_PASSWORD", PASSWORDS["gateway"])
            g = start_gateway(acl_redis.url, NS, tmp_path)
            procs.append(g)
        wait_for_endpoints(g.url, 1)
        # ignore_eos: a sampled draw may end at EOS before 3 tokens (one run here got 2)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(g.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert w.alive(), w.log_tail()
        assert "NOPERM" not in w.log_tail(20000) and "NOPERM" not in g.log_tail(20000)
    finally:
        for p in procs:
            p.stop()


def test_the_api_key_map_is_read_by_the_gateway_only(acl_redis: Any, monkeypatch) -> None:
    """Issue 25 item 2: the operator publishes hashed keys with their scopes; the gateway reads the map and
    counts per-key limits with its own user; the worker credential can neither read nor write it."""
    import asyncio

    from elastune_contract.api_keys import KeySecret, api_keys_key, key_digest, key_map, publish
    from elastune_gateway.server.auth import KeyTable, RateLimiter
    from elastune_gateway.server.metrics import GatewayMetrics

    secret = KeySecret(namespace="team-a", name="k", key="sk-acl", models=None, requests_per_minute=2,
                       tokens_per_minute=None)  # fmt: skip
    publish(raw(acl_redis, "operator"), NS, key_map([secret], {"team-a": ["m"]}))
    w, g = raw(acl_redis, "worker"), raw(acl_redis, "gateway")
    refused(lambda: w.hgetall(api_keys_key(NS)))
    refused(lambda: w.hget(api_keys_key(NS), key_digest("sk-acl")))
    refused(lambda: w.hkeys(api_keys_key(NS)))
    refused(lambda: w.hset(api_keys_key(NS), "x", "{}"))
    refused(lambda: w.delete(api_keys_key(NS)))
    refused(lambda: w.incr(f"{NS}:ratelimit:x:requests:1"))
    refused(lambda: g.hset(api_keys_key(NS), "x", "{}"))  # the gateway reads it, never writes it
    refused(lambda: g.delete(api_keys_key(NS)))

    monkeypatch.setenv("ELASTUNE_REDIS_USERNAME", DEFAULT_USERS["gateway"])
    monkeypatch.setenv("ELASTUNE_REDIS_PASSWORD", PASSWORDS["gateway"])
    metrics = GatewayMetrics()
    table = KeyTable(Bus(acl_redis.url, NS).redis, NS, metrics)
    table.refresh()
    principal = table.authenticate("Bearer sk-acl")
    assert principal.record.models == ("m",) and principal.name == "team-a/k"

    async def admit_three() -> list[str]:
        limiter = RateLimiter(acl_redis.url, NS, metrics)
        out = []
        try:
            for _ in range(3):
                try:
                    quota, _ = await limiter.admit(principal)
                    out.append(quota.headers["x-ratelimit-remaining-requests"])
                except Exception as exc:  # the third: 429
                    out.append(str(getattr(exc, "status", exc)))
        finally:
            await limiter.close()
        return out

    if 60 - time.time() % 60 < 3:
        time.sleep(60 - time.time() % 60 + 0.2)
    assert asyncio.run(admit_three()) == ["1", "0", "429"]
    assert metrics.rate_limit_errors._value.get() == 0  # counted in Redis, not failed open
