"""Namespaces isolate (issue 25 item 1): a TuningJob or LoRAAdapter runs or is served only on a WarmPool
of its own namespace, or (when its namespace has none of its model) of one whose WarmPool lists it in
spec.allowedNamespaces; two namespaces may each have a WarmPool of one model (a second one within a
namespace is refused), and deleting one never touches the other's; two namespaces may each have a
LoRAAdapter of one name, each placed, loaded and reported as its own, and deleting one never unloads the
other.

The operator's runtime (control core + workload backend) runs in this process against the Kubernetes API
emulator over HTTP and a real Redis, driven as kopf's handlers drive it; no worker runs (no torch)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_contract.api.constants import (
    GROUP,
    PLURAL_LORA_ADAPTERS,
    PLURAL_TUNING_JOBS,
    PLURAL_WARM_POOLS,
    VERSION,
)
from elastune_contract.protocol import AdapterState, ServingState, WorkerRecord, WorkerState
from elastune_contract.vocabulary import Reason
from operator_site import MODEL, OperatorSite, wait_for

A, B = "team-a", "team-b"
JOB_STORAGE = [{"claimName": "shared", "jobStorage": True}]
BORROWER_JOB = {"dataset": "data/train.jsonl"}
"""A job of another namespace may name nothing of the pool's (issue 39 item 3: ForeignReference): its
dataset is a file of the worker image, not a path of the owner's pods."""


def borrower_artifact(ns: str, name: str) -> str:
    """Where a borrower's adapter may live on the pool: its own namespace's folder of the jobStorage claim."""
    return f"pvc://shared/elastune/artifacts/{ns}/{name}"


def allow(site: OperatorSite, ns: str, name: str, allowed: list[str]) -> None:
    patch = {"spec": {"allowedNamespaces": allowed}}
    body = site.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL_WARM_POOLS, name, patch)
    site.runtime.upsert_pool(body)


def served_adapters(site: OperatorSite, pool: str) -> set[str]:
    """The adapters of the pool's record for the gateway, by id (namespace/name)."""
    record = site.bus.serving_pools().get(f"{A}/{pool}")  # the field is namespace/pool
    return set(record.adapters) if record else set()


@pytest.fixture
def site(tmp_path: Path, redis_server: Any) -> Iterator[OperatorSite]:
    s = OperatorSite(tmp_path, redis_server.url, "tenancy")
    try:
        yield s
    finally:
        s.close()


def test_a_job_of_another_namespace_waits_until_the_pool_admits_it(site: OperatorSite) -> None:
    site.pool("tiny", A, volumes=JOB_STORAGE)
    site.job("theirs", B, **BORROWER_JOB)
    c = wait_for("B's job: Scheduled", lambda: site.condition("theirs", "Scheduled", PLURAL_TUNING_JOBS, B))
    assert (c["status"], c["reason"]) == ("False", Reason.POOL_NOT_SHARED), c
    assert f"{A}/tiny" in c["message"] and "allowedNamespaces" in c["message"], c["message"]
    time.sleep(0.5)  # rounds pass: nothing of A's pool moves for it
    assert f"{B}/theirs" not in site.runtime.core.jobs
    assert site.runtime.backend.pools[f"{A}/tiny"][1] == 0
    failed = site.condition("theirs", "Failed", PLURAL_TUNING_JOBS, B)
    assert failed is None or failed["status"] != "True", failed

    # A's own job is unaffected.
    site.job("mine", A)
    wait_for("A's job in the core", lambda: f"{A}/mine" in site.runtime.core.jobs)

    # A's pool admits B: the waiting job is scheduled on it, its storage on A's jobStorage claim.
    allow(site, A, "tiny", [B])
    wait_for("B's job in the core", lambda: f"{B}/theirs" in site.runtime.core.jobs)
    c = wait_for(
        "B's job past PoolNotShared",
        lambda: (
            (x := site.condition("theirs", "Scheduled", PLURAL_TUNING_JOBS, B))
            and x["reason"] != Reason.POOL_NOT_SHARED
            and x
        ),
    )
    assert site.runtime.core.jobs[f"{B}/theirs"].artifact_dir.startswith("pvc://shared/elastune/"), c
    wait_for(
        "A's pool: Ready names B",
        lambda: (x := site.condition("tiny", "Ready", PLURAL_WARM_POOLS, A)) and B in x["message"],
    )


