"""Each WarmPool its own Redis user (issue 39 item 2): the operator's runtime against the Kubernetes API
emulator over HTTP and a real redis-server with the contract's ACL users. The test reads the credential
exactly as a pool's pod gets it - the env of the Deployment the operator writes, resolved from the Secrets
in the API - and uses it through the worker's own clients (``Bus``, ``RedisChannel``).

Before: every pool's pods got the one worker password (copied into each namespace), which reads and
writes every other pool's placements, queues, events and gradients. Now a pool's user reaches only its own
keys, a rotation keeps a running worker working until its pod restarts, a deleted pool's user goes,
and a Redis that restarts empty gets every pool's user back with the passwords its pods hold."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kubernetes import client, config

from elastune_common.bus import Bus
from elastune_common.servers import start_redis as start_redis_on
from elastune_contract.api.constants import GROUP, LABEL_WARM_POOL, PLURAL_WARM_POOLS, VERSION
from elastune_contract.protocol import (
    Assignment,
    Event,
    PlacedAdapter,
    WorkerRecord,
    assign_key,
    events_key,
    placement_key,
    worker_key,
)
from elastune_contract.redis_acl import DEFAULT_USERS, ROLES, Role, acl_file
from elastune_operator.k8s import redis_budget, redis_users
from elastune_operator.k8s.runtime import Runtime
from elastune_operator.k8s.settings import WORKER_PASSWORD_ENV, OperatorSettings
from elastune_testing.emulator import start_emulator
from operator_site import wait_for
from real_servers import start_redis, stop

NS = "elastune"
PASSWORDS: dict[Role, str] = {r: f"{r}-pw-{i}" for i, r in enumerate(ROLES)}
POOL = "tiny"
BUDGET = 2 << 20
"""Bytes each pool's workers may hold in Redis (ELASTUNE_REDIS_POOL_BUDGET), small for the test."""
POD_A, POD_B = "tiny-5d8f7c9b6-x2k4p", "tiny-7c9b6d8f5-q8z2m"  # pods of the pools' Deployments


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("pool-users")
    (tmp / "users.acl").write_text(acl_file(PASSWORDS, NS))
    server = start_redis(tmp, "--aclfile", str(tmp / "users.acl"))
    emulator = start_emulator(tmp / "emulator")
    api = config.new_client_from_config(config_file=str(emulator.kubeconfig_path))
    with pytest.MonkeyPatch.context() as env:
        # The operator pod's env, as the chart renders it (templates/deployment.yaml).
        env.setenv("ELASTUNE_REDIS_USERNAME", DEFAULT_USERS["operator"])
        env.setenv("ELASTUNE_REDIS_PASSWORD", PASSWORDS["operator"])
        env.setenv(WORKER_PASSWORD_ENV, PASSWORDS["worker"])
        settings = OperatorSettings(
            redis_url=server.url, redis_secret="elastune-redis-worker",
            redis_worker_username=DEFAULT_USERS["worker"], work_dir=tmp / "pod-tmp", metrics_port=0,
            namespace=NS, redis_pool_budget_bytes=BUDGET,
        )  # fmt: skip
        # Old passwords are checked against the pool's pods every round, not every 5 s (test time).
        env.setattr(redis_users, "POD_CHECK_S", 0.0)
        env.setattr(redis_budget, "CHECK_S", 0.5)  # and the pools' Redis budgets twice a second
        op = Bus(server.url, NS)
        runtime = Runtime(settings, api, bus=op)
        runtime.start()
        yield from _pools(server, emulator, api, op, runtime, tmp)


