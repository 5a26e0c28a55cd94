"""Deletion removes what a TuningJob owns (spec.retention), and nothing else (issue 39 item 7).

The real kopf operator (``kopf run -m elastune_operator.k8s.handlers``) against the Kubernetes API
emulator over HTTP, a real redis-server, and the S3 emulator (moto's server, credentials enforced)
driven by boto3. The test plays the worker's part with the worker's own code (ownership.claim_attempt
writes the owner markers, then files are written and uploaded), and a Job stand-in plays the kubelet for
the cleanup Job: it runs the Job's container command as a process whose claim root holds only the claims
the Job mounts (of the Job's namespace) and whose Secret root holds the Secrets it mounts, read from
the API; then it writes the Job's status as the Job controller does (Complete, or Failed after
backoffLimit + 1 failed pods).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")
pytest.importorskip("moto")

from kubernetes import client, config
from kubernetes.client.rest import ApiException

import s3_emulator
from elastune_contract import storage
from elastune_contract.api.constants import (
    DEFAULT_PVC_ROOT,
    DEFAULT_S3_SECRETS_ROOT,
    GROUP,
    PVC_ROOT_ENV,
    S3_SECRETS_ROOT_ENV,
    VERSION,
)
from elastune_contract.api.tuningjob import TuningJob
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.vocabulary import Reason
from elastune_operator.control.resources import durable_storage
from elastune_operator.k8s.retention import CLEANUP_LABEL, Plan
from elastune_testing.emulator import start_emulator
from elastune_worker.storage import ownership, s3
from operator_process import start_operator, stop_operator
from operator_site import job_spec, wait_for

NS = "default"
MODEL = "test/model"
BUCKET = "tuned"
POOL = {"model": MODEL, "maxWarmGPUs": 1, "volumes": [{"claimName": "jobs", "jobStorage": True}]}


class JobStandIn(threading.Thread):
    """Runs each cleanup Job's pod as a process and writes the Job's outcome (batch/v1 semantics)."""

    def __init__(self, api: client.ApiClient, claims: Path, pods: Path) -> None:
        super().__init__(daemon=True)
        self.batch, self.core = client.BatchV1Api(api), client.CoreV1Api(api)
        self.claims, self.pods = claims, pods
        self.stopped = threading.Event()
        self.logs: list[str] = []
        self.started: set[str] = set()
        self.intent: dict[str, bool] = {}

    def run(self) -> None:
        while not self.stopped.wait(0.2):
            try:
                jobs = self.batch.list_namespaced_job(NS, label_selector=CLEANUP_LABEL).items
            except ApiException:
                continue
            for job in jobs:
                body: dict[str, Any] = self.batch.api_client.sanitize_for_serialization(job)
                uid = body["metadata"]["uid"]
                if not (body.get("status") or {}).get("conditions") and uid not in self.started:
                    self.started.add(uid)
                    threading.Thread(target=self._run, args=(body,), daemon=True).start()

    def _pod_root(self, name: str, pod: dict[str, Any]) -> tuple[Path, Path]:
        root = self.pods / name
        pvc, secrets = root / "pvc", root / "secrets"
        pvc.mkdir(parents=True, exist_ok=True)
        secrets.mkdir(exist_ok=True)
        volumes = {v["name"]: v for v in pod["volumes"]}
        for mount in pod["containers"][0]["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume:  # a claim of the pod's own namespace, nothing else
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert mount["mountPath"] == f"{DEFAULT_PVC_ROOT}/{claim}"
                (self.claims / NS / claim).mkdir(parents=True, exist_ok=True)
                if not (pvc / claim).exists():
                    (pvc / claim).symlink_to(self.claims / NS / claim)
            elif "secret" in volume:
                name_ = volume["secret"]["secretName"]
                assert mount["mountPath"] == f"{DEFAULT_S3_SECRETS_ROOT}/{name_}"
                (secrets / name_).mkdir(exist_ok=True)
                try:
                    data = self.core.read_namespaced_secret(name_, NS).data or {}
                except ApiException:
                    assert volume["secret"].get("optional"), "a missing Secret would block the pod"
                    data = {}
                for key, value in data.items():
                    (secrets / name_ / key).write_bytes(base64.b64decode(value))
        return pvc, secrets

    def _run(self, job: dict[str, Any]) -> None:
        name, spec = job["metadata"]["name"], job["spec"]
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        # Intent before effect: the resource already records the plan this Job carries out.
        (owner,) = job["metadata"]["ownerReferences"]
        plural = {"TuningJob": "tuningjobs", "LoRAAdapter": "loraadapters"}[owner["kind"]]
        body = client.CustomObjectsApi(self.batch.api_client).get_namespaced_custom_object(
            GROUP, VERSION, NS, plural, owner["name"]
        )
        plan = Plan.recorded(body["metadata"].get("annotations"))
        targets = plan.targets if plan else []
        self.intent[owner["name"]] = bool(targets) and container["args"][-len(targets) :] == targets
        pvc, secrets = self._pod_root(name, pod)
        env = {**os.environ, PVC_ROOT_ENV: str(pvc), S3_SECRETS_ROOT_ENV: str(secrets)}
        env = {k: v for k, v in env.items() if not k.startswith("AWS_")}  # only what the Secret says
        assert container["command"][0] == "python"
        cmd = [sys.executable, *container["command"][1:], *container["args"]]
        failed = 0
        for _ in range(spec["backoffLimit"] + 1):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
            self.logs.append(done.stdout + done.stderr)
            if done.returncode == 0:
                break
            failed += 1
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ok = failed <= spec["backoffLimit"]
        cond = {"type": "Complete" if ok else "Failed", "status": "True", "lastTransitionTime": now}
        if not ok:
            cond["reason"] = "BackoffLimitExceeded"
        status = {"succeeded": int(ok), "failed": failed, "conditions": [cond]}
        self.batch.patch_namespaced_job_status(name, NS, {"status": status})


class Site:
    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.tmp = tmp
        self.s3 = s3_emulator.start(tmp / "moto.log")
        self.s3.client().create_bucket(Bucket=BUCKET)
        self.emulator = start_emulator(tmp / "emulator")
        self.api = config.new_client_from_config(config_file=str(self.emulator.kubeconfig_path))
        self.custom, self.core = client.CustomObjectsApi(self.api), client.CoreV1Api(self.api)
        self.claims = tmp / "claims"  # per namespace, per claim: what a ReadWriteMany volume holds
        self.standin = JobStandIn(self.api, self.claims, tmp / "pods")
        self.standin.start()
        for name in ("s3-creds", "s3-stuck"):
            self.core.create_namespaced_secret(NS, {"metadata": {"name": name}, "data": self.secret_data()})
        self.pool = self.create("warmpools", "WarmPool", "pool", POOL)
        self.log = tmp / "operator.log"
        self.operator = start_operator(
            self.emulator.kubeconfig_path,
            redis_url,
            f"ret{time.time_ns()}",
            tmp / "pod-tmp",
            self.log,
            without_aws=True,
            ELASTUNE_REDIS_SECRET="",
            ELASTUNE_PROOF_KEY="retention-test",
        )

    def close(self) -> None:
        stop_operator(self.operator)
        self.standin.stopped.set()
        self.emulator.stop()
        self.s3.stop()

    def secret_data(self, **override: str) -> dict[str, str]:
        return {k: base64.b64encode(v.encode()).decode() for k, v in self.s3.secret_keys(**override).items()}

    def create(self, plural: str, kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, NS, plural, body
        )
        return created

    def get(self, name: str, plural: str = "tuningjobs") -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, plural, name)
            return found
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def job(self, name: str, retention: dict[str, str], secret: str = "s3-creds") -> None:
        """A TuningJob with an s3:// output."""
        output = {"uri": f"s3://{BUCKET}/out/{name}", "secretName": secret}
        self.create("tuningjobs", "TuningJob", name, job_spec(MODEL, output=output, retention=retention))

    def accepted(self, name: str) -> TuningJob:
        """The job once the operator holds its finalizer."""
        body = wait_for(
            f"{name} accepted", lambda: (b := self.get(name)) and b["metadata"].get("finalizers") and b, 60
        )
        return TuningJob.model_validate(body)

    def events(self, name: str, reason: str) -> list[Any]:
        items = self.core.list_namespaced_event(NS).items
        return [e for e in items if e.involved_object.name == name and e.reason == reason]


