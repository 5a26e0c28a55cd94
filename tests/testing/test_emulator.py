"""The Kubernetes API emulator behaves like an apiserver where the operator depends on it
(docs/design.md §6).

Everything goes over real HTTP: the sync `kubernetes` client through the emulator's kubeconfig, plain
urllib where the client hides what is being checked (Status bodies, watch streams), and a real
`kopf run` subprocess at the end.
"""

import itertools
import json
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from elastune_contract.api.constants import GROUP, PLURAL_TUNING_JOBS, PLURAL_WARM_POOLS, VERSION
from elastune_testing.emulator import EmulatorHandle, start_emulator
from elastune_testing.fixtures import k8s_emulator  # noqa: F401 - the fixture

TJ_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL_TUNING_JOBS}"
KSVC = ("serving.knative.dev", "v1", "services")
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def tuning_job(name: str = "job", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TuningJob",
        "metadata": {"name": name},
        "spec": {
            "model": "tiny-gpt2",
            "dataset": "/data/train.jsonl",
            "termination": {"maxIterations": 10},
            "deadline": "10m",
            **spec,
        },
    }


class Kube:
    """The sync kubernetes client on the emulator's kubeconfig, plus raw HTTP for what it hides."""

    def __init__(self, handle: EmulatorHandle) -> None:
        self.handle = handle
        self.api = config.new_client_from_config(config_file=str(handle.kubeconfig_path))
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)

    # TuningJobs in namespace "default" unless told.
    def create(self, body: dict[str, Any], ns: str = "default", **kwargs: Any) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL_TUNING_JOBS, body, **kwargs
        )

    def get(self, name: str, ns: str = "default") -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL_TUNING_JOBS, name)

    def patch(self, name: str, patch: Any, ns: str = "default") -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL_TUNING_JOBS, name, patch)

    def patch_status(self, name: str, patch: Any, ns: str = "default") -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, PLURAL_TUNING_JOBS, name, patch
        )

    def delete(self, name: str, ns: str = "default", **kwargs: Any) -> dict[str, Any]:
        return self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL_TUNING_JOBS, name, **kwargs
        )

    def http(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.handle.url + path, data=data, method=method, headers={"Content-Type": content_type}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stream(self, path: str, **params: str) -> Iterator[dict[str, Any]]:
        """The events of a watch stream as they come (a 5 s silence fails); closing hangs up."""
        query = urllib.parse.urlencode({"watch": "true", **params})
        with urllib.request.urlopen(f"{self.handle.url}{path}?{query}", timeout=5) as response:
            while line := response.readline():
                yield json.loads(line)

    def watch(self, path: str, count: int, **params: str) -> list[dict[str, Any]]:
        """Exactly the first `count` events of a watch stream."""
        events = list(itertools.islice(self.stream(path, **params), count))
        assert len(events) == count, f"the stream ended after {events}"
        return events


@pytest.fixture
def kube(k8s_emulator: EmulatorHandle) -> Iterator[Kube]:  # noqa: F811 - pytest fixture injection
    kube = Kube(k8s_emulator)
    yield kube
    kube.api.close()


def api_error(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
    with pytest.raises(client.ApiException) as info:
        call()
    return info.value.status, json.loads(info.value.body)


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# -- metadata --------------------------------------------------------------------------------------


def test_create_stamps_metadata_and_refuses_duplicates(kube: Kube):
    job = kube.create(tuning_job("a"))
    meta = job["metadata"]
    assert uuid.UUID(meta["uid"])
    assert RFC3339.fullmatch(meta["creationTimestamp"])
    assert meta["generation"] == 1
    assert meta["namespace"] == "default"
    assert meta["resourceVersion"].isdigit()
    assert kube.get("a") == job

    generated = kube.create({**tuning_job(), "metadata": {"generateName": "job-"}})
    assert re.fullmatch(r"job-[a-z0-9]{5}", generated["metadata"]["name"])
    assert generated["metadata"]["uid"] != meta["uid"]

    status, body = api_error(lambda: kube.create(tuning_job("a")))
    assert (status, body["kind"], body["reason"], body["details"]["name"]) == (
        409,
        "Status",
        "AlreadyExists",
        "a",
    )
    status, body = api_error(lambda: kube.create({**tuning_job(), "metadata": {}}))
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["details"]["causes"][0]["field"] == "metadata.name"
    status, body = api_error(lambda: kube.get("missing"))
    assert (status, body["reason"], body["details"]["name"], body["code"]) == (
        404,
        "NotFound",
        "missing",
        404,
    )


def warm_pool(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WarmPool",
        "metadata": {"name": name},
        "spec": {"model": "tiny-gpt2", "minWarmGPUs": 0, "maxWarmGPUs": 2, **spec},
    }


def test_resource_version_is_global_and_generation_tracks_spec_only(kube: Kube):
    # A WarmPool: its spec can change (a TuningJob's is immutable, a CEL transition rule).
    def patch(name: str, body: dict[str, Any], status: bool = False) -> dict[str, Any]:
        call = (
            kube.custom.patch_namespaced_custom_object_status
            if status
            else kube.custom.patch_namespaced_custom_object
        )
        return call(GROUP, VERSION, "default", PLURAL_WARM_POOLS, name, body)

    create = kube.custom.create_namespaced_custom_object
    a = create(GROUP, VERSION, "default", PLURAL_WARM_POOLS, warm_pool("a"))
    b = create(GROUP, VERSION, "default", PLURAL_WARM_POOLS, warm_pool("b"))
    rv = int(b["metadata"]["resourceVersion"])
    assert rv > int(a["metadata"]["resourceVersion"])  # one counter across objects

    def step(obj: dict[str, Any], generation: int) -> None:
        nonlocal rv
        assert int(obj["metadata"]["resourceVersion"]) > rv
        assert obj["metadata"]["generation"] == generation
        rv = int(obj["metadata"]["resourceVersion"])

    step(patch("a", {"spec": {"maxWarmGPUs": 3}}), 2)
    step(patch("a", {"metadata": {"labels": {"team": "x"}, "annotations": {"note": "y"}}}), 2)
    step(patch("a", {"metadata": {"finalizers": ["elastune.dev/finalizer"]}}), 2)
    step(patch("a", {"status": {"warmGPUs": 1}}, status=True), 2)
    step(patch("a", {"spec": {"minWarmGPUs": 1}}), 3)
    # A write that changes nothing is no write: same resourceVersion.
    unchanged = patch("a", {"metadata": {"labels": {"team": "x"}}})
    assert int(unchanged["metadata"]["resourceVersion"]) == rv
    # Server-set metadata cannot be overwritten by clients; a different uid is a failed precondition.
    kept = patch("a", {"metadata": {"generation": 99, "creationTimestamp": "2000-01-01T00:00:00Z"}})
    assert kept["metadata"]["generation"] == 3
    assert kept["metadata"]["creationTimestamp"] == a["metadata"]["creationTimestamp"]
    assert int(kept["metadata"]["resourceVersion"]) == rv
    assert api_error(lambda: patch("a", {"metadata": {"uid": "forged"}}))[0] == 409


def test_status_subresource_is_isolated_both_ways(kube: Kube):
    created = kube.create({**tuning_job("a"), "status": {"iterations": 5}})
    assert "status" not in created  # a create cannot set status

    kube.patch_status("a", {"status": {"iterations": 1}})
    # (A TuningJob's spec is immutable, so the main-resource writes here change metadata only.)
    main = kube.patch("a", {"metadata": {"labels": {"a": "b"}}, "status": {"iterations": 99}})
    assert main["metadata"]["labels"] == {"a": "b"}
    assert main["status"] == {"iterations": 1}

    status = kube.patch_status(
        "a", {"spec": {"deadline": "1h"}, "metadata": {"labels": {"x": "y"}}, "status": {"iterations": 2}}
    )
    assert status["status"] == {"iterations": 2}
    assert status["spec"]["deadline"] == "10m"
    assert status["metadata"]["labels"] == {"a": "b"}

    # PUT (replace) of the main resource keeps the stored status too.
    current = kube.get("a")
    current["metadata"]["labels"] = {"c": "d"}
    current["status"] = {"iterations": 50}
    replaced = kube.custom.replace_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL_TUNING_JOBS, "a", current
    )
    assert (replaced["metadata"]["labels"], replaced["status"]) == ({"c": "d"}, {"iterations": 2})

    # Without a status subresource, status is an ordinary field (kopf writes its peerings' status so).
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "default"}}
    created = kube.custom.create_cluster_custom_object(
        "kopf.dev", "v1", "clusterkopfpeerings", {**peering, "status": {"a": {}}}
    )
    assert created["status"] == {"a": {}}
    patched = kube.custom.patch_cluster_custom_object(
        "kopf.dev", "v1", "clusterkopfpeerings", "default", {"status": {"b": 1}}
    )
    assert patched["status"] == {"a": {}, "b": 1}


