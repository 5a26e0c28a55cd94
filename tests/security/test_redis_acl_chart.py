"""The chart's bundled Redis runs the per-role ACL users (issue 25 item 4): the script the chart renders
for the Redis container, run here against the real redis-server with the passwords of the Secrets the
chart renders, gives the worker credential - the one the operator copies into WarmPool namespaces - no
FLUSHALL and no pool-record write, the operator and gateway their own users, and no default user; the
rules in the chart are ``elastune_contract.redis_acl``'s; the readiness probe pings as the gateway."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from chart_render import RELEASE, named, render
from elastune_common.bus import Bus
from elastune_common.servers import free_port
from elastune_contract.protocol import ServingPoolRecord, pools_key
from elastune_contract.redis_acl import acl_rules
from elastune_operator.k8s.settings import OperatorSettings
from elastune_operator.k8s.workload import worker_deployment

REPO = Path(__file__).resolve().parents[2]


def container(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    return named(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def secret(docs: tuple[dict[str, Any], ...], name: str, key: str = "password") -> str:
    return base64.b64decode(named(docs, "Secret", name)["data"][key]).decode()


def test_the_chart_s_rules_file_is_generated_from_the_contract() -> None:
    """helm/elastune/files/redis-acl-rules.yaml is tools/redis_acl_chart.py's output, not a hand copy."""
    assert subprocess.call([sys.executable, str(REPO / "tools" / "redis_acl_chart.py"), "--check"]) == 0, (
        "run python tools/redis_acl_chart.py"
    )


def test_the_chart_s_rules_are_the_contract_s() -> None:
    script = container(render(), f"{RELEASE}-redis")["args"][0]
    for role in ("operator", "gateway", "worker"):
        assert f"user elastune-{role} on #$(h " in script
        assert acl_rules(role) in script, role
    assert "user default off" in script
    # Without ACLs: the one password, as before.
    plain = container(render("redis.bundled.acl.enabled=false"), f"{RELEASE}-redis")["args"][0]
    assert "requirepass" in plain and "aclfile" not in plain


@pytest.fixture(scope="module")
def chart_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    yield from _chart_redis(tmp_path_factory.mktemp("chart-redis"))