def write_as_worker(site: Site, job: TuningJob, uid: str | None = None) -> dict[str, Any]:
    """What rank 0 of an attempt writes: owner markers first, then checkpoints, the staged artifact
    and its upload. ``uid``: as another owner would (a job of the same name that existed before)."""
    uid = uid or job.metadata.uid or ""
    placed = durable_storage(job, WarmPool.model_validate(site.pool))
    root = site.claims / NS
    ckpt = storage.local_path(storage.join(placed.checkpoints, uid), root=root)
    staged = storage.local_path(placed.artifact, root=root)
    out = job.spec.output
    assert out is not None and out.uri is not None
    # The worker reads the Secret its pool mounts (ELASTUNE_S3_SECRETS_ROOT, set by the fixture).
    ownership.claim_attempt(
        f"{NS}/{job.metadata.name}", uid, str(ckpt), str(staged), out.uri, out.secret_name
    )
    (ckpt / "step-10").mkdir(parents=True)
    (ckpt / "step-10" / "state.pt").write_bytes(b"weights")
    staged.mkdir(parents=True, exist_ok=True)
    (staged / "adapter_config.json").write_text("{}")
    s3.upload(staged, out.uri, out.secret_name)
    return {"checkpoints": ckpt, "staged": staged, "s3": out.uri}