def _pools(
    server: Any, emulator: Any, api: Any, op: Bus, runtime: Runtime, tmp: Path
) -> Iterator[dict[str, Any]]:
    custom = client.CustomObjectsApi(api)
    bodies = {}
    for ns in ("team-a", "team-b"):
        meta = {"name": POOL, "namespace": ns}
        spec = {"model": "test/model", "maxWarmGPUs": 2}
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WarmPool", "metadata": meta, "spec": spec}
        bodies[ns] = custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL_WARM_POOLS, body)
        runtime.upsert_pool(bodies[ns])
    # "server": the one a test restarts (test_a_redis_that_restarts_empty...), stopped at the end.
    site = {"server": server, "tmp": tmp, "url": server.url, "api": api, "op": op, "runtime": runtime,
            "bodies": bodies, "custom": custom}  # fmt: skip
    try:
        yield site
    finally:
        runtime.stop()
        emulator.stop()
        stop(site["server"].proc)


def pod_credentials(api: client.ApiClient, ns: str, deployment: str = POOL) -> dict[str, str]:
    """ELASTUNE_REDIS_USERNAME/PASSWORD as the kubelet resolves them for the Deployment's pods."""
    dep = client.AppsV1Api(api).read_namespaced_deployment(deployment, ns, _preload_content=False)
    env = json.loads(dep.data)["spec"]["template"]["spec"]["containers"][0]["env"]
    core = client.CoreV1Api(api)
    out = {}
    for e in env:
        if e["name"] not in ("ELASTUNE_REDIS_USERNAME", "ELASTUNE_REDIS_PASSWORD"):
            continue
        if "value" in e:
            out[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            secret = core.read_namespaced_secret(ref["name"], ns, _preload_content=False)
            out[e["name"]] = base64.b64decode(json.loads(secret.data)["data"][ref["key"]]).decode()
    return out


def as_pod(url: str, creds: dict[str, str]) -> redis.Redis:
    return redis.Redis.from_url(
        url, username=creds.get("ELASTUNE_REDIS_USERNAME"), password=creds["ELASTUNE_REDIS_PASSWORD"]
    )


def refused(call: Any) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        call()


def test_a_pool_s_credential_cannot_reach_another_pool_s_keys(site: dict[str, Any]) -> None:
    url, op = site["url"], site["op"]
    a, b = pod_credentials(site["api"], "team-a"), pod_credentials(site["api"], "team-b")
    assert a["ELASTUNE_REDIS_PASSWORD"] != b["ELASTUNE_REDIS_PASSWORD"]
    wid_b = f"team-b/{POD_B}"
    op.set_placement(wid_b, {"team-b/s": PlacedAdapter.model_validate({"url": "s3://team-b/adapter"})})
    pod_a = as_pod(url, a)
    refused(lambda: pod_a.hgetall(placement_key(NS, wid_b)))  # what team-b's pod will load
    refused(lambda: pod_a.set(worker_key(NS, wid_b), '{"id": "x"}'))
    refused(lambda: pod_a.blpop([assign_key(NS, wid_b)], timeout=1))  # team-b's jobs
    refused(lambda: pod_a.delete(placement_key(NS, wid_b)))
    refused(lambda: pod_a.xadd(events_key(NS, "team-b/job"), {"event": "{}"}))
    refused(lambda: pod_a.set("elastune:team-b.job.uid.a1:0:grad:0:0", b"x"))
    refused(lambda: pod_a.get("elastune:team-b.job.uid.a1:0:merged:0"))
    refused(lambda: pod_a.srem(f"{NS}:workers", wid_b))  # dropping other pools' workers
    # Nothing dangerous either.
    refused(pod_a.flushall)
    refused(pod_a.flushdb)
    refused(lambda: pod_a.config_get("*"))
    refused(lambda: pod_a.keys("*"))
    refused(lambda: pod_a.scan(0))
    refused(lambda: pod_a.acl_list())
    refused(lambda: pod_a.acl_setuser("evil", enabled=True, passwords=["+x"], commands=["+@all"], keys=["*"]))
    refused(lambda: pod_a.eval("return 1", 0))
    assert op.placement(wid_b)["team-b/s"].url == "s3://team-b/adapter"


def test_a_pool_s_credential_does_its_worker_s_part_of_the_protocol(
    site: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastune_worker.comm.allreduce import grad_key
    from elastune_worker.comm.channel import RedisChannel

    url, op = site["url"], site["op"]
    creds = pod_credentials(site["api"], "team-a")
    for var, value in creds.items():
        monkeypatch.setenv(var, value)
    worker = Bus(url, NS)  # as the worker process builds it, from the env
    wid = f"team-a/{POD_A}"
    now = time.time()
    worker.publish_worker(
        WorkerRecord(id=wid, pool=POOL, model="test/model", state="ready", url="http://10.0.0.1:8080",
                     started_at=now)
    )  # fmt: skip
    assert wid in op.redis.smembers(f"{NS}:workers")
    op.set_placement(wid, {"team-a/s": PlacedAdapter.model_validate({"url": "/mnt/a"})})
    assert set(worker.placement(wid)) == {"team-a/s"}
    fields = {
        "job": "team-a/j", "attempt": 1, "rank": 0, "world": 1, "model": "test/model", "spec": {},
        "dataset": "d", "comm_job": "team-a.j.uid.a1", "checkpoint_dir": "/c", "artifact_dir": "/a",
    }  # fmt: skip
    op.assign(wid, Assignment.model_validate(fields))
    got = worker.pop_assignment(wid, timeout=1)
    assert got is not None and got.job == "team-a/j"
    worker.post(Event.model_validate({"type": "progress", "job": "team-a/j", "attempt": 1, "rank": 0,
                                      "worker": wid, "iterations": 1}))  # fmt: skip
    assert len(op.events("team-a/j")) == 1
    assert worker.cancelled("team-a/j", 1) is False
    channel = RedisChannel(url)  # the gradients of its job, with the same env credential
    key = grad_key("team-a.j.uid.a1", 0, 0, 0)
    channel.set_many({key: b"\x00" * 16}, 60)
    assert channel.get_many([key])[key] == b"\x00" * 16
    channel.delete([key])
    channel.close()
    worker.leave(wid)
    assert wid not in op.workers() and not op.redis.exists(worker_key(NS, wid))


def test_rotation_keeps_a_running_worker_working_until_its_pod_restarts(site: dict[str, Any]) -> None:
    url, api, runtime, custom = site["url"], site["api"], site["runtime"], site["custom"]
    core = client.CoreV1Api(api)
    labels = {LABEL_WARM_POOL: POOL}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD_A, "labels": labels},
           "spec": {"containers": [{"name": "worker", "image": "w"}]}}  # fmt: skip
    core.create_namespaced_pod("team-a", pod)  # started with the first password
    old = pod_credentials(api, "team-a")
    running = as_pod(url, old)
    assert running.set(worker_key(NS, f"team-a/{POD_A}"), "{}", ex=30)
    # Asked for (kopf calls upsert_pool when the annotation changes).
    patch = {"metadata": {"annotations": {"rotate.elastune.dev/redis-password": "1"}}}
    body = custom.patch_namespaced_custom_object(GROUP, VERSION, "team-a", PLURAL_WARM_POOLS, POOL, patch)
    runtime.upsert_pool(body)
    rotated_at = time.time()
    new = pod_credentials(api, "team-a")
    assert new["ELASTUNE_REDIS_PASSWORD"] != old["ELASTUNE_REDIS_PASSWORD"]
    assert new["ELASTUNE_REDIS_USERNAME"] == old["ELASTUNE_REDIS_USERNAME"]
    # The running worker's connection goes on, and so does a reconnect with its password (same pod).
    running.set(worker_key(NS, f"team-a/{POD_A}"), "{}", ex=30)
    assert as_pod(url, old).ping() and as_pod(url, new).ping()
    time.sleep(2.5)  # two of the operator's 1 s rounds, each checking the pods: the old one is listed
    assert as_pod(url, old).ping()
    # The pod restarts: a new one (created after the rotation) reads the Secret's new password.
    core.delete_namespaced_pod(POD_A, "team-a")
    while time.time() < math.ceil(rotated_at):  # creationTimestamp has whole seconds
        time.sleep(0.05)
    core.create_namespaced_pod("team-a", {**pod, "metadata": {"name": POD_A + "b", "labels": labels}})

    def old_refused() -> bool:
        try:
            as_pod(url, old).ping()
        except redis.exceptions.AuthenticationError:
            return True
        return False

    wait_for("the old password to be removed", old_refused, timeout=15)
    assert as_pod(url, new).ping()


