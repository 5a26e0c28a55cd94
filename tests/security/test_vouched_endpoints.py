"""The gateway forwards only to addresses the control plane vouches for (issue 25 item 4, docs/design.md §6).

Workers write their own registry records with one shared Redis user, so a worker credential can rewrite
another worker's record to point at its own server. The control plane lists each pool's workers in the
pool record (``ServingPoolRecord.vouched``), which the worker user cannot write: the Knative backend from
the pods the API lists (pod name -> pod IP and worker port), the local backend from the processes it
started (id -> loopback). Here: the gateway directory's filter on records built in memory, the serving
control publishing the list (real Redis), the local backend's list (real processes) and the Knative
backend's list (the Kubernetes API emulator)."""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastune_common.bus import Bus
from elastune_common.servers import Server
from elastune_contract.api.warmpool import ServingSpec
from elastune_contract.protocol import (
    AdapterState,
    ServingPoolRecord,
    ServingState,
    WorkerRecord,
    WorkerState,
    vouched_address,
    vouched_url,
)
from elastune_gateway.server.directory import Directory
from elastune_gateway.server.metrics import GatewayMetrics
from elastune_operator.control.serving import ServingControl
from elastune_operator.local.backend import LocalBackend
from elastune_testing.fixtures import k8s_emulator  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"


def record(wid: str, url: str, model: str = MODEL, adapters: tuple[str, ...] = ()) -> WorkerRecord:
    serving = ServingState(
        model=model, max_model_len=256, adapters=[AdapterState(name=a, rank=8, tier="host") for a in adapters]
    )
    return WorkerRecord(
        id=wid, pool="p", model=model, state=WorkerState.READY, url=url, started_at=1.0, serving=serving
    )


def pool(vouched: dict[str, str] | None, model: str = MODEL, name: str = "p") -> ServingPoolRecord:
    return ServingPoolRecord(pool=name, model=model, vouched=vouched)


def directory(**kwargs: Any) -> Directory:
    # The filter runs on records handed to it: the Bus is never connected.
    return Directory(Bus("redis://127.0.0.1:1/0"), 10.0, GatewayMetrics(), **kwargs)


def sample(d: Directory, name: str, **labels: str) -> float:
    assert d.metrics is not None
    value = d.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def urls(d: Directory, model: str = MODEL) -> dict[str, str]:
    known = d.model(model)
    return {} if known is None else {e.id: e.url for e in d.endpoints(known)}


def test_vouched_url_matches_host_or_host_and_port_and_rebuilds_the_url() -> None:
    assert vouched_url("10.0.0.5", "http://10.0.0.5:8080") == "http://10.0.0.5:8080"
    assert vouched_url("10.0.0.5:8080", "http://10.0.0.5:8080/") == "http://10.0.0.5:8080"
    assert vouched_url("10.0.0.5:8080", "http://10.0.0.5:8081") is None  # port vouched: must match
    assert vouched_url("10.0.0.5", "http://10.0.0.6:8080") is None
    # Nothing of the record's own spelling is forwarded to: user info and path are dropped.
    assert vouched_url("10.0.0.5:8080", "http://evil@10.0.0.5:8080/x?y") == "http://10.0.0.5:8080"
    assert vouched_url(vouched_address("fd00::1", 8080), "http://[fd00:0::1]:8080") == "http://[fd00::1]:8080"
    for bad in ("http://10.0.0.5", "ftp://10.0.0.5:21", "10.0.0.5:8080", "http://[::1:80", ""):
        assert vouched_url("10.0.0.5", bad) is None, bad
    assert vouched_url("[::1", "http://[::1]:80") is None


