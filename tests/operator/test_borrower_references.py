"""Cross-namespace sharing lends GPUs only (issue 39 item 3): the real operator (kopf over our handlers)
against the Kubernetes API emulator over HTTP and a real redis-server.

team-a's WarmPool admits team-b. A TuningJob or LoRAAdapter of team-b that names team-a's claims or
Secrets, or team-a's pods' identity, is refused (ForeignReference) and nothing of it reaches the pool:
no Secret of team-a is mounted for it. Before, team-b's job writing with team-a's S3 Secret had that
Secret mounted into team-a's pods and ran; its dataset on team-a's claim was read for it. What a
borrower may use (an image dataset, the default output in its own folder, its own artifacts there) is
not refused, and team-a's own job still has its Secret mounted (so the no-mount check can fail).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from elastune_contract.api.constants import GROUP, VERSION
from elastune_contract.vocabulary import Reason
from elastune_testing.emulator import start_emulator
from operator_process import start_operator, stop_operator
from operator_site import job_spec, wait_for

OWNER, GUEST = "team-a", "team-b"
MODEL = "test/model"
POOL = {
    "model": MODEL,
    "maxWarmGPUs": 1,
    "allowedNamespaces": [GUEST],
    "serving": {"maxLoras": 2},
    "volumes": [{"claimName": "jobs", "jobStorage": True}, {"claimName": "datasets"}],
}


class World:
    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.emulator = start_emulator(tmp / "emulator")
        self.api = config.new_client_from_config(config_file=str(self.emulator.kubeconfig_path))
        self.custom = client.CustomObjectsApi(self.api)
        self.create(OWNER, "warmpools", "WarmPool", "pool", POOL)
        self.log = tmp / "operator.log"
        self.operator = start_operator(
            self.emulator.kubeconfig_path,
            redis_url,
            f"borrow{time.time_ns()}",
            tmp / "pod-tmp",
            self.log,
            without_aws=True,
            ELASTUNE_REDIS_SECRET="",
        )

    def close(self) -> None:
        stop_operator(self.operator)
        self.emulator.stop()

    def create(self, ns: str, plural: str, kind: str, name: str, spec: dict[str, Any]) -> None:
        meta = {"name": name, "namespace": ns}
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": meta, "spec": spec}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, plural, body)

    def condition(self, ns: str, plural: str, name: str, ctype: str) -> dict[str, Any] | None:
        assert self.operator.poll() is None, self.log.read_text()
        obj = cast(dict[str, Any], self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, plural, name))
        return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)

    def mounted_secrets(self) -> set[str]:
        try:
            dep = client.AppsV1Api(self.api).read_namespaced_deployment("pool", OWNER)
        except ApiException as exc:
            if exc.status == 404:
                return set()
            raise
        body = self.api.sanitize_for_serialization(dep)
        return {
            v["secret"]["secretName"]
            for v in body["spec"]["template"]["spec"].get("volumes", [])
            if "secret" in v
        }


@pytest.fixture(scope="module")
def world(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("borrow"), redis_server.url)
    try:
        wait_for(
            "the WarmPool to be configured", lambda: w.condition(OWNER, "warmpools", "pool", "Ready"), 60
        )
        yield w
    finally:
        w.close()


def refused_job(world: World, name: str) -> dict[str, Any]:
    cond = wait_for(
        f"{name}'s Accepted condition", lambda: world.condition(GUEST, "tuningjobs", name, "Accepted")
    )
    assert (cond["status"], cond["reason"]) == ("False", Reason.FOREIGN_REFERENCE), cond
    failed = world.condition(GUEST, "tuningjobs", name, "Failed")
    assert failed is not None and failed["status"] == "True", failed
    return cond


def test_a_borrower_job_may_name_neither_the_owner_s_secrets_nor_its_claims(world: World) -> None:
    # team-a's own job with team-a's Secret: mounted into its pods (the check below can see a mount).
    own = {"uri": "s3://a-bucket/out/own", "secretName": "a-s3"}
    world.create(OWNER, "tuningjobs", "TuningJob", "own", job_spec(MODEL, output=own))
    wait_for("team-a's Secret mounted for team-a's job", lambda: "a-s3" in world.mounted_secrets())

    stolen = {"uri": "s3://a-bucket/out/b", "secretName": "a-s3-admin"}
    world.create(GUEST, "tuningjobs", "TuningJob", "secret", job_spec(MODEL, output=stolen))
    cond = refused_job(world, "secret")
    assert "secretName a-s3-admin" in cond["message"] and f"WarmPool {OWNER}/pool" in cond["message"], cond

    world.create(GUEST, "tuningjobs", "TuningJob", "claim", job_spec(MODEL, dataset="pvc://datasets/a.jsonl"))
    assert (
        "spec.dataset pvc://datasets/a.jsonl is on the pool's claim datasets"
        in refused_job(world, "claim")["message"]
    )

    world.create(
        GUEST, "tuningjobs", "TuningJob", "path", job_spec(MODEL, dataset="/mnt/pvc/datasets/a.jsonl")
    )
    assert "a path in the pool's pods" in refused_job(world, "path")["message"]

    world.create(
        GUEST, "tuningjobs", "TuningJob", "overwrite", job_spec(MODEL, output={"uri": "pvc://jobs/a/x"})
    )
    refused_job(world, "overwrite")

    # What a borrower may use: a dataset of the image and the default output (its own folder).
    world.create(GUEST, "tuningjobs", "TuningJob", "fine", job_spec(MODEL, dataset="examples/arith.jsonl"))
    cond = wait_for(
        "the borrower's own job accepted", lambda: world.condition(GUEST, "tuningjobs", "fine", "Accepted")
    )
    assert cond["status"] == "True", cond
    assert "a-s3-admin" not in world.mounted_secrets(), "team-b named it: it is never mounted for team-b"


def test_a_borrower_adapter_may_name_neither_the_owner_s_secrets_nor_its_claims(world: World) -> None:
    cases: dict[str, dict[str, Any]] = {
        "by-secret": {"artifactURL": "s3://a-bucket/adapters/x", "artifactSecret": "a-s3-reader"},
        "by-identity": {"artifactURL": "s3://a-bucket/adapters/x", "useAmbientCredentials": True},
        "by-claim": {"artifactURL": "pvc://datasets/adapters/x"},
        "other-folder": {"artifactURL": f"pvc://jobs/elastune/artifacts/{OWNER}/tuned"},
    }
    for name, spec in cases.items():
        world.create(
            GUEST, "loraadapters", "LoRAAdapter", name, {"baseModel": MODEL, "type": "promptTuning", **spec}
        )
    for name in cases:
        cond = wait_for(
            f"{name}'s Ready condition", lambda n=name: world.condition(GUEST, "loraadapters", n, "Ready")
        )
        assert (cond["status"], cond["reason"]) == ("False", Reason.FOREIGN_REFERENCE), (name, cond)
    # Its own jobs' artifacts on the pool's jobStorage claim are the borrower's to serve.
    own = {
        "baseModel": MODEL,
        "type": "promptTuning",
        "artifactURL": f"pvc://jobs/elastune/artifacts/{GUEST}/t",
    }
    world.create(GUEST, "loraadapters", "LoRAAdapter", "own-folder", own)
    cond = wait_for(
        "the borrower's own adapter judged",
        lambda: world.condition(GUEST, "loraadapters", "own-folder", "Ready"),
    )
    assert cond["reason"] != Reason.FOREIGN_REFERENCE, cond
    assert "a-s3-reader" not in world.mounted_secrets()


def test_the_apiserver_takes_use_ambient_credentials_for_s3_without_a_secret_only(world: World) -> None:
    ambient = {"useAmbientCredentials": True}
    bad = [
        ("loraadapters", "LoRAAdapter", {"baseModel": MODEL, "artifactURL": "pvc://jobs/a", **ambient}),
        (
            "tuningjobs",
            "TuningJob",
            job_spec(MODEL, output={"uri": "s3://out/x", "secretName": "s", **ambient}),
        ),
        ("warmpools", "WarmPool", {"model": "hf://org/m", "modelSource": ambient}),
    ]
    for plural, kind, spec in bad:
        with pytest.raises(ApiException) as info:
            world.create(OWNER, plural, kind, "ambient", spec)
        assert info.value.status == 422 and "useAmbientCredentials applies" in str(info.value.body), kind
    world.create(
        OWNER, "warmpools", "WarmPool", "s3-model", {"model": "s3://models/m", "modelSource": ambient}
    )