def test_the_wildcard_admits_every_namespace(site: OperatorSite) -> None:
    site.pool("tiny", A, volumes=JOB_STORAGE, allowedNamespaces=["*"])
    site.job("theirs", B, **BORROWER_JOB)
    wait_for("B's job in the core", lambda: f"{B}/theirs" in site.runtime.core.jobs)


def test_an_adapter_of_another_namespace_is_not_served_on_the_pool_unless_admitted(
    site: OperatorSite,
) -> None:
    site.pool("tiny", A, volumes=JOB_STORAGE)
    site.adapter("a-adapter", A)
    site.adapter("b-adapter", B, artifactURL=borrower_artifact(B, "b-adapter"))
    wait_for("A's adapter in A's pool record", lambda: f"{A}/a-adapter" in served_adapters(site, "tiny"))
    c = wait_for("B's adapter: Ready", lambda: site.condition("b-adapter", "Ready", PLURAL_LORA_ADAPTERS, B))
    assert (c["status"], c["reason"]) == ("False", Reason.POOL_NOT_SHARED), c
    assert f"{A}/tiny" in c["message"] and "allowedNamespaces" in c["message"], c["message"]
    time.sleep(0.5)
    assert f"{B}/b-adapter" not in served_adapters(site, "tiny")

    allow(site, A, "tiny", [B])
    wait_for("B's adapter in A's pool record", lambda: f"{B}/b-adapter" in served_adapters(site, "tiny"))
    c = wait_for(
        "B's adapter past PoolNotShared",
        lambda: (
            (x := site.condition("b-adapter", "Ready", PLURAL_LORA_ADAPTERS, B))
            and x["reason"] != Reason.POOL_NOT_SHARED
            and x
        ),
    )

    # Taken back: no longer served there.
    allow(site, A, "tiny", [])
    wait_for("B's adapter off A's pool", lambda: f"{B}/b-adapter" not in served_adapters(site, "tiny"))


def deployment(site: OperatorSite, name: str, ns: str) -> Any:
    """The WarmPool's Deployment (None until the operator wrote it)."""
    try:
        return client.AppsV1Api(site.api).read_namespaced_deployment(name, ns)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def a_pool_with_a_job(site: OperatorSite) -> None:
    site.pool("tiny", A, volumes=JOB_STORAGE)
    site.job("mine", A)
    wait_for("A's job in the core", lambda: f"{A}/mine" in site.runtime.core.jobs)
    wait_for("A's pool record", lambda: f"{A}/tiny" in site.bus.serving_pools())
    assert deployment(site, "tiny", A) is not None


def assert_a_pool_intact(site: OperatorSite) -> None:
    cfg = site.runtime.core.pools.get(f"{A}/tiny")  # by pool id
    assert cfg is not None and (cfg.namespace, cfg.name, cfg.model) == (A, "tiny", MODEL), cfg
    assert f"{A}/tiny" in site.bus.serving_pools()
    wp, _ = site.runtime.backend.pools[f"{A}/tiny"]
    assert wp.metadata.namespace == A
    assert deployment(site, "tiny", A) is not None
    mine = site.runtime.core.jobs[f"{A}/mine"]
    assert not mine.terminal, mine.status.conditions
    assert mine.pool == f"{A}/tiny"
    failed = site.condition("mine", "Failed", PLURAL_TUNING_JOBS, A)
    assert failed is None or failed["reason"] != Reason.WARM_POOL_DELETED, failed


def ready(site: OperatorSite, name: str, ns: str) -> dict[str, Any]:
    c = wait_for(
        f"{ns}/{name} Ready",
        lambda: (x := site.condition(name, "Ready", PLURAL_WARM_POOLS, ns)) and x["status"] == "True" and x,
    )
    assert c["reason"] == Reason.POOL_CONFIGURED, c
    return c


