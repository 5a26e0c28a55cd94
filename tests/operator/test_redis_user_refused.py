"""An external Redis whose operator user may not create users (issue 39 item 2): the real operator (kopf
over our handlers) against the Kubernetes API emulator over HTTP and a real redis-server. The WarmPool is
refused - Ready=False, RedisUserUnavailable, saying which ACL rights are missing - with no Deployment and no
Redis password in its namespace, never the shared worker password instead. Granting the rights brings the
pool up on its own (level-triggered) with its own user's Secret."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from elastune_contract.api.constants import GROUP, PLURAL_WARM_POOLS, VERSION
from elastune_contract.redis_acl import DEFAULT_USERS, ROLES, Role, acl_file, acl_rules
from elastune_testing.emulator import start_emulator
from operator_process import start_operator, stop_operator
from operator_site import wait_for
from real_servers import start_redis, stop

BUS = "refused"
NS = "team-a"
PASSWORDS: dict[Role, str] = {r: f"{r}-secret-{i}" for i, r in enumerate(ROLES)}
ADMIN = "admin-pw"


@pytest.fixture
def world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    acl = acl_file(PASSWORDS, BUS)
    # An external Redis whose admin gave the operator the bus's keys but no ACL rights.
    acl = acl.replace(acl_rules("operator", BUS), acl_rules("operator", BUS) + " -acl")
    (tmp_path / "users.acl").write_text(acl + f"user admin on >{ADMIN} ~* &* +@all\n")
    server = start_redis(tmp_path, "--aclfile", str(tmp_path / "users.acl"))
    emulator = start_emulator(tmp_path / "emulator")
    proc = start_operator(
        emulator.kubeconfig_path,
        server.url,
        BUS,
        tmp_path / "work",
        tmp_path / "operator.log",
        ELASTUNE_REDIS_USERNAME=DEFAULT_USERS["operator"],
        ELASTUNE_REDIS_PASSWORD=PASSWORDS["operator"],
        # What the chart gave the operator before per-pool users: the shared worker password to copy.
        ELASTUNE_REDIS_SECRET="elastune-redis-worker",
        ELASTUNE_REDIS_WORKER_USERNAME=DEFAULT_USERS["worker"],
        ELASTUNE_REDIS_WORKER_PASSWORD=PASSWORDS["worker"],
    )
    api = config.new_client_from_config(config_file=str(emulator.kubeconfig_path))
    try:
        yield {"api": api, "url": server.url, "log": tmp_path / "operator.log", "proc": proc}
    finally:
        stop_operator(proc)
        emulator.stop()
        stop(server.proc)


def ready(custom: client.CustomObjectsApi, name: str) -> dict[str, Any] | None:
    pool = custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, name)
    return next((c for c in (pool.get("status") or {}).get("conditions", []) if c["type"] == "Ready"), None)


def secrets_in(api: client.ApiClient) -> dict[str, dict[str, str]]:
    resp: Any = client.CoreV1Api(api).list_namespaced_secret(NS, _preload_content=False)
    return {
        s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
        for s in json.loads(resp.data)["items"]
    }


def test_without_acl_rights_the_warm_pool_is_refused_never_given_the_shared_password(
    world: dict[str, Any],
) -> None:
    api = world["api"]
    custom = client.CustomObjectsApi(api)
    meta = {"name": "tiny", "namespace": NS}
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WarmPool", "metadata": meta,
            "spec": {"model": "test/model", "maxWarmGPUs": 1}}  # fmt: skip
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL_WARM_POOLS, body)

    def decided() -> dict[str, Any] | None:
        assert world["proc"].poll() is None, world["log"].read_text()
        return ready(custom, "tiny")

    cond = wait_for("the WarmPool's Ready condition", decided, timeout=60)
    assert (cond["status"], cond["reason"]) == ("False", "RedisUserUnavailable"), cond
    assert "+acl|setuser" in cond["message"], cond
    with pytest.raises(ApiException) as info:
        client.AppsV1Api(api).read_namespaced_deployment("tiny", NS)
    assert info.value.status == 404
    assert not any(PASSWORDS["worker"] in data.values() for data in secrets_in(api).values())

    # The admin grants the documented rights: the pool comes up with a user of its own.
    admin = redis.Redis.from_url(world["url"], username="admin", password=ADMIN)
    admin.execute_command(
        "ACL", "SETUSER", DEFAULT_USERS["operator"], "+acl|setuser", "+acl|deluser", "+acl|getuser"
    )
    cond = wait_for(
        "the WarmPool to be configured", lambda: (ready(custom, "tiny") or {}).get("status") == "True"
    )
    own = secrets_in(api)["tiny-redis-user"]
    assert own["username"] == f"{BUS}:pool:{NS}/tiny" and own["password"] != PASSWORDS["worker"]
    assert redis.Redis.from_url(world["url"], username=own["username"], password=own["password"]).ping()
    assert not any(PASSWORDS["worker"] in data.values() for data in secrets_in(api).values())