def _chart_redis(tmp: Path, *sets: str) -> Iterator[dict[str, Any]]:
    """The chart's Redis container script (rendered with ``sets``), run here as a process."""
    docs = render(*sets)
    redis_container = container(docs, f"{RELEASE}-redis")
    port = free_port()
    script = redis_container["args"][0].replace("/tmp/", f"{tmp}/").replace("--port 6379", f"--port {port}")
    script = script.replace("--dir /data", f"--dir {tmp}")
    passwords = {
        "operator": secret(docs, f"{RELEASE}-redis"),
        "gateway": secret(docs, f"{RELEASE}-redis-gateway"),
        "worker": secret(docs, f"{RELEASE}-redis-worker"),
    }
    env = {
        "PATH": os.environ["PATH"],
        "OPERATOR_PASSWORD": passwords["operator"],
        "WORKER_PASSWORD": passwords["worker"],
        "REDISCLI_AUTH": passwords["gateway"],
    }
    with (tmp / "redis.log").open("wb") as log:
        proc = subprocess.Popen(["/bin/sh", "-c", script], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.time() + 20
        while True:
            assert proc.poll() is None, (tmp / "redis.log").read_text()
            try:
                redis.Redis.from_url(url, username="elastune-gateway", password=passwords["gateway"]).ping()
                break
            except redis.ConnectionError:
                assert time.time() < deadline, (tmp / "redis.log").read_text()
                time.sleep(0.1)
        yield {"docs": docs, "url": url, "port": port, "passwords": passwords, "env": env, "tmp": tmp}
    finally:
        proc.kill()
        proc.wait()


def test_the_worker_secret_cannot_flush_nor_rewrite_pool_records(chart_redis: dict[str, Any]) -> None:
    url, pw = chart_redis["url"], chart_redis["passwords"]
    worker = redis.Redis.from_url(url, username="elastune-worker", password=pw["worker"])
    for call in (
        worker.flushall,
        lambda: worker.config_get("*"),
        lambda: worker.hset(pools_key("elastune"), "p", "{}"),
        lambda: worker.acl_setuser("x", enabled=True),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    # The pre-ACL way in - the one password as the default user - is gone.
    for password in pw.values():
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(url, password=password).ping()
    op = redis.Redis.from_url(url, username="elastune-operator", password=pw["operator"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        op.flushall()
    # The passwords are not on disk in the clear, nor left in the server's environment.
    acl = (chart_redis["tmp"] / "users.acl").read_text()
    assert not any(p in acl for p in pw.values())


def test_the_rendered_components_use_their_own_users(
    chart_redis: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    docs, url, pw = chart_redis["docs"], chart_redis["url"], chart_redis["passwords"]
    op_env = {e["name"]: e for e in container(docs, f"{RELEASE}-operator")["env"]}
    gw_env = {e["name"]: e for e in container(docs, f"{RELEASE}-gateway")["env"]}
    # The operator: its own user; the workers get the worker Secret (the one copied into pool namespaces).
    assert op_env["ELASTUNE_REDIS_USERNAME"]["value"] == "elastune-operator"
    assert op_env["ELASTUNE_REDIS_SECRET"]["value"] == f"{RELEASE}-redis-worker"
    ref = op_env["ELASTUNE_REDIS_WORKER_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{RELEASE}-redis-worker", "key": "password"}
    settings = OperatorSettings.from_env({k: e["value"] for k, e in op_env.items() if "value" in e})
    assert settings.redis_worker_username == "elastune-worker"
    # The Knative Service the operator writes names that user and that Secret.
    from test_worker_isolation import pool_doc

    from elastune_contract.api.resources import parse_resource

    svc = worker_deployment(
        parse_resource(pool_doc()), 1, settings.redis_url, settings.redis_secret, settings.redis_secret_key,
        redis_username=settings.redis_worker_username,
    )  # fmt: skip
    w_env = {e["name"]: e for e in svc["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert w_env["ELASTUNE_REDIS_USERNAME"]["value"] == "elastune-worker"
    assert w_env["ELASTUNE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-redis-worker"
    # Each as a Bus the way its pod names it: the operator publishes a pool, the gateway reads it.
    monkeypatch.setenv("ELASTUNE_REDIS_USERNAME", op_env["ELASTUNE_REDIS_USERNAME"]["value"])
    monkeypatch.setenv("ELASTUNE_REDIS_PASSWORD", pw["operator"])
    Bus(url).publish_pool(ServingPoolRecord(pool="p", model="m"))
    monkeypatch.setenv("ELASTUNE_REDIS_USERNAME", gw_env["ELASTUNE_REDIS_USERNAME"]["value"])
    monkeypatch.setenv("ELASTUNE_REDIS_PASSWORD", pw["gateway"])
    assert set(Bus(url).serving_pools()) == {"p"}
    # The readiness probe, as rendered.
    probe = container(docs, f"{RELEASE}-redis")["readinessProbe"]["exec"]["command"]
    probe = [part.replace("-p 6379", f"-p {chart_redis['port']}") for part in probe]
    env = {"PATH": os.environ["PATH"], "REDISCLI_AUTH": pw["gateway"]}
    assert subprocess.run(probe, env=env, check=False, timeout=10).returncode == 0
    env["REDISCLI_AUTH"] = "wrong"
    assert subprocess.run(probe, env=env, check=False, timeout=10, capture_output=True).returncode != 0


@pytest.fixture(scope="module")
def bounded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    sets = ("redis.bundled.maxmemory=6mb", "redis.bundled.maxValueSize=1mb")
    yield from _chart_redis(tmp_path_factory.mktemp("bounded-redis"), *sets)


def test_the_bundled_redis_is_bounded_and_evicts_nothing(bounded_redis: dict[str, Any]) -> None:
    """Issue 39 item 7: the bundled Redis had no maxmemory, so one pool's image could fill it and take
    every tenant down with it. Now no value exceeds redis.bundled.maxValueSize, a full Redis refuses
    writes (OOM) rather than evict what the control plane cannot re-assert, and the operator's chart user
    creates a pool's own user (ACL SETUSER) that these bounds hold for."""
    from elastune_operator.k8s.redis_users import pool_acl_rules

    url, pw = bounded_redis["url"], bounded_redis["passwords"]
    op = redis.Redis.from_url(url, username="elastune-operator", password=pw["operator"])
    user = "elastune:pool:team-a/tiny"
    op.execute_command("ACL", "SETUSER", user, "reset", "on", ">pool-pw",
                       *pool_acl_rules("elastune", "team-a", "tiny", ["team-a"]).split())  # fmt: skip
    pod = redis.Redis.from_url(url, username=user, password="pool-pw")
    op.xadd("elastune:job:team-a/j:events", {"event": "{}"})  # a job's result: never evicted
    with pytest.raises(redis.exceptions.ConnectionError):  # the server closes a connection that tries
        pod.set("elastune:worker:team-a/tiny-a-1", b"x" * (2 << 20))
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        for i in range(64):  # 64 x 512 KiB = 32 MiB, more than the 6 MiB bound
            pod.set(f"elastune:worker:team-a/tiny-a-{i}", b"x" * (512 << 10))
    assert op.xlen("elastune:job:team-a/j:events") == 1
    assert op.exists("elastune:worker:team-a/tiny-a-0") == 1  # nothing evicted, not even its own
    op.delete(*[f"elastune:worker:team-a/tiny-a-{i}" for i in range(64)])  # what the budget check does
    assert op.xadd("elastune:job:team-a/j:events", {"event": "{}"})