# -- schema ----------------------------------------------------------------------------------------


def test_invalid_tuningjob_is_rejected_with_422_naming_the_fields(kube: Kube):
    bad = tuning_job("bad", method="fineTuning", termination={"maxIterations": 0})
    status, body = api_error(lambda: kube.create(bad))
    assert (status, body["reason"], body["details"]["kind"], body["details"]["group"]) == (
        422,
        "Invalid",
        "TuningJob",
        GROUP,
    )
    fields = {cause["field"] for cause in body["details"]["causes"]}
    # An unsupported enum value blocks the CEL rules; the apiserver says so in a cause without a field.
    assert fields == {"spec.method", "spec.termination.maxIterations", "<nil>"}
    assert 'TuningJob.elastune.dev "bad" is invalid' in body["message"]
    assert api_error(lambda: kube.get("bad"))[0] == 404  # nothing stored

    kube.create(tuning_job("good"))
    status, body = api_error(lambda: kube.patch("good", {"spec": {"deadline": "soon"}}))
    assert status == 422
    # A pattern error does not block CEL, so the spec's immutability rule answers too, as on a cluster.
    assert [cause["field"] for cause in body["details"]["causes"]] == ["spec.deadline", "spec"]
    # The status is validated against the status schema, through /status.
    status, body = api_error(lambda: kube.patch_status("good", {"status": {"iterations": -1}}))
    assert status == 422
    assert [cause["field"] for cause in body["details"]["causes"]] == ["status.iterations"]
    assert "status" not in kube.get("good")