def test_a_pool_filling_redis_is_cut_off_at_its_own_keys_and_the_others_keep_working(
    site: dict[str, Any],
) -> None:
    """Issue 39 item 7: the worker user could SET any size under its keys. Over its budget, a pool's user
    loses its write rights (its open connection too), its largest keys go, its WarmPool says why, and
    another pool's workers go on; a new password asked for gives the rights back."""
    url, api, op, runtime, custom = site["url"], site["api"], site["op"], site["runtime"], site["custom"]
    flooder = as_pod(url, pod_credentials(api, "team-a"))
    other = as_pod(url, pod_credentials(api, "team-b"))
    for i in range(3):  # 3 MiB: more than the 2 MiB budget
        flooder.set(worker_key(NS, f"team-a/{POOL}-flood-{i}"), b"x" * (1 << 20))

    def cut_off() -> bool:
        try:
            flooder.set(worker_key(NS, f"team-a/{POOL}-flood-x"), b"x")
        except redis.exceptions.NoPermissionError:
            return True
        return False

    wait_for("team-a's writes to be refused", cut_off, timeout=15)
    left = [op.redis.exists(worker_key(NS, f"team-a/{POOL}-flood-{i}")) for i in range(3)]
    assert sum(left) <= 1, left  # down to at most half the budget
    assert other.set(worker_key(NS, f"team-b/{POD_B}"), "{}", ex=30)  # the other pool goes on

    def condition() -> dict[str, Any] | None:
        pool = custom.get_namespaced_custom_object(GROUP, VERSION, "team-a", PLURAL_WARM_POOLS, POOL)
        return next(
            (c for c in (pool.get("status") or {}).get("conditions", []) if c["type"] == "Ready"), None
        )

    wait_for("RedisBudgetExceeded", lambda: (condition() or {}).get("reason") == "RedisBudgetExceeded")
    # Asked for: a new password, with write rights.
    patch = {"metadata": {"annotations": {"rotate.elastune.dev/redis-password": "after-flood"}}}
    body = custom.patch_namespaced_custom_object(GROUP, VERSION, "team-a", PLURAL_WARM_POOLS, POOL, patch)
    runtime.upsert_pool(body)
    assert as_pod(url, pod_credentials(api, "team-a")).set(worker_key(NS, f"team-a/{POD_A}"), "{}", ex=30)
    op.redis.delete(*[worker_key(NS, f"team-a/{POOL}-flood-{i}") for i in range(3)])


