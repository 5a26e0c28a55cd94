"""Owner markers: who wrote a checkpoint or artifact location, so deletion removes only its own files.

When a tuning attempt is about to write a location (a directory on a claim or in the pod, or an
``s3://bucket/prefix``), rank 0 writes ``<location>.elastune-owner.json`` next to it, naming the
TuningJob (namespace, name, uid). The marker sits beside the location, not in it, so the PEFT
directory stays exactly what the trainer saved and a prefix ``run-1`` never covers ``run-10``'s marker.

A location is claimed only when it is ours to write: absent or empty, or already marked by a TuningJob
of the same namespace (a re-created job replacing its predecessor's artifact). Content without a marker
(a user's own files) or marked by another namespace is never claimed, so the cleanup Job
(``elastune_worker.storage.cleanup``), which deletes only under a marker naming the deleted resource's
namespace and uid, can never remove it.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from elastune_contract.vocabulary import Reason
from elastune_worker.storage import s3

log = logging.getLogger("elastune.ownership")

MARKER_SUFFIX = ".elastune-owner.json"

Outcome = Literal["deleted", "absent", "not-owned"]


@dataclass(frozen=True)
class Owner:
    namespace: str
    name: str
    uid: str
    kind: str = "TuningJob"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Owner | None:
        try:
            data = json.loads(text)
            return cls(str(data["namespace"]), str(data["name"]), str(data["uid"]), str(data["kind"]))
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: nobody's, so never deleted

    def matches(self, namespace: str, uid: str) -> bool:
        return bool(uid) and self.namespace == namespace and self.uid == uid


def _may_claim(existing: Owner | None, has_content: bool, owner: Owner) -> bool:
    if existing is not None:
        return existing.namespace == owner.namespace
    return not has_content


# -- a directory (a claim's mount or the pod's filesystem) -----------------------------------------------


def marker_of(path: Path) -> Path:
    return path.with_name(path.name + MARKER_SUFFIX)


def read_local(path: Path) -> Owner | None:
    try:
        return Owner.from_json(marker_of(path).read_text(encoding="utf-8"))
    except OSError:
        return None


def claim_local(path: Path, owner: Owner) -> bool:
    """Mark ``path`` as written by ``owner`` when it is ours to write; False (and untouched) otherwise."""
    has_content = path.is_symlink() or (path.exists() and (not path.is_dir() or any(path.iterdir())))
    if not _may_claim(read_local(path), has_content, owner):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{MARKER_SUFFIX}.tmp")
    tmp.write_text(owner.to_json(), encoding="utf-8")
    tmp.replace(marker_of(path))  # atomic: a reader sees the old marker or the new one
    return True


def delete_local(path: Path, namespace: str, uid: str) -> Outcome:
    """Remove ``path`` and then its marker when the marker names (namespace, uid). The marker goes last:
    a cleanup interrupted half way is retried and still finds it."""
    owner = read_local(path)
    if owner is None:
        return "absent" if not path.exists() and not path.is_symlink() else "not-owned"
    if not owner.matches(namespace, uid):
        return "not-owned"
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    marker_of(path).unlink(missing_ok=True)
    return "deleted"


# -- s3://bucket/prefix ----------------------------------------------------------------------------


def _s3(url: str, secret: str | None) -> tuple[Any, str, str]:
    bucket, prefix = s3.parse(url)
    if not prefix:  # a bucket's root is never one job's to own
        raise s3.StorageError(Reason.INVALID_SPEC, f"{url}: an owner marker needs a prefix below the bucket")
    return s3.client(s3.credentials(secret)), bucket, prefix


def _read_s3(client: Any, bucket: str, key: str) -> Owner | None:
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code")) in ("NoSuchKey", "404"):
            return None
        raise
    return Owner.from_json(body.decode("utf-8", "replace"))


def _keys(client: Any, bucket: str, prefix: str, limit: int | None = None) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys += [str(o["Key"]) for o in page.get("Contents", [])]
        if limit is not None and len(keys) >= limit:
            break
    return keys


def claim_s3(url: str, secret: str | None, owner: Owner) -> bool:
    """Mark ``s3://bucket/prefix`` as written by ``owner`` (the object ``prefix.elastune-owner.json``)
    when it is ours to write; False otherwise. StorageError when the bucket cannot be reached."""
    try:
        client, bucket, prefix = _s3(url, secret)
        existing = _read_s3(client, bucket, prefix + MARKER_SUFFIX)
        if not _may_claim(existing, bool(_keys(client, bucket, prefix, limit=1)), owner):
            return False
        client.put_object(Bucket=bucket, Key=prefix + MARKER_SUFFIX, Body=owner.to_json().encode())
    except Exception as exc:
        raise s3._error(exc, url, "owner marker of") from exc
    return True


def delete_s3(url: str, secret: str | None, namespace: str, uid: str) -> Outcome:
    """Remove every object under ``prefix/`` and then the marker, when the marker names (namespace, uid)."""
    try:
        client, bucket, prefix = _s3(url, secret)
        owner = _read_s3(client, bucket, prefix + MARKER_SUFFIX)
        if owner is None:
            return "not-owned" if _keys(client, bucket, prefix, limit=1) else "absent"
        if not owner.matches(namespace, uid):
            return "not-owned"
        keys = _keys(client, bucket, prefix)
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            chunk = [{"Key": k} for k in keys[start : start + 1000]]
            resp = client.delete_objects(Bucket=bucket, Delete={"Objects": chunk, "Quiet": True})
            if errors := resp.get("Errors"):  # per-key failures come back in a 200 response
                first = errors[0]
                raise s3.StorageError(
                    Reason.STORAGE_ACCESS_DENIED
                    if first.get("Code") == "AccessDenied"
                    else Reason.STORAGE_UNREACHABLE,
                    f"cleanup of {url}: {len(errors)} objects not deleted, e.g. {first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message', '')}",
                )
        client.delete_object(Bucket=bucket, Key=prefix + MARKER_SUFFIX)
    except Exception as exc:
        raise s3._error(exc, url, "cleanup of") from exc
    return "deleted"


# -- what one attempt writes -----------------------------------------------------------------------------


def claim_attempt(
    job: str, uid: str, checkpoint_dir: str, artifact_dir: str, s3_url: str | None, secret: str | None
) -> list[str]:
    """Rank 0, before its first write: mark the attempt's checkpoint and artifact (or staging) directories
    and an s3:// output as the job's. Returns the locations it may not claim (the caller decides whether
    to write there: the worker refuses an output that is not its own); a marker it cannot write is
    logged and left unmarked, and the job's deletion leaves that location alone."""
    namespace, _, name = job.partition("/")
    owner = Owner(namespace, name, uid)
    refused: list[str] = []
    for path in (checkpoint_dir, artifact_dir):
        try:
            if not claim_local(Path(path), owner):
                log.warning("%s: %s is not this job's to own; its deletion will leave it", job, path)
                refused.append(path)
        except OSError as exc:
            log.warning("%s: no owner marker beside %s (%s); its deletion will leave it", job, path, exc)
    if s3_url:
        try:
            if not claim_s3(s3_url, secret, owner):
                log.warning("%s: %s is not this job's to own; its deletion will leave it", job, s3_url)
                refused.append(s3_url)
        except s3.StorageError as exc:
            log.warning("%s: no owner marker for %s (%s); its deletion will leave it", job, s3_url, exc)
    return refused