def test_unknown_fields_are_pruned_and_defaults_applied(kube: Kube):
    body = tuning_job("a", bogus=1, termination={"maxIterations": 3, "extra": True})
    body["unknownTopLevel"] = {"x": 1}
    job = kube.create(body)
    assert "unknownTopLevel" not in job
    assert "bogus" not in job["spec"]
    assert job["spec"]["termination"] == {"maxIterations": 3}
    assert job["spec"]["method"] == "promptTuning"
    assert job["spec"]["promptBank"] == "auto"
    assert job["spec"]["hyperparameters"] == {
        "batchSize": 8,
        "learningRate": "0.3",
        "optimizer": "adamw",
        "virtualTokens": 20,
    }
    # Pruned in patches and in status too (kopf's own status fields would be dropped the same way).
    patched = kube.patch_status("a", {"status": {"iterations": 1, "kopf": {"progress": {}}}})
    assert patched["status"] == {"iterations": 1}
    # kubectl's strict field validation refuses instead of pruning.
    status, body = api_error(lambda: kube.create(tuning_job("b", bogus=1), field_validation="Strict"))
    assert status == 400
    assert 'unknown field "spec.bogus"' in body["message"]


# -- patches ---------------------------------------------------------------------------------------


def test_merge_patch_json_patch_and_resource_version_preconditions(kube: Kube):
    job = kube.create({**tuning_job("a"), "metadata": {"name": "a", "labels": {"keep": "1", "drop": "1"}}})
    rv = job["metadata"]["resourceVersion"]
    path = TJ_PATH.format(ns="default") + "/a"

    status, merged = kube.http(
        "PATCH", path, {"metadata": {"labels": {"drop": None}}}, "application/merge-patch+json"
    )
    assert (status, merged["metadata"]["labels"]) == (200, {"keep": "1"})

    # kopf's finalizer patch: JSON patch guarded by a test of the resourceVersion.
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
    ]
    status, body = kube.http("PATCH", path, ops, "application/json-patch+json")
    assert (status, body["reason"]) == (422, "Invalid")  # rv is stale now
    ops[0]["value"] = merged["metadata"]["resourceVersion"]
    status, body = kube.http("PATCH", path, ops, "application/json-patch+json")
    assert (status, body["metadata"]["finalizers"]) == (200, ["x/y"])

    # A resourceVersion in a merge patch or a PUT is a precondition.
    status, body = kube.http(
        "PATCH",
        path,
        {"metadata": {"resourceVersion": rv}, "spec": {"deadline": "1h"}},
        "application/merge-patch+json",
    )
    assert (status, body["reason"]) == (409, "Conflict")
    stale = kube.get("a")
    stale["metadata"]["resourceVersion"] = rv
    assert kube.http("PUT", path, stale)[0] == 409
    # Strategic merge is for built-in kinds; custom resources answer 415 like the apiserver.
    assert kube.http("PATCH", path, {"spec": {}}, "application/strategic-merge-patch+json")[0] == 415