def test_a_deleted_pool_s_user_goes(site: dict[str, Any]) -> None:
    url, api, runtime = site["url"], site["api"], site["runtime"]
    creds = pod_credentials(api, "team-b")
    assert as_pod(url, creds).ping()
    runtime.delete_pool(site["bodies"]["team-b"])
    with pytest.raises(redis.exceptions.AuthenticationError):
        as_pod(url, creds).ping()
    assert site["op"].redis.acl_getuser(creds["ELASTUNE_REDIS_USERNAME"]) is None


def test_an_oversized_registry_entry_is_dropped_and_counted(site: dict[str, Any]) -> None:
    """A pod may write up to proto-max-bulk-len under its own keys; the control plane (and the gateway,
    the same ``Bus``) drops an entry over ``MAX_ENTRY_CHARS`` unparsed, as a poison entry it counts."""
    op = site["op"]
    wid = "team-c/huge-1"  # no pool of the test owns it: the budget check leaves it be
    record = WorkerRecord(id=wid, pool=POOL, model="test/model", state="ready", url="http://10.0.0.9:8080",
                          started_at=time.time())  # fmt: skip
    record.heartbeat = time.time()
    op.redis.set(worker_key(NS, wid), record.dumps() + " " * (2 << 20), ex=30)  # valid JSON, 2 MiB
    op.redis.sadd(f"{NS}:workers", wid)
    before = op.poison.get("worker", 0)
    assert wid not in op.workers()
    assert op.poison.get("worker", 0) == before + 1
    op.redis.delete(worker_key(NS, wid))