@pytest.mark.parametrize("b_name", ["tiny", "tiny-copy"])
def test_a_second_namespace_s_pool_of_the_model_is_ready_and_serves_its_own_namespace(
    site: OperatorSite, b_name: str
) -> None:
    """Formerly refused (DuplicateWarmPool): a pool is per namespace and model."""
    a_pool_with_a_job(site)
    site.pool(b_name, B, volumes=JOB_STORAGE)
    ready(site, b_name, B)
    ready(site, "tiny", A)
    assert deployment(site, b_name, B) is not None
    wait_for("B's pool record", lambda: f"{B}/{b_name}" in site.bus.serving_pools())
    site.job("theirs", B, **BORROWER_JOB)
    theirs = wait_for("B's job in the core", lambda: site.runtime.core.jobs.get(f"{B}/theirs"))
    assert theirs.pool == f"{B}/{b_name}", "B's job runs on B's own pool"
    c = wait_for("B's job Scheduled", lambda: site.condition("theirs", "Scheduled", PLURAL_TUNING_JOBS, B))
    assert c["reason"] != Reason.POOL_NOT_SHARED, c
    assert_a_pool_intact(site)


@pytest.mark.parametrize("b_name", ["tiny", "tiny-copy"])
def test_deleting_one_namespace_s_pool_leaves_the_other_namespaces_pool(
    site: OperatorSite, b_name: str
) -> None:
    a_pool_with_a_job(site)
    site.pool(b_name, B, volumes=JOB_STORAGE)
    ready(site, b_name, B)
    site.job("theirs", B, **BORROWER_JOB)
    wait_for("B's job in the core", lambda: f"{B}/theirs" in site.runtime.core.jobs)
    dup = site.get(PLURAL_WARM_POOLS, b_name, B)
    site.custom.delete_namespaced_custom_object(GROUP, VERSION, B, PLURAL_WARM_POOLS, b_name)
    site.runtime.delete_pool(dup)
    time.sleep(0.5)  # rounds pass
    assert f"{B}/{b_name}" not in site.runtime.core.pools
    assert_a_pool_intact(site)
    # B's job had no other pool (A's does not admit B): it fails with the reason; A's is untouched.
    c = wait_for("B's job Failed", lambda: site.condition("theirs", "Failed", PLURAL_TUNING_JOBS, B))
    assert (c["status"], c["reason"]) == ("True", Reason.WARM_POOL_DELETED), c


def test_a_second_pool_of_the_model_in_one_namespace_is_refused_and_takes_over_when_the_first_goes(
    site: OperatorSite,
) -> None:
    site.pool("tiny", A, volumes=JOB_STORAGE)
    site.pool("own", B, volumes=JOB_STORAGE)  # another namespace's: its own pool, Ready
    ready(site, "own", B)
    site.pool("tiny-2", A, volumes=JOB_STORAGE)
    c = wait_for("A's second pool's Ready", lambda: site.condition("tiny-2", "Ready", PLURAL_WARM_POOLS, A))
    assert (c["status"], c["reason"]) == ("False", Reason.DUPLICATE_WARM_POOL), c
    assert f"{A}/tiny" in c["message"] and A in c["message"], c["message"]
    assert deployment(site, "tiny-2", A) is None
    a_pool = site.get(PLURAL_WARM_POOLS, "tiny", A)
    site.custom.delete_namespaced_custom_object(GROUP, VERSION, A, PLURAL_WARM_POOLS, "tiny")
    site.runtime.delete_pool(a_pool)
    cfg = wait_for("A's second pool configured", lambda: site.runtime.core.pools.get(f"{A}/tiny-2"))
    assert (cfg.namespace, cfg.name) == (A, "tiny-2")
    ready(site, "tiny-2", A)
    assert f"{B}/own" in site.runtime.core.pools, "B's pool is never touched"


def test_a_job_uses_an_admitting_pool_of_another_namespace_only_while_its_own_has_none(
    site: OperatorSite,
) -> None:
    site.pool("tiny", A, volumes=JOB_STORAGE, allowedNamespaces=["*"])
    site.job("early", B, **BORROWER_JOB)
    early = wait_for("B's job in the core", lambda: site.runtime.core.jobs.get(f"{B}/early"))
    assert early.pool == f"{A}/tiny", "no pool of its own: the one that admits it"
    site.pool("own", B, volumes=JOB_STORAGE)
    ready(site, "own", B)
    site.job("late", B, **BORROWER_JOB)
    late = wait_for("B's second job in the core", lambda: site.runtime.core.jobs.get(f"{B}/late"))
    assert late.pool == f"{B}/own"
    # The first was not dispatched yet (no worker runs here): it moved to B's own pool.
    wait_for("B's first job on B's pool", lambda: early.pool == f"{B}/own")