# -- deletion --------------------------------------------------------------------------------------


def test_finalizers_hold_deletion_until_removed(kube: Kube):
    created = kube.create(
        {**tuning_job("a"), "metadata": {"name": "a", "finalizers": ["elastune.dev/finalizer"]}}
    )
    deleting = kube.delete("a")
    meta = deleting["metadata"]
    assert RFC3339.fullmatch(meta["deletionTimestamp"])
    assert int(meta["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    assert kube.get("a")["metadata"]["deletionTimestamp"] == meta["deletionTimestamp"]
    # A second DELETE changes nothing; no new finalizer may be added while deleting.
    assert kube.delete("a")["metadata"]["resourceVersion"] == meta["resourceVersion"]
    status, body = api_error(
        lambda: kube.patch("a", {"metadata": {"finalizers": ["elastune.dev/finalizer", "x/y"]}})
    )
    assert (status, body["details"]["causes"][0]["field"]) == (422, "metadata.finalizers")
    # Other writes still work; emptying the finalizers lets the object go.
    assert kube.patch_status("a", {"status": {"iterations": 1}})["status"] == {"iterations": 1}
    kube.patch("a", {"metadata": {"finalizers": None}})
    assert api_error(lambda: kube.get("a"))[0] == 404
    # Without finalizers, DELETE removes at once.
    kube.create(tuning_job("b"))
    kube.delete("b")
    assert api_error(lambda: kube.get("b"))[0] == 404


def test_owner_references_are_garbage_collected(kube: Kube):
    def owned_by(*owners: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "apiVersion": o["apiVersion"],
                "kind": o["kind"],
                "name": o["metadata"]["name"],
                "uid": o["metadata"]["uid"],
            }
            for o in owners
        ]

    pool = kube.custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        "default",
        PLURAL_WARM_POOLS,
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "WarmPool",
            "metadata": {"name": "pool"},
            "spec": {"model": "m"},
        },
    )
    other = kube.create(tuning_job("other"))
    ksvc = kube.custom.create_namespaced_custom_object(
        *KSVC[:2],
        "default",
        KSVC[2],
        {
            "apiVersion": "serving.knative.dev/v1",
            "kind": "Service",
            "metadata": {"name": "pool", "ownerReferences": owned_by(pool)},
            "spec": {"template": {}},
        },
    )

    def pod(name: str, *owners: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "ownerReferences": owned_by(*owners)},
            "spec": {"containers": [{"name": "worker", "image": "worker"}]},
        }

    kube.core.create_namespaced_pod("default", pod("chained", ksvc))
    kube.core.create_namespaced_pod("default", pod("shared", pool, other))
    kube.core.create_namespaced_pod("default", pod("unrelated"))

    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL_WARM_POOLS, "pool")
    assert (
        api_error(lambda: kube.custom.get_namespaced_custom_object(*KSVC[:2], "default", KSVC[2], "pool"))[0]
        == 404
    )
    assert {p.metadata.name for p in kube.core.list_namespaced_pod("default").items} == {
        "shared",
        "unrelated",
    }
    # A dependent with another live owner stays; only the dangling reference goes.
    shared = kube.core.read_namespaced_pod("shared", "default")
    assert [ref.uid for ref in shared.metadata.owner_references] == [other["metadata"]["uid"]]

    # Orphan propagation keeps the dependents and drops their references to the owner.
    kube.delete("other", propagation_policy="Orphan")
    assert not kube.core.read_namespaced_pod("shared", "default").metadata.owner_references


# -- reads -----------------------------------------------------------------------------------------