def test_a_password_whose_record_was_not_confirmed_stays_valid(
    site: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Intent before effect: the status records the new hash, then Redis and the Secret get the password,
    then the status says the Secret was written. When that last write fails (the API server gone for a
    moment) the next round issues another password; a pod started in between holds the first, which must
    stay valid (before: it was dropped as never handed out)."""
    from kubernetes.client.rest import ApiException

    api, custom, runtime = site["api"], site["custom"], site["runtime"]
    users = runtime.redis_users
    store = users._store

    def confirm_fails(pool: Any, state: Any) -> None:
        if state.written:
            raise ApiException(status=503, reason="the API server went away")
        store(pool, state)

    monkeypatch.setattr(users, "_store", confirm_fails)
    patch = {"metadata": {"annotations": {"rotate.elastune.dev/redis-password": "unconfirmed"}}}
    body = custom.patch_namespaced_custom_object(GROUP, VERSION, "team-a", PLURAL_WARM_POOLS, POOL, patch)
    with pytest.raises(ApiException):
        runtime.upsert_pool(body)
    started = pod_credentials(api, "team-a")  # a pod starting now reads this one
    monkeypatch.setattr(users, "_store", store)
    runtime.upsert_pool(body)  # kopf retries the handler
    assert pod_credentials(api, "team-a") != started  # another was issued
    assert as_pod(site["url"], started).ping()
    assert as_pod(site["url"], pod_credentials(api, "team-a")).ping()


def test_a_redis_that_restarts_empty_gets_the_pools_users_back_with_their_passwords(
    site: dict[str, Any],
) -> None:
    """A Redis without persistence (or a replaced external one) restarts empty: the pools' users and
    everything the operator kept in Redis are gone. The operator re-creates each pool's user from the
    hashes in its WarmPool's status, so a running pod's password works again, and no Secret changes
    (before: the hashes lived only in Redis, so it issued new passwords the running pods did not hold)."""
    url, api, custom = site["url"], site["api"], site["custom"]
    creds = pod_credentials(api, "team-a")  # what the running pod holds
    password = creds["ELASTUNE_REDIS_PASSWORD"]
    running = as_pod(url, creds)
    assert running.ping()
    pool = custom.get_namespaced_custom_object(GROUP, VERSION, "team-a", PLURAL_WARM_POOLS, POOL)
    user = pool["status"]["redisUser"]
    assert user["passwordHash"] == hashlib.sha256(password.encode()).hexdigest()
    assert password not in json.dumps(pool)  # hashes only

    old = site["server"]
    stop(old.proc)  # SIGKILL, no persistence: the new server starts empty but for the chart's ACL file
    site["server"] = start_redis_on(site["tmp"], "--aclfile", str(site["tmp"] / "users.acl"), port=old.port)

    def works_again() -> bool:
        try:
            return bool(running.ping())  # the pod's client reconnects with its password
        except (redis.exceptions.AuthenticationError, redis.exceptions.ConnectionError):
            return False

    wait_for("the pool's user with its running pod's password", works_again, timeout=15)
    assert running.set(worker_key(NS, f"team-a/{POD_A}"), "{}", ex=30)  # its rights, not just a login
    assert pod_credentials(api, "team-a") == creds  # no new Secret value
    pool = custom.get_namespaced_custom_object(GROUP, VERSION, "team-a", PLURAL_WARM_POOLS, POOL)
    assert pool["status"]["redisUser"] == user
    # Every password the status lists (the current and those old pods may still hold) is back.
    passwords = site["op"].redis.acl_getuser(creds["ELASTUNE_REDIS_USERNAME"])["passwords"]
    assert set(passwords) == {user["passwordHash"], *user["previousHashes"]}