def serving_worker(site: OperatorSite, pod: str, pool: str, held: list[tuple[str, str]], ns: str = A) -> str:
    """A warm serving pod of the pool (in the API, as its Deployment makes it) and its heartbeat, reporting
    the adapters it holds as (namespace, name). Returns the worker's id (``<namespace>/<pod>``)."""
    made: dict[tuple[str, str], tuple[str, str]] = site.__dict__.setdefault("serving_pods", {})
    if (ns, pod) not in made:  # a heartbeat repeats; the pod is made once
        made[(ns, pod)] = site.add_pod(pod, pool, ns)
    worker_id, url = made[(ns, pod)]
    now = time.time()
    serving = ServingState(
        model=MODEL, max_model_len=256, max_loras=4,
        adapters=[AdapterState(name=n, namespace=ns, rank=8, tier="device") for ns, n in held],
    )  # fmt: skip
    site.bus.publish_worker(
        WorkerRecord(
            id=worker_id, pool=pool, model=MODEL, state=WorkerState.READY, started_at=now - 3,
            ready_at=now, heartbeat=now, serving=serving, url=url,
        )
    )  # fmt: skip
    return worker_id


def test_two_namespaces_each_have_a_summarizer_and_deleting_one_leaves_the_other(site: OperatorSite) -> None:
    """Fails before per-namespace identity: the second `summarizer` was refused (DuplicateAdapterName)."""
    site.pool("tiny", A, volumes=JOB_STORAGE, allowedNamespaces=[B])
    site.adapter("summarizer", A, artifactURL="pvc://shared/adapters/a-summarizer")
    site.adapter("summarizer", B, artifactURL=borrower_artifact(B, "summarizer"))
    both = {f"{A}/summarizer", f"{B}/summarizer"}
    wait_for("both in A's pool record", lambda: both <= served_adapters(site, "tiny"))
    for ns in (A, B):
        wait_for(
            f"{ns}'s summarizer Ready",
            lambda ns=ns: (
                (x := site.condition("summarizer", "Ready", PLURAL_LORA_ADAPTERS, ns))
                and x["status"] == "True"
            ),
        )

    # One pod of the pool: each namespace's adapter is placed there as its own, with its own artifact.
    w1 = serving_worker(site, "tiny-w1", "tiny", [])
    placed = wait_for(
        "both placed on the pod", lambda: (p := site.bus.placement(w1)) and both <= set(p) and p
    )
    assert placed[f"{A}/summarizer"].url.endswith("a-summarizer"), placed
    assert placed[f"{B}/summarizer"].url.endswith(f"{B}/summarizer"), placed

    # The pod loads both: each LoRAAdapter's status names the pod, from its own entry of the record.
    serving_worker(site, "tiny-w1", "tiny", [(A, "summarizer"), (B, "summarizer")])
    for ns in (A, B):
        wait_for(
            f"{ns}'s summarizer Loaded on tiny-w1",
            lambda ns=ns: (
                [p["pod"] for p in site.status("summarizer", PLURAL_LORA_ADAPTERS, ns).get("loadedOn", [])]
                == [w1]
            ),
        )

    # Deleting B's: B's is unloaded (its finalizer waits for that), A's stays placed, loaded and served.
    b_body = site.get(PLURAL_LORA_ADAPTERS, "summarizer", B)
    assert b_body is not None
    assert site.runtime.delete_adapter(B, "summarizer") == [w1]  # still held: the finalizer waits
    wait_for("B's off the placement", lambda: set(site.bus.placement(w1)) == {f"{A}/summarizer"})
    assert served_adapters(site, "tiny") == {f"{A}/summarizer"}
    serving_worker(site, "tiny-w1", "tiny", [(A, "summarizer")])  # the pod unloaded B's only
    wait_for("B's delete done", lambda: site.runtime.delete_adapter(B, "summarizer") == [])
    time.sleep(0.5)  # rounds pass
    assert set(site.bus.placement(w1)) == {f"{A}/summarizer"}
    conds = site.conditions("summarizer", PLURAL_LORA_ADAPTERS, A)
    assert conds["Ready"]["status"] == "True" and conds["Loaded"]["status"] == "True", conds
    assert f"{A}/summarizer" in site.runtime.core.serving.adapters
    assert f"{B}/summarizer" not in site.runtime.core.serving.adapters