def s3_keys(site: Site, prefix: str) -> list[str]:
    listed = site.s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("retention")
    s = Site(tmp, redis_server.url)
    # The worker pods' Secret mounts, for the test's worker part (the Job stand-in makes its own).
    secrets = tmp / "worker-secrets"
    s.s3.secret_dir(secrets, "s3-creds")
    s.s3.secret_dir(secrets, "s3-stuck")
    mp = pytest.MonkeyPatch()
    mp.setenv(S3_SECRETS_ROOT_ENV, str(secrets))
    try:
        yield s
    finally:
        mp.undo()
        s.close()


#: name -> (spec.retention, the S3 Secret its output and cleanup use)
JOBS = {
    "tj": ({"checkpoints": "Delete", "artifact": "Delete"}, "s3-creds"),
    "tj-2": ({"checkpoints": "Retain"}, "s3-creds"),  # a similar prefix, another owner; kept
    "kept": ({"checkpoints": "Retain"}, "s3-creds"),  # artifact: Retain is the default
    "again": ({"checkpoints": "Delete"}, "s3-creds"),  # a job of this name existed before
    "stuck": ({"checkpoints": "Delete", "artifact": "Delete"}, "s3-stuck"),  # keys revoked: cleanup fails
    "served": ({}, "s3-creds"),  # its artifact stays with the job; the adapter it published says Delete
}


@pytest.fixture(scope="module")
def files(site: Site) -> dict[str, dict[str, Any]]:
    """Every job accepted and written to as its worker would, then all but tj-2 deleted at once (the
    operator reclaims concurrently); what each wrote."""
    for name, (retention, secret) in JOBS.items():
        site.job(name, retention, secret)
    jobs = {name: site.accepted(name) for name in JOBS}
    with ThreadPoolExecutor(4) as pool:  # as the jobs' workers would, at the same time
        futures = {n: pool.submit(write_as_worker, site, job) for n, job in jobs.items() if n != "again"}
    written = {name: f.result() for name, f in futures.items()}
    written["again-earlier"] = write_as_worker(site, jobs["again"], uid="uid-of-an-earlier-again")
    written["again"] = write_as_worker(site, jobs["again"])  # takes over the artifact it replaces
    # A user's own files beside them, written without Elastune: no marker, never anyone's to delete.
    site.s3.client().put_object(Bucket=BUCKET, Key="out/tj-user/adapter_config.json", Body=b"{}")
    assert s3_keys(site, "out/tj/") and s3_keys(site, "out/tj-2/")
    # The adapter "served" published (owned by the job, as the operator creates it), and one a user
    # registered for their own artifact: both say Delete.
    owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TuningJob", "name": "served"}
    owner["uid"] = jobs["served"].metadata.uid or ""
    for name, url, owners in (("pub", "out/served", [owner]), ("byo", "out/tj-user", [])):
        spec = {"baseModel": MODEL, "artifactURL": f"s3://{BUCKET}/{url}", "artifactSecret": "s3-creds"}
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LoRAAdapter", "spec": spec}
        body["metadata"] = {"name": name, "ownerReferences": owners}
        body["spec"]["retention"] = {"artifact": "Delete"}
        site.custom.create_namespaced_custom_object(GROUP, VERSION, NS, "loraadapters", body)
        wait_for(f"{name} accepted", lambda n=name: (site.get(n, "loraadapters") or {}).get("status"), 60)
    # stuck's keys are revoked after it ran: its cleanup is refused by S3.
    revoked = site.secret_data(AWS_SECRET_ACCESS_KEY="revoked")
    site.core.patch_namespaced_secret("s3-stuck", NS, {"data": revoked})
    deleted = [("tuningjobs", n) for n in JOBS if n not in ("tj-2", "served")]
    deleted += [("loraadapters", "pub"), ("loraadapters", "byo")]
    for plural, name in deleted:
        site.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, plural, name)
    for plural, name in deleted:  # bounded: each finalizer goes, even where the cleanup failed
        wait_for(f"{name} gone", lambda p=plural, n=name: site.get(n, p) is None, 60)
    return written


