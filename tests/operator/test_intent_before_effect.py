"""Intent before effect in the operator's runtime (issue 24 item 4), in this process against the
Kubernetes API emulator over HTTP and a real Redis; the test plays the worker side of the protocol (no
torch). The attempt is in the TuningJob's stored status before its assignment reaches Redis; a published
LoRAAdapter exists before the job's status says so, re-publication after a restart is idempotent, and a
publish name a user's own LoRAAdapter holds becomes a condition with a reason (PublishNameTaken)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from kubernetes.client.rest import ApiException

from elastune_contract.api.constants import (
    GROUP,
    PLURAL_LORA_ADAPTERS,
    PLURAL_TUNING_JOBS,
    VERSION,
)
from elastune_contract.protocol import Assignment
from elastune_contract.vocabulary import Reason
from operator_site import MODEL, NS, OperatorSite, wait_for

V = f"{GROUP}/{VERSION}"
JOB_STORAGE = [{"claimName": "shared", "jobStorage": True}]


def succeeded_job(site: OperatorSite, name: str, publish: str) -> dict[str, Any]:
    """A job whose stored status says it succeeded (as an operator before a restart left it)."""
    site.job(name, submit=False, output={"publish": publish})
    stamp = "2026-01-01T00:00:00Z"
    cond = {"status": "True", "reason": "MaxIterations", "message": "", "lastTransitionTime": stamp}
    status = {
        "conditions": [
            {"type": "Accepted", **cond, "reason": "Validated"},
            {"type": "Succeeded", **cond},
        ],
        "artifactURI": f"pvc://shared/elastune/artifacts/{NS}/{name}",
        "iterations": 20,
        "attempts": 1,
    }
    site.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, NS, PLURAL_TUNING_JOBS, name, {"status": status}
    )
    body = site.get(PLURAL_TUNING_JOBS, name)
    assert body is not None
    return body


def users_adapter(site: OperatorSite, name: str, owners: list[dict[str, Any]] | None = None) -> None:
    """A LoRAAdapter made with kubectl (not handed to the runtime), optionally owned by someone."""
    meta = {"ownerReferences": owners} if owners else {}
    site.create(
        PLURAL_LORA_ADAPTERS, name, {"baseModel": MODEL, "artifactURL": "pvc://shared/users/own"}, **meta
    )


def owner(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {"apiVersion": V, "kind": "TuningJob", "name": meta["name"], "uid": meta["uid"]}


@pytest.fixture
def site(tmp_path: Path, redis_server: Any) -> Iterator[OperatorSite]:
    s = OperatorSite(tmp_path, redis_server.url, "intent")
    try:
        yield s
    finally:
        s.close()


def test_the_attempt_is_in_the_stored_status_before_its_assignment_reaches_redis(site: OperatorSite) -> None:
    rt = site.restart()
    site.pool("tiny", volumes=JOB_STORAGE)
    seen: list[tuple[int, Any, Any]] = []  # (attempt pushed, stored status.attempts, stored Running)
    push = rt.bus.assign

    def assign(worker_id: str, a: Assignment) -> None:
        running = site.condition(a.job.split("/", 1)[1], "Running") or {}
        seen.append((a.attempt, site.status("ordered").get("attempts"), running.get("status")))
        push(worker_id, a)

    rt.bus.assign = assign  # type: ignore[method-assign]
    site.job("ordered")
    wait_for("the pool to grow", lambda: rt.backend.pools[f"{NS}/tiny"][1] >= 1)
    wid = site.ready_worker("tiny-pod-1", "tiny")
    a = wait_for("the assignment", lambda: rt.bus.pop_assignment(wid, timeout=0.2))
    assert a.attempt == 1
    assert seen == [(1, 1, "True")], seen


def test_status_says_published_only_once_the_adapter_exists_and_a_restart_republishes_once(
    site: OperatorSite,
) -> None:
    rt = site.restart()
    real_create = rt.api.create_namespaced_custom_object

    def api_down_for_adapters(group: str, version: str, ns: str, plural: str, body: Any, **kw: Any) -> Any:
        if plural == PLURAL_LORA_ADAPTERS:
            raise ApiException(status=503, reason="Service Unavailable")
        return real_create(group, version, ns, plural, body, **kw)

    rt.api.create_namespaced_custom_object = api_down_for_adapters  # type: ignore[method-assign]
    rt.submit_job(succeeded_job(site, "pub", publish="pub-adapter"))
    wait_for("the job in the core", lambda: f"{NS}/pub" in rt.core.jobs)
    time.sleep(1.0)  # rounds pass: the creation keeps failing
    assert site.get(PLURAL_LORA_ADAPTERS, "pub-adapter") is None
    assert "publishedAdapter" not in site.status("pub"), site.status("pub")

    # The operator restarts (the API takes the adapter now): published once, owned by the job.
    rt = site.restart()
    job = site.get(PLURAL_TUNING_JOBS, "pub")
    assert job is not None
    rt.submit_job(job)
    wait_for("publishedAdapter", lambda: site.status("pub").get("publishedAdapter") == "pub-adapter")
    made = site.get(PLURAL_LORA_ADAPTERS, "pub-adapter")
    assert made is not None and made["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert (site.condition("pub", "Published") or {}).get("reason") == Reason.PUBLISHED

    # Crashed after creating the adapter, before the status said so: taken as it is.
    job2 = succeeded_job(site, "pub2", publish="pub2-adapter")
    users_adapter(site, "pub2-adapter", owners=[owner(job2)])
    rt.submit_job(job2)
    wait_for("publishedAdapter", lambda: site.status("pub2").get("publishedAdapter") == "pub2-adapter")

    # Another restart: nothing is created, replaced or reported again.
    versions = {
        n: site.get(PLURAL_LORA_ADAPTERS, n)["metadata"]["resourceVersion"]
        for n in ("pub-adapter", "pub2-adapter")
    }  # type: ignore[index]
    statuses = {n: site.status(n) for n in ("pub", "pub2")}
    rt = site.restart()
    for n in ("pub", "pub2"):
        rt.submit_job(site.get(PLURAL_TUNING_JOBS, n))  # type: ignore[arg-type]
    wait_for("the jobs in the core", lambda: {f"{NS}/pub", f"{NS}/pub2"} <= set(rt.core.jobs))
    time.sleep(1.0)
    assert {n: site.get(PLURAL_LORA_ADAPTERS, n)["metadata"]["resourceVersion"] for n in versions} == versions  # type: ignore[index]
    assert {n: site.status(n) for n in statuses} == statuses


def test_a_publish_name_a_users_adapter_holds_becomes_a_condition_with_the_reason(site: OperatorSite) -> None:
    users_adapter(site, "mine")  # the user's own: no owner
    users_adapter(
        site,
        "theirs",
        owners=[{"apiVersion": V, "kind": "TuningJob", "name": "other", "uid": "uid-of-other"}],
    )
    rt = site.restart()
    rt.submit_job(succeeded_job(site, "wants-mine", publish="mine"))
    rt.submit_job(succeeded_job(site, "wants-theirs", publish="theirs"))
    for name, taken in (("wants-mine", "mine"), ("wants-theirs", "theirs")):
        c = wait_for(f"{name}: Published", lambda n=name: site.condition(n, "Published"))
        assert (c["status"], c["reason"]) == ("False", Reason.PUBLISH_NAME_TAKEN), c
        assert taken in c["message"] and "publishedAdapter" not in site.status(name)
        adapter = site.get(PLURAL_LORA_ADAPTERS, taken)
        assert adapter is not None and adapter["spec"]["artifactURL"] == "pvc://shared/users/own"
    assert site.condition("wants-mine", "Succeeded")["status"] == "True"  # type: ignore[index]