def test_label_and_field_selectors(kube: Kube):
    for name, labels in {
        "a": {"pool": "p1", "tier": "gpu"},
        "b": {"pool": "p2", "tier": "gpu"},
        "c": {"pool": "p3"},
        "d": {},
    }.items():
        kube.create({**tuning_job(name), "metadata": {"name": name, "labels": labels}})

    def names(**params: str) -> list[str]:
        listing = kube.custom.list_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL_TUNING_JOBS, **params
        )
        return [item["metadata"]["name"] for item in listing["items"]]

    assert names() == ["a", "b", "c", "d"]
    assert names(label_selector="pool=p1") == ["a"]
    assert names(label_selector="pool==p1") == ["a"]
    assert names(label_selector="pool!=p1") == ["b", "c", "d"]
    assert names(label_selector="pool in (p1, p3)") == ["a", "c"]
    assert names(label_selector="pool notin (p1,p3)") == ["b", "d"]
    assert names(label_selector="tier") == ["a", "b"]
    assert names(label_selector="!tier") == ["c", "d"]
    assert names(label_selector="tier=gpu,pool in (p2,p3)") == ["b"]
    assert names(field_selector="metadata.name=c") == ["c"]
    assert names(field_selector="metadata.name!=c,metadata.namespace=default") == ["a", "b", "d"]
    assert api_error(lambda: names(label_selector="pool in p1"))[0] == 400
    assert api_error(lambda: names(field_selector="spec.model=x"))[0] == 400
    # Cluster-wide lists span namespaces; namespaced lists do not.
    kube.create(tuning_job("e"), ns="other")
    everywhere = kube.custom.list_cluster_custom_object(
        GROUP, VERSION, PLURAL_TUNING_JOBS, label_selector="!tier"
    )
    assert [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in everywhere["items"]] == [
        ("default", "c"),
        ("default", "d"),
        ("other", "e"),
    ]


def test_watch_streams_events_with_resource_versions(kube: Kube):
    path = TJ_PATH.format(ns="default")
    start = kube.http("GET", path)[1]["metadata"]["resourceVersion"]
    kube.create({**tuning_job("a"), "metadata": {"name": "a", "labels": {"watched": "yes"}}})
    modified = kube.patch_status("a", {"status": {"iterations": 1}})
    kube.create(tuning_job("b"), ns="elsewhere")
    unlabelled = kube.patch("a", {"metadata": {"labels": {"watched": None}}})
    kube.delete("a")

    # Resuming from a resourceVersion replays exactly what happened after it.
    events = kube.watch(path, 4, resourceVersion=start)
    assert [event["type"] for event in events] == ["ADDED", "MODIFIED", "MODIFIED", "DELETED"]
    versions = [int(event["object"]["metadata"]["resourceVersion"]) for event in events]
    assert versions == sorted(versions) and versions[0] > int(start)
    assert events[1]["object"] == modified
    # A label-selected watch sees the object leave the selection as DELETED.
    selected = kube.watch(path, 3, resourceVersion=start, labelSelector="watched=yes")
    assert [event["type"] for event in selected] == ["ADDED", "MODIFIED", "DELETED"]
    assert selected[2]["object"]["metadata"]["resourceVersion"] == unlabelled["metadata"]["resourceVersion"]

    # A fresh watch gets the current state as ADDED; initial events end with a bookmark when asked.
    kube.create(tuning_job("c"))
    initial = kube.watch(path, 2, sendInitialEvents="true", allowWatchBookmarks="true")
    assert [(e["type"], e["object"]["metadata"].get("name")) for e in initial] == [
        ("ADDED", "c"),
        ("BOOKMARK", None),
    ]
    assert initial[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}

    # Then live events, as they happen.
    received: queue.Queue[dict[str, Any]] = queue.Queue()

    def consume() -> None:
        for event in kube.stream(path):
            received.put(event)
            if event["type"] == "MODIFIED":
                return

    watcher = threading.Thread(target=consume, daemon=True)
    watcher.start()
    assert received.get(timeout=5)["type"] == "ADDED"  # the stream is open
    kube.patch("c", {"metadata": {"labels": {"step": "1"}}})
    event = received.get(timeout=5)
    assert (event["type"], event["object"]["metadata"]["labels"]) == ("MODIFIED", {"step": "1"})
    watcher.join(5)


