"""Namespaces isolate (issue 25 item 1, first step): a TuningJob or LoRAAdapter runs or is served only on
a WarmPool of its own namespace, or of one whose WarmPool lists it in spec.allowedNamespaces; refusing or
deleting a duplicate WarmPool in one namespace never touches the pool of another.

The operator's runtime (control core + Knative backend) runs in this process against the Kubernetes API
emulator over HTTP and a real Redis, driven as kopf's handlers drive it; no worker runs (no torch)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from elastune_contract.api.constants import (
    GROUP,
    PLURAL_LORA_ADAPTERS,
    PLURAL_TUNING_JOBS,
    PLURAL_WARM_POOLS,
    VERSION,
)
from elastune_contract.protocol import Bus
from elastune_contract.vocabulary import Reason
from elastune_operator.k8s.knative import KNATIVE_GROUP, KNATIVE_PLURAL, KNATIVE_VERSION
from elastune_operator.k8s.runtime import Runtime
from elastune_operator.k8s.settings import OperatorSettings
from elastune_testing.emulator import start_emulator

V = f"{GROUP}/{VERSION}"
MODEL = "test/model"
A, B = "team-a", "team-b"


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Site:
    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.emulator = start_emulator(tmp / "emulator")
        api = config.new_client_from_config(config_file=str(self.emulator.kubeconfig_path))
        self.custom = client.CustomObjectsApi(api)
        self.bus = Bus(redis_url, f"tenancy{time.time_ns()}")
        settings = OperatorSettings(
            redis_url=redis_url, redis_secret=None, work_dir=tmp / "pod-tmp", metrics_port=0,
            namespace=self.bus.ns, cold_pool_gpus=2,
        )  # fmt: skip
        self.rt = Runtime(settings, api, bus=self.bus)
        self.rt.start()

    def close(self) -> None:
        self.rt.stop()
        self.emulator.stop()

    def create(self, ns: str, plural: str, kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": V, "kind": kind, "metadata": {"name": name, "namespace": ns}, "spec": spec}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, plural, body)

    def get(self, ns: str, plural: str, name: str, group: str = GROUP, version: str = VERSION) -> Any:
        try:
            return self.custom.get_namespaced_custom_object(group, version, ns, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def pool(self, ns: str, name: str = "tiny", **spec: Any) -> dict[str, Any]:
        volumes = [{"claimName": "shared", "jobStorage": True}]
        body = self.create(
            ns, PLURAL_WARM_POOLS, "WarmPool", name,
            {"model": MODEL, "maxWarmGPUs": 2, "volumes": volumes, **spec},
        )  # fmt: skip
        self.rt.upsert_pool(body)
        return body

    def allow(self, ns: str, name: str, allowed: list[str]) -> None:
        patch = {"spec": {"allowedNamespaces": allowed}}
        body = self.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL_WARM_POOLS, name, patch)
        self.rt.upsert_pool(body)

    def job(self, ns: str, name: str) -> dict[str, Any]:
        spec = {
            "model": MODEL, "dataset": "/data/train.jsonl", "termination": {"maxIterations": 20},
            "deadline": "10m", "promptBank": "never",
        }  # fmt: skip
        body = self.create(ns, PLURAL_TUNING_JOBS, "TuningJob", name, spec)
        self.rt.submit_job(body)
        return body

    def adapter(self, ns: str, name: str) -> dict[str, Any]:
        spec = {"baseModel": MODEL, "artifactURL": f"pvc://shared/adapters/{name}", "rank": 8}
        body = self.create(ns, PLURAL_LORA_ADAPTERS, "LoRAAdapter", name, spec)
        self.rt.upsert_adapter(body)
        return body

    def condition(self, ns: str, plural: str, name: str, ctype: str) -> dict[str, Any] | None:
        status = (self.get(ns, plural, name) or {}).get("status") or {}
        return next((c for c in status.get("conditions", []) if c["type"] == ctype), None)

    def served_adapters(self, pool: str) -> set[str]:
        record = self.bus.serving_pools().get(pool)
        return set(record.adapters) if record else set()


@pytest.fixture
def site(tmp_path: Path, redis_server: Any) -> Iterator[Site]:
    s = Site(tmp_path, redis_server.url)
    try:
        yield s
    finally:
        s.close()


def test_a_job_of_another_namespace_waits_until_the_pool_admits_it(site: Site) -> None:
    site.pool(A)
    site.job(B, "theirs")
    c = wait_for("B's job: Scheduled", lambda: site.condition(B, PLURAL_TUNING_JOBS, "theirs", "Scheduled"))
    assert (c["status"], c["reason"]) == ("False", Reason.POOL_NOT_SHARED), c
    assert f"{A}/tiny" in c["message"] and "allowedNamespaces" in c["message"], c["message"]
    time.sleep(0.5)  # rounds pass: nothing of A's pool moves for it
    assert f"{B}/theirs" not in site.rt.core.jobs
    assert site.rt.backend.pools["tiny"][1] == 0
    failed = site.condition(B, PLURAL_TUNING_JOBS, "theirs", "Failed")
    assert failed is None or failed["status"] != "True", failed

    # A's own job is unaffected.
    site.job(A, "mine")
    wait_for("A's job in the core", lambda: f"{A}/mine" in site.rt.core.jobs)

    # A's pool admits B: the waiting job is scheduled on it, its storage on A's jobStorage claim.
    site.allow(A, "tiny", [B])
    wait_for("B's job in the core", lambda: f"{B}/theirs" in site.rt.core.jobs)
    c = wait_for(
        "B's job past PoolNotShared",
        lambda: (
            (x := site.condition(B, PLURAL_TUNING_JOBS, "theirs", "Scheduled"))
            and x["reason"] != Reason.POOL_NOT_SHARED
            and x
        ),
    )
    assert site.rt.core.jobs[f"{B}/theirs"].artifact_dir.startswith("pvc://shared/elastune/"), c
    wait_for(
        "A's pool: Ready names B",
        lambda: (x := site.condition(A, PLURAL_WARM_POOLS, "tiny", "Ready")) and B in x["message"],
    )


def test_the_wildcard_admits_every_namespace(site: Site) -> None:
    site.pool(A, allowedNamespaces=["*"])
    site.job(B, "theirs")
    wait_for("B's job in the core", lambda: f"{B}/theirs" in site.rt.core.jobs)


def test_an_adapter_of_another_namespace_is_not_served_on_the_pool_unless_admitted(site: Site) -> None:
    site.pool(A)
    site.adapter(A, "a-adapter")
    site.adapter(B, "b-adapter")
    wait_for("A's adapter in A's pool record", lambda: "a-adapter" in site.served_adapters("tiny"))
    c = wait_for("B's adapter: Ready", lambda: site.condition(B, PLURAL_LORA_ADAPTERS, "b-adapter", "Ready"))
    assert (c["status"], c["reason"]) == ("False", Reason.POOL_NOT_SHARED), c
    assert f"{A}/tiny" in c["message"] and "allowedNamespaces" in c["message"], c["message"]
    time.sleep(0.5)
    assert "b-adapter" not in site.served_adapters("tiny")

    site.allow(A, "tiny", [B])
    wait_for("B's adapter in A's pool record", lambda: "b-adapter" in site.served_adapters("tiny"))
    c = wait_for(
        "B's adapter past PoolNotShared",
        lambda: (
            (x := site.condition(B, PLURAL_LORA_ADAPTERS, "b-adapter", "Ready"))
            and x["reason"] != Reason.POOL_NOT_SHARED
            and x
        ),
    )

    # Taken back: no longer served there.
    site.allow(A, "tiny", [])
    wait_for("B's adapter off A's pool", lambda: "b-adapter" not in site.served_adapters("tiny"))


def a_pool_with_a_job(site: Site) -> None:
    site.pool(A)
    site.job(A, "mine")
    wait_for("A's job in the core", lambda: f"{A}/mine" in site.rt.core.jobs)
    wait_for("A's pool record", lambda: "tiny" in site.bus.serving_pools())
    assert site.get(A, KNATIVE_PLURAL, "tiny", KNATIVE_GROUP, KNATIVE_VERSION) is not None


def assert_a_pool_intact(site: Site) -> None:
    cfg = site.rt.core.pools.get(MODEL)
    assert cfg is not None and (cfg.namespace, cfg.name) == (A, "tiny"), cfg
    assert "tiny" in site.bus.serving_pools()
    wp, _ = site.rt.backend.pools["tiny"]
    assert wp.metadata.namespace == A
    assert site.get(A, KNATIVE_PLURAL, "tiny", KNATIVE_GROUP, KNATIVE_VERSION) is not None
    mine = site.rt.core.jobs[f"{A}/mine"]
    assert not mine.terminal, mine.status.conditions
    failed = site.condition(A, PLURAL_TUNING_JOBS, "mine", "Failed")
    assert failed is None or failed["reason"] != Reason.WARM_POOL_DELETED, failed


@pytest.mark.parametrize("dup_name", ["tiny", "tiny-copy"])
def test_a_duplicate_pool_in_another_namespace_is_refused_with_a_condition(site: Site, dup_name: str) -> None:
    a_pool_with_a_job(site)
    site.pool(B, dup_name)
    c = wait_for("the duplicate's Ready", lambda: site.condition(B, PLURAL_WARM_POOLS, dup_name, "Ready"))
    assert (c["status"], c["reason"]) == ("False", Reason.DUPLICATE_WARM_POOL), c
    assert f"{A}/tiny" in c["message"], c["message"]
    assert site.get(B, KNATIVE_PLURAL, dup_name, KNATIVE_GROUP, KNATIVE_VERSION) is None
    assert_a_pool_intact(site)


@pytest.mark.parametrize("dup_name", ["tiny", "tiny-copy"])
def test_deleting_a_refused_duplicate_pool_leaves_the_other_namespaces_pool(
    site: Site, dup_name: str
) -> None:
    a_pool_with_a_job(site)
    # kopf retries a handler that raises (what the duplicate got before); the object stays either way.
    with contextlib.suppress(ValueError):
        site.pool(B, dup_name)
    dup = site.get(B, PLURAL_WARM_POOLS, dup_name)
    site.custom.delete_namespaced_custom_object(GROUP, VERSION, B, PLURAL_WARM_POOLS, dup_name)
    site.rt.delete_pool(dup)
    time.sleep(0.5)  # rounds pass
    assert_a_pool_intact(site)


def test_a_refused_pool_takes_over_once_the_model_s_pool_is_deleted(site: Site) -> None:
    site.pool(A)
    site.pool(B, "own")
    c = wait_for("B's pool's Ready", lambda: site.condition(B, PLURAL_WARM_POOLS, "own", "Ready"))
    assert c["reason"] == Reason.DUPLICATE_WARM_POOL, c
    site.job(B, "theirs")  # waits: A's pool does not admit B
    wait_for("B's job waiting", lambda: site.condition(B, PLURAL_TUNING_JOBS, "theirs", "Scheduled"))
    a_pool = site.get(A, PLURAL_WARM_POOLS, "tiny")
    site.custom.delete_namespaced_custom_object(GROUP, VERSION, A, PLURAL_WARM_POOLS, "tiny")
    site.rt.delete_pool(a_pool)
    cfg = wait_for("B's pool configured", lambda: site.rt.core.pools.get(MODEL))
    assert (cfg.namespace, cfg.name) == (B, "own")
    wait_for(
        "B's pool Ready",
        lambda: (x := site.condition(B, PLURAL_WARM_POOLS, "own", "Ready")) and x["status"] == "True",
    )
    wait_for("B's job in the core", lambda: f"{B}/theirs" in site.rt.core.jobs)