def test_a_rewritten_record_gets_no_endpoint_and_is_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = directory()
    pools = {"p": pool({"w1": "10.0.0.1:8080", "w2": "10.0.0.2:8080"})}
    workers = {
        "w1": record("w1", "http://10.0.0.1:8080"),
        "w2": record("w2", "http://10.6.6.6:8080", adapters=("evil",)),  # rewritten by another worker
        "w3": record("w3", "http://10.0.0.3:8080"),  # registered itself, but no pod of the pool is w3
        "w4": record("w1", "http://10.6.6.6:8080"),  # a record under another key naming w1
    }
    with caplog.at_level(logging.WARNING, logger="elastune.gateway"):
        d._apply(workers, pools)
        d._apply(workers, pools)  # the next registry read: still skipped, not logged or counted again
    assert urls(d) == {"w1": "http://10.0.0.1:8080"}
    assert d.model("evil") is None  # an adapter only the rewritten record claims is not a model
    assert d.unvouched == {"address": 1, "unlisted": 1, "id": 1}
    for reason, n in (("address", 1), ("unlisted", 1), ("id", 1), ("no_pool_record", 0)):
        assert sample(d, "elastune_gateway_unvouched_endpoints", reason=reason) == n
        assert sample(d, "elastune_gateway_unvouched_records_total", reason=reason) == n
    warnings = [r.getMessage() for r in caplog.records if "not forwarding" in r.getMessage()]
    assert len(warnings) == 3 and any("10.6.6.6" in w and "'w2'" in w for w in warnings)

    # The worker's own heartbeat puts its address back: it is an endpoint again, the gauge follows.
    workers["w2"] = record("w2", "http://10.0.0.2:8080")
    del workers["w4"]
    d._apply(workers, pools)
    assert urls(d) == {"w1": "http://10.0.0.1:8080", "w2": "http://10.0.0.2:8080"}
    assert sample(d, "elastune_gateway_unvouched_endpoints", reason="address") == 0
    assert sample(d, "elastune_gateway_unvouched_records_total", reason="address") == 1


def test_a_worker_vouched_by_another_models_pool_does_not_serve_this_model() -> None:
    d = directory()
    pools = {"p": pool({"w1": "10.0.0.1"}), "q": pool({"w9": "10.0.0.9"}, model="other", name="q")}
    # w9 is vouched for (in pool q, model other) but claims MODEL: MODEL's pool does not list it.
    d._apply({"w1": record("w1", "http://10.0.0.1:5"), "w9": record("w9", "http://10.0.0.9:5")}, pools)
    assert urls(d) == {"w1": "http://10.0.0.1:5"} and d.unvouched == {"unlisted": 1}


def test_an_empty_list_serves_nothing_and_requests_wait_for_a_vouched_worker() -> None:
    d = directory()
    d._apply({"w1": record("w1", "http://10.0.0.1:5")}, {"p": pool({})})
    assert d.model(MODEL) is not None and urls(d) == {}  # known (held, then 503), but no endpoint


def test_models_without_a_vouching_pool_record_follow_the_registry_unless_vouched_only() -> None:
    workers = {"w1": record("w1", "http://127.0.0.1:5"), "w2": record("w2", "http://127.0.0.1:6", "m2")}
    pools = {"p": pool(None)}  # an operator older than the list: no vouched field
    assert ServingPoolRecord.model_validate_json('{"pool": "p", "model": "m"}').vouched is None
    open_ = directory()
    open_._apply(workers, pools)
    assert urls(open_) == {"w1": "http://127.0.0.1:5"} and urls(open_, "m2") == {"w2": "http://127.0.0.1:6"}
    closed = directory(vouched_only=True)
    closed._apply(workers, pools)
    assert urls(closed) == {} and urls(closed, "m2") == {}
    assert closed.unvouched == {"no_pool_record": 2}


@pytest.fixture
def bus(redis_server: Server) -> Iterator[Bus]:
    b = Bus(redis_server.url, namespace=f"v{time.monotonic_ns()}")
    yield b
    b.close()