def test_watch_from_a_resource_version_older_than_the_log_is_gone(tmp_path: Path):
    with start_emulator(tmp_path, max_event_log=4) as handle:
        kube = Kube(handle)
        for index in range(6):
            kube.create(tuning_job(f"j{index}"))
        (event,) = kube.watch(TJ_PATH.format(ns="default"), 1, resourceVersion="1")
        assert event["type"] == "ERROR"
        assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
        kube.api.close()


def test_namespaces_and_discovery(kube: Kube):
    kube.create(tuning_job("a"), ns="team-a")
    assert {ns.metadata.name for ns in kube.core.list_namespace().items} == {"default", "team-a"}
    namespace = kube.core.read_namespace("team-a")
    assert namespace.status.phase == "Active" and namespace.metadata.uid
    # Deleting a namespace deletes what is in it.
    kube.core.delete_namespace("team-a")
    assert api_error(lambda: kube.get("a", ns="team-a"))[0] == 404
    assert {ns.metadata.name for ns in kube.core.list_namespace().items} == {"default"}

    def resources(path: str) -> set[str]:
        return {resource["name"] for resource in kube.http("GET", path)[1]["resources"]}

    assert {"tuningjobs", "tuningjobs/status", "warmpools/status", "loraadapters/status"} <= resources(
        f"/apis/{GROUP}/{VERSION}"
    )
    assert {"services", "services/status", "revisions"} <= resources("/apis/serving.knative.dev/v1")
    assert {"kopfpeerings", "clusterkopfpeerings"} <= resources("/apis/kopf.dev/v1")
    assert {"pods", "pods/status", "events", "namespaces"} <= resources("/api/v1")
    assert "events" in resources("/apis/events.k8s.io/v1")
    crds = kube.http("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")[1]["items"]
    assert {crd["metadata"]["name"] for crd in crds} == {
        f"{PLURAL_TUNING_JOBS}.{GROUP}",
        f"{PLURAL_WARM_POOLS}.{GROUP}",
        f"loraadapters.{GROUP}",
    }


def test_standalone_subprocess_serves_the_api(tmp_path: Path):
    with start_emulator(tmp_path, subprocess_mode=True) as handle:
        assert handle.process is not None and handle.emulator is None
        kube = Kube(handle)
        created = kube.create(tuning_job("a"))
        assert created["spec"]["method"] == "promptTuning"
        assert kube.http("GET", "/version")[0] == 200
        kube.api.close()
    assert handle.process.poll() is not None


# -- the real operator -----------------------------------------------------------------------------

OPERATOR = """
import kopf


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.persistence.finalizer = "elastune.dev/test-finalizer"
    # The schema prunes status.kopf, so kopf's state goes into annotations (as on a real cluster).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="elastune.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="elastune.dev")


@kopf.on.create("elastune.dev", "v1alpha1", "tuningjobs")
def created(patch, **_):
    patch.status["iterations"] = 7


@kopf.on.delete("elastune.dev", "v1alpha1", "tuningjobs")
def deleted(**_):
    pass
"""


def test_real_kopf_operator_handles_create_and_delete(kube: Kube, tmp_path: Path):
    operator = tmp_path / "operator.py"
    operator.write_text(textwrap.dedent(OPERATOR))
    log = tmp_path / "kopf.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kopf",
                "run",
                "--standalone",
                "--all-namespaces",
                "--verbose",
                str(operator),
            ],
            env=kube.handle.env(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        kube.create(tuning_job("a"))
        job = wait_for(
            lambda: (obj := kube.get("a")).get("status", {}).get("iterations") == 7 and obj,
            what=f"kopf to write the status; kopf log:\n{log.read_text()}",
        )
        assert job["metadata"]["finalizers"] == ["elastune.dev/test-finalizer"]
        assert job["metadata"]["generation"] == 1  # kopf's annotations and status did not bump it
        kube.delete("a")

        def gone() -> bool:
            try:
                kube.get("a")
            except client.ApiException as error:
                return error.status == 404
            return False

        wait_for(gone, what=f"kopf to remove its finalizer; kopf log:\n{log.read_text()}")
        assert process.poll() is None, log.read_text()
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    text = log.read_text()
    assert "Handler 'created' succeeded" in text and "Handler 'deleted' succeeded" in text, text
