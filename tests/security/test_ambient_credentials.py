"""No implicit cloud identity, and no artifact replaced by a job that did not write it (issue 39 item 3),
against the S3 emulator (moto's server, credentials enforced; tests/s3_emulator.py) through boto3.

- With no Secret named, every s3:// transfer (an adapter's download, a job's upload, the bucket check,
  a WarmPool's model fetch) is refused with StorageCredentialsUnset even while an identity is around
  (the AWS_* environment stands for a node's instance profile or IRSA role); before, boto3's default
  chain silently used it. With ``useAmbientCredentials`` (AMBIENT_CREDENTIALS) the same transfer works.
- A job whose s3:// output prefix another namespace's job marked (storage/ownership.py) is refused
  (OutputNotOurs) before it writes, and the prefix keeps its owner; before, the job ran and overwrote it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")

import s3_emulator
from elastune_contract.api.constants import AMBIENT_CREDENTIALS, S3_SECRETS_ROOT_ENV
from elastune_contract.api.loraadapter import LoRAAdapter
from elastune_contract.api.resources import InvalidResource, parse_resource
from elastune_contract.protocol import Assignment
from elastune_contract.vocabulary import Reason
from elastune_worker.model_fetch import FetchError, fetch
from elastune_worker.server.outcomes import AssignmentFailed
from elastune_worker.server.training_plan import plan_training
from elastune_worker.storage import ownership, s3

BUCKET = "ambient"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3_emulator.S3Emulator]:
    emu = s3_emulator.start(tmp_path_factory.mktemp("s3-emulator") / "moto.log")
    emu.client().create_bucket(Bucket=BUCKET)
    emu.client().put_object(Bucket=BUCKET, Key="adapter/adapter_config.json", Body=b"{}")
    yield emu
    emu.stop()


@pytest.fixture
def identity(emulator: s3_emulator.S3Emulator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The node's identity, reachable through boto3's default chain (as an instance profile would be);
    returns a Secret root holding the Secret "team-b-s3"."""
    for key, value in emulator.secret_keys().items():
        monkeypatch.setenv(key, value)
    root = emulator.secret_dir(tmp_path / "secrets", "team-b-s3")
    monkeypatch.setenv(S3_SECRETS_ROOT_ENV, str(root))
    return root


def test_no_secret_named_never_falls_back_to_the_pod_s_identity(identity: Path, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/adapter"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "adapter_config.json").write_text("{}")
    for transfer in (
        lambda: s3.download(url, None, tmp_path / "cache"),
        lambda: s3.upload(tmp_path / "out", f"s3://{BUCKET}/written", None),
        lambda: s3.check_bucket(url, None),
    ):
        with pytest.raises(s3.StorageError) as info:
            transfer()
        assert info.value.reason == Reason.STORAGE_CREDENTIALS_UNSET
        assert "useAmbientCredentials" in str(info.value)
    with pytest.raises(FetchError) as fetched:
        fetch(url, tmp_path / "models")
    assert fetched.value.reason == Reason.MODEL_ACCESS_DENIED and "useAmbientCredentials" in str(
        fetched.value
    )
    # Asked for explicitly, the same identity serves.
    got = s3.download(url, AMBIENT_CREDENTIALS, tmp_path / "cache")
    assert (got / "adapter_config.json").read_text() == "{}"


def test_the_setting_is_for_s3_without_a_secret_only() -> None:
    base = {"apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": "a"}}
    ok = {"baseModel": "m", "artifactURL": "s3://b/a", "useAmbientCredentials": True}
    adapter = parse_resource({**base, "spec": ok})
    assert isinstance(adapter, LoRAAdapter) and adapter.spec.use_ambient_credentials
    for spec in ({**ok, "artifactURL": "pvc://c/a"}, {**ok, "artifactSecret": "s"}):
        with pytest.raises(InvalidResource, match="useAmbientCredentials"):
            parse_resource({**base, "spec": spec})


def test_the_model_fetch_job_uses_the_pod_s_identity_only_when_the_pool_asks() -> None:
    from elastune_contract.api.warmpool import WarmPool
    from elastune_operator.k8s.model_fetch import job_manifest

    def args(source: dict[str, Any]) -> list[str]:
        meta = {"name": "p", "namespace": "team-a"}
        pool = WarmPool.model_validate({"metadata": meta, "spec": {"model": "s3://models/m", **source}})
        container = job_manifest(pool)["spec"]["template"]["spec"]["containers"][0]
        return list(container["args"])

    assert "--s3-secret" not in args({}), "no setting: the fetcher is told no credentials (refused)"
    got = args({"modelSource": {"useAmbientCredentials": True}})
    assert got[got.index("--s3-secret") + 1] == AMBIENT_CREDENTIALS


def assignment(tmp_path: Path, job: str, output: dict[str, Any]) -> Assignment:
    spec = {"model": "m", "dataset": "d.jsonl", "termination": {"maxIterations": 1}, "deadline": "1m"}
    return Assignment(
        job=job, attempt=1, rank=0, world=1, model="m", spec={**spec, "output": output}, dataset="d.jsonl",
        comm_job=f"{job}:1", checkpoint_dir=str(tmp_path / job / "ckpt"),
        artifact_dir=str(tmp_path / job / "staged"), owner_uid=f"uid-{job}",
    )  # fmt: skip


def test_a_job_never_replaces_an_artifact_another_namespace_wrote(
    identity: Path, emulator: s3_emulator.S3Emulator, tmp_path: Path
) -> None:
    url = f"s3://{BUCKET}/shared/model-x"
    team_a = ownership.Owner("team-a", "tune", "uid-a")
    assert ownership.claim_s3(url, "team-b-s3", team_a)
    emulator.client().put_object(Bucket=BUCKET, Key="shared/model-x/adapter_config.json", Body=b"team-a")
    theirs = assignment(tmp_path, "team-b/tune", {"uri": url, "secretName": "team-b-s3"})
    with pytest.raises(AssignmentFailed) as info:
        plan_training(theirs, loaded=None, model="m")  # type: ignore[arg-type]  # refused before any use
    assert info.value.reason == Reason.OUTPUT_NOT_OURS and url in str(info.value)
    body = emulator.client().get_object(Bucket=BUCKET, Key="shared/model-x/adapter_config.json")["Body"]
    assert body.read() == b"team-a"
    marker = f"shared/model-x{ownership.MARKER_SUFFIX}"
    owner = ownership.Owner.from_json(emulator.client().get_object(Bucket=BUCKET, Key=marker)["Body"].read())
    assert owner == team_a