def test_the_serving_control_publishes_what_the_backend_vouches_for_and_keeps_it_current(bus: Bus) -> None:
    known = {"default/p": {"w1": "10.0.0.1:8080"}}  # by pool id (namespace/name), as backends key them
    control = ServingControl(bus, vouched=lambda: {k: dict(v) for k, v in known.items()})
    control.add_pool("p", MODEL, ServingSpec())
    control.add_pool("q", "other", ServingSpec())
    control.tick({})
    pools = bus.serving_pools()
    assert pools["default/p"].vouched == {"w1": "10.0.0.1:8080"}
    assert pools["default/q"].vouched == {}  # a pool the backend knows no worker of: an empty list, not none
    known["default/p"]["w2"] = "10.0.0.2:8080"  # a new pod came up
    control.tick({})
    assert bus.serving_pools()["default/p"].vouched == {"w1": "10.0.0.1:8080", "w2": "10.0.0.2:8080"}
    # A record rewritten behind its back (it cannot be by a worker: the ACL) is written again.
    bus.publish_pool(
        ServingPoolRecord(pool="p", model=MODEL, namespace="default", vouched={"w1": "10.6.6.6"})
    )
    control._asserted_at = float("-inf")
    control.tick({})
    assert bus.serving_pools()["default/p"].vouched == {"w1": "10.0.0.1:8080", "w2": "10.0.0.2:8080"}
    # A backend that vouches for nothing: no list at all (the gateway's registry-only or closed mode).
    plain = ServingControl(bus)
    plain.add_pool("p", MODEL, ServingSpec())
    plain.tick({})
    assert bus.serving_pools()["default/p"].vouched is None


def test_the_local_backend_vouches_for_its_live_processes_at_loopback(tmp_path: Path) -> None:
    # A stand-in for the worker command (no model to load): the backend only starts and watches it.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    backend = LocalBackend(tmp_path / "state", "redis://127.0.0.1:1/0", python=str(fake))
    try:
        backend.grow("p", MODEL, 2)
        assert backend.vouched() == {"p": {"p-w1": "127.0.0.1", "p-w2": "127.0.0.1"}}
        backend.kill("p-w1")
        backend.procs["p-w1"].proc.wait(10)
        assert backend.vouched() == {"p": {"p-w2": "127.0.0.1"}}
    finally:
        backend.close(timeout=5)


def test_the_knative_backend_vouches_for_running_pods_at_their_ip(k8s_emulator: Any) -> None:  # noqa: F811
    pytest.importorskip("kmock")
    from kubernetes import client, config

    from elastune_contract.api.constants import LABEL_WARM_POOL
    from elastune_contract.api.resources import parse_resource
    from elastune_operator.k8s.workload import WORKER_PORT, WorkloadBackend

    ns = "team-a"
    api = config.new_client_from_config(config_file=str(k8s_emulator.kubeconfig_path))
    doc = yaml.safe_load((REPO / "manifests" / "warmpool.yaml").read_text())
    doc["metadata"].update(namespace=ns, uid="u-1")
    wp = parse_resource(doc)
    name = wp.metadata.name
    now = [time.time()]
    backend = WorkloadBackend(api, "redis://r:6379/0", clock=lambda: now[0])
    backend.register(wp, 3)
    core = client.CoreV1Api(api)

    def put(pod: str, status: dict[str, Any], pool_label: str = name, **meta: Any) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns, "labels": {LABEL_WARM_POOL: pool_label}, **meta},
            "spec": {"containers": [{"name": "worker", "image": "w"}]},
        }
        core.create_namespaced_pod(ns, body)
        core.patch_namespaced_pod_status(pod, ns, {"status": status})

    key = f"{ns}/{name}"  # the pool's id (namespace/name)
    assert backend.vouched() == {key: {}}  # never listed: vouches for nobody
    put("a", {"phase": "Running", "podIP": "10.1.0.5"})
    put("b", {"phase": "Running", "podIP": "fd00::7"})
    put("pending", {"phase": "Pending"})  # no IP yet
    put("other", {"phase": "Running", "podIP": "10.1.0.9"}, pool_label="someone-elses")
    put("going", {"phase": "Running", "podIP": "10.1.0.6"}, finalizers=["test.elastune.dev/hold"])
    core.delete_namespaced_pod("going", ns)  # terminating: no new requests
    backend.exited()
    assert backend.vouched() == {
        # by the id each pod's worker registers under: namespace/pod (pod names repeat across namespaces)
        key: {f"{ns}/a": f"10.1.0.5:{WORKER_PORT}", f"{ns}/b": f"[fd00::7]:{WORKER_PORT}"},
    }
    core.delete_namespaced_pod("a", ns)
    now[0] += 5  # the next listing (at most one per POD_POLL_S)
    backend.exited()
    assert backend.vouched() == {key: {f"{ns}/b": f"[fd00::7]:{WORKER_PORT}"}}
