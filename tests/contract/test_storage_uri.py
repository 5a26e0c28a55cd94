"""The one resolver of storage URIs (elastune_contract.storage): pvc://, file://, plain paths, traversal
refused, the claims' root from $ELASTUNE_PVC_ROOT. Pure: no files are touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastune_contract import storage
from elastune_contract.api.constants import DEFAULT_PVC_ROOT, PVC_ROOT_ENV


def test_pvc_resolves_under_the_claims_mount(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PVC_ROOT_ENV, raising=False)
    assert storage.local_path("pvc://shared/prompts/a") == Path(DEFAULT_PVC_ROOT, "shared", "prompts", "a")
    assert storage.local_path("pvc://shared") == Path(DEFAULT_PVC_ROOT, "shared")
    loc = storage.parse("pvc://shared//prompts/./a/")
    assert (loc.scheme, loc.authority, loc.path) == ("pvc", "shared", "prompts/a")
    assert str(loc) == "pvc://shared/prompts/a"


def test_the_root_comes_from_the_environment_or_the_argument(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(PVC_ROOT_ENV, str(tmp_path))
    assert storage.pvc_root() == tmp_path
    assert storage.local_path("pvc://c/x") == tmp_path / "c" / "x"
    assert storage.local_path("pvc://c/x", root="/elsewhere") == Path("/elsewhere/c/x")
    assert storage.pvc_root({}) == Path(DEFAULT_PVC_ROOT)
    assert storage.pvc_root({PVC_ROOT_ENV: ""}) == Path(DEFAULT_PVC_ROOT)


def test_file_uris_and_plain_paths_are_the_path() -> None:
    assert storage.local_path("file:///data/out") == Path("/data/out")
    assert storage.local_path("/data/out") == Path("/data/out")
    assert storage.local_path("relative/dir") == Path("relative/dir")
    assert storage.parse("/a/b://c").scheme == ""  # an absolute path is a path whatever it contains
    with pytest.raises(ValueError, match="file:///<path>"):
        storage.parse("file://host/data")


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("pvc://claim/../..", r"'\.\.' segments"),
        ("pvc://claim/a/../../other/x", r"'\.\.' segments"),
        ("pvc://../etc", "not a PersistentVolumeClaim name"),
        ("pvc://Claim/x", "not a PersistentVolumeClaim name"),
        ("pvc://my.claim/x", "not a PersistentVolumeClaim name"),
        ("pvc://" + "a" * 64 + "/x", "not a PersistentVolumeClaim name"),
        ("pvc:///x", "not a PersistentVolumeClaim name"),
        ("", "empty"),
    ],
)
def test_traversal_and_bad_claims_are_refused(uri: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        storage.local_path(uri)


def test_schemes_without_a_local_path_are_left_to_their_callers() -> None:
    loc = storage.parse("s3://bucket/prefix/x")
    assert (loc.scheme, loc.authority, loc.path, loc.is_local) == ("s3", "bucket", "prefix/x", False)
    with pytest.raises(storage.UnsupportedScheme, match="s3://"):
        storage.local_path(loc)


def test_join_and_pvc_uri_build_validated_locations() -> None:
    assert storage.join("pvc://shared/elastune", "checkpoints", "ns/job") == (
        "pvc://shared/elastune/checkpoints/ns/job"
    )
    assert storage.join("/state", "checkpoints", "ns/job", "uid") == "/state/checkpoints/ns/job/uid"
    assert storage.join("file:///state", "a") == "file:///state/a"
    assert storage.pvc_uri("shared", "/elastune/x") == "pvc://shared/elastune/x"
    with pytest.raises(ValueError):
        storage.join("pvc://shared", "../other")
    with pytest.raises(ValueError):
        storage.join("/state", "/etc")
    with pytest.raises(ValueError):
        storage.pvc_uri("Bad_Claim", "x")