def test_deleting_a_job_removes_its_checkpoints_and_artifact_and_nothing_of_another_owner(
    site: Site, files: dict[str, dict[str, Any]]
) -> None:
    mine, theirs = files["tj"], files["tj-2"]
    assert not mine["checkpoints"].exists() and not mine["staged"].exists()
    assert s3_keys(site, "out/tj/") == [] and s3_keys(site, "out/tj.") == []  # objects and marker
    assert theirs["checkpoints"].exists() and theirs["staged"].exists()
    assert s3_keys(site, "out/tj-2/") == ["out/tj-2/adapter_config.json"]
    assert s3_keys(site, "out/tj-user/") == ["out/tj-user/adapter_config.json"]
    assert site.events("tj", Reason.STORAGE_RECLAIMED)
    # Every cleanup Job ran a plan its resource had recorded before the Job existed.
    assert site.standin.intent == {"tj": True, "again": True, "stuck": True, "pub": True}


def test_retain_keeps_them_and_runs_no_cleanup(site: Site, files: dict[str, dict[str, Any]]) -> None:
    assert files["kept"]["checkpoints"].exists() and files["kept"]["staged"].exists()
    assert s3_keys(site, "out/kept/") == ["out/kept/adapter_config.json"]
    jobs = client.BatchV1Api(site.api).list_namespaced_job(NS, label_selector=f"{CLEANUP_LABEL}=kept")
    assert jobs.items == []


def test_files_of_an_earlier_job_of_the_same_name_are_not_the_new_ones(
    site: Site, files: dict[str, dict[str, Any]]
) -> None:
    assert not files["again"]["checkpoints"].exists() and not files["again"]["staged"].exists()
    assert files["again-earlier"]["checkpoints"].exists()
    assert s3_keys(site, "out/again/") == ["out/again/adapter_config.json"]  # artifact: Retain


def test_a_failing_cleanup_ends_with_a_warning_naming_what_was_left(
    site: Site, files: dict[str, dict[str, Any]]
) -> None:
    (event,) = site.events("stuck", Reason.STORAGE_LEFT)
    assert event.type == "Warning"
    assert f"s3://{BUCKET}/out/stuck" in event.message and "failed" in event.message
    assert s3_keys(site, "out/stuck/") == ["out/stuck/adapter_config.json"]
    assert any("StorageAccessDenied" in log for log in site.standin.logs)


def test_an_adapter_deletes_the_artifact_its_job_published_never_a_users(
    site: Site, files: dict[str, dict[str, Any]]
) -> None:
    assert s3_keys(site, "out/served/") == [] and s3_keys(site, "out/served.") == []
    assert s3_keys(site, "out/tj-user/") == ["out/tj-user/adapter_config.json"]
    assert files["served"]["checkpoints"].exists()  # the adapter owns the artifact, not the checkpoints
