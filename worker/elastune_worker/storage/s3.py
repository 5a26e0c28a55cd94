"""s3://bucket/prefix artifacts: download an adapter to a local cache, upload a tuned artifact (boto3).

Works with any S3-compatible endpoint (AWS, MinIO, Ceph RGW, GCS's XML API...). Credentials and the
endpoint come from the Secret the resource names, which the pool's worker pods mount read-only at
``$ELASTUNE_S3_SECRETS_ROOT/<secret>/`` (one file per key, KServe's and AIBrix's key names:
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optional AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION).
The pod's own identity (boto3's default chain: the AWS_* environment, an instance profile, an IRSA
role) is used only when the resource says so (``useAmbientCredentials: true``, which travels as
AMBIENT_CREDENTIALS in the Secret's place); with neither, every transfer is refused
(StorageCredentialsUnset) rather than falling back to whatever identity the node has. The control plane
never holds the credentials: only the Secret's name travels through it.

Every failure is a StorageError whose ``reason`` is a vocabulary constant (StorageBucketNotFound,
StorageAccessDenied, StorageSecretNotFound, StorageCredentialsUnset, StorageUnreachable,
ArtifactNotFound), so it lands on the
LoRAAdapter's Ready condition or the TuningJob's Failed condition as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from elastune_contract.api.constants import (
    AMBIENT_CREDENTIALS,
    DEFAULT_S3_SECRETS_ROOT,
    S3_CACHE_ENV,
    S3_SECRETS_ROOT_ENV,
)
from elastune_contract.vocabulary import Reason

# PEFT readers look for adapter_config.json first: upload it last, so a reader never takes a
# half-uploaded prefix for an artifact.
_LAST = ("adapter_config.json",)
_COMPLETE = ".elastune-complete"


class StorageError(Exception):
    """An s3:// transfer that failed; ``reason`` is the condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # keeps the reason across process boundaries (pickle)
        return (type(self), (self.reason, str(self)))


def is_s3(url: str) -> bool:
    return urlsplit(url).scheme == "s3"


def parse(url: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at either end) of ``s3://bucket/prefix``."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise StorageError(Reason.INVALID_SPEC, f"{url!r} is not an s3://bucket/prefix URL")
    return parts.netloc, parts.path.strip("/")


@dataclass(frozen=True)
class Credentials:
    """What one Secret (or the environment, when all fields are None) gives the client."""

    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    endpoint_url: str | None = None
    region: str | None = None


def secrets_root() -> Path:
    return Path(os.environ.get(S3_SECRETS_ROOT_ENV, DEFAULT_S3_SECRETS_ROOT))


def credentials(secret: str | None) -> Credentials:
    """The mounted Secret's keys; AMBIENT_CREDENTIALS: Credentials() (boto3's default chain); None:
    StorageError, since an unset Secret must not silently become the node's identity."""
    if secret == AMBIENT_CREDENTIALS:
        return Credentials()
    if not secret:
        raise StorageError(
            Reason.STORAGE_CREDENTIALS_UNSET,
            "no S3 credentials were named: name a Secret (LoRAAdapter spec.artifactSecret, TuningJob "
            "spec.output.secretName, WarmPool spec.modelSource.secretName), or set useAmbientCredentials: "
            "true beside it to use the pod's own identity (AWS_* environment, instance profile, IRSA)",
        )
    folder = secrets_root() / secret

    def key(*names: str) -> str | None:
        for name in names:
            try:
                value = (folder / name).read_text().strip()
            except OSError:
                continue
            if value:
                return value
        return None

    creds = Credentials(
        access_key_id=key("AWS_ACCESS_KEY_ID"),
        secret_access_key=key("AWS_SECRET_ACCESS_KEY"),
        session_token=key("AWS_SESSION_TOKEN"),
        endpoint_url=key("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        region=key("AWS_REGION", "AWS_DEFAULT_REGION"),
    )
    if not (creds.access_key_id and creds.secret_access_key):
        # Mounted with optional: true so one wrong name never blocks a pool's pods: say it here.
        raise StorageError(
            Reason.STORAGE_SECRET_NOT_FOUND,
            f"Secret {secret!r} has no AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY at {folder} (the Secret "
            "is missing, lacks those keys, or lives in another namespace than the WarmPool's pods)",
        )
    return creds


def client(creds: Credentials) -> Any:
    import boto3
    from botocore.config import Config

    # Custom endpoints (MinIO, Ceph, emulators) rarely resolve virtual-host bucket names: path style.
    style = "path" if creds.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") else "auto"
    config = Config(
        s3={"addressing_style": style},
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
    )
    return boto3.session.Session().client(
        "s3",
        aws_access_key_id=creds.access_key_id,
        aws_secret_access_key=creds.secret_access_key,
        aws_session_token=creds.session_token,
        endpoint_url=creds.endpoint_url,
        region_name=creds.region or os.environ.get("AWS_REGION") or "us-east-1",
        config=config,
    )


def _error(exc: Exception, url: str, what: str) -> StorageError:
    """A botocore failure as a StorageError with the condition's reason."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return StorageError(
            Reason.STORAGE_ACCESS_DENIED,
            f"{what} {url}: useAmbientCredentials is set but the pod has no identity (no AWS_* "
            "environment, instance profile or IRSA role); name a Secret instead",
        )
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        detail = f"{what} {url}: {code or status}: {err.get('Message') or exc}"
        if code == "NoSuchBucket" or (code == "404" and what == "bucket"):
            return StorageError(Reason.STORAGE_BUCKET_NOT_FOUND, detail)
        if code in ("NoSuchKey", "404"):
            return StorageError(Reason.ARTIFACT_NOT_FOUND, detail)
        if status in (401, 403) or code in (
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "InvalidToken",
            "ExpiredToken",
            "403",
        ):
            return StorageError(Reason.STORAGE_ACCESS_DENIED, detail)
        return StorageError(Reason.STORAGE_UNREACHABLE, detail)
    if isinstance(exc, EndpointConnectionError | ConnectionError | TimeoutError):
        return StorageError(Reason.STORAGE_UNREACHABLE, f"{what} {url}: {exc}")
    from botocore.exceptions import BotoCoreError

    if isinstance(exc, BotoCoreError):
        return StorageError(Reason.STORAGE_UNREACHABLE, f"{what} {url}: {exc}")
    raise exc


def _objects(s3: Any, bucket: str, prefix: str) -> Iterator[dict[str, Any]]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/" if prefix else "")
    for page in pages:
        yield from page.get("Contents", [])


def _relative(key: str, prefix: str) -> PurePosixPath | None:
    rel = PurePosixPath(key[len(prefix) + 1 :] if prefix else key)
    if key.endswith("/") or not rel.parts:
        return None  # a "folder" marker some tools write
    if any(p in ("..", ".") for p in rel.parts) or rel.is_absolute():
        raise StorageError(Reason.NOT_A_PEFT_ADAPTER, f"object key {key!r} leaves its prefix")
    return rel


def cache_root() -> Path:
    return Path(os.environ.get(S3_CACHE_ENV) or Path(tempfile.gettempdir()) / "elastune-s3-cache")


def download(url: str, secret: str | None = None, cache: Path | None = None) -> Path:
    """The artifact under ``url`` as a local directory, downloaded once per content.

    The cache key is the listing's ETags and sizes: a repeated load costs one LIST request, and an
    artifact replaced under the same prefix is downloaded again. StorageError when it cannot be."""
    bucket, prefix = parse(url)
    creds = credentials(secret)
    s3 = client(creds)
    try:
        listing = sorted(
            (str(rel), str(o.get("ETag", "")), int(o.get("Size", 0)), str(o["Key"]))
            for o in _objects(s3, bucket, prefix)
            if (rel := _relative(str(o["Key"]), prefix)) is not None
        )
    except Exception as exc:
        raise _error(exc, url, "listing") from exc
    if not listing:
        raise StorageError(Reason.ARTIFACT_NOT_FOUND, f"no object under {url}")
    where = hashlib.sha256(f"{creds.endpoint_url}|{bucket}|{prefix}".encode()).hexdigest()[:16]
    content = hashlib.sha256(json.dumps([x[:3] for x in listing]).encode()).hexdigest()[:16]
    parent = (cache or cache_root()) / where
    out = parent / content
    if (out / _COMPLETE).exists():
        return out
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=parent))
    try:
        for name, _, _, key in listing:
            dest = tmp / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                s3.download_file(bucket, key, str(dest))
            except Exception as exc:
                raise _error(exc, f"s3://{bucket}/{key}", "download of") from exc
        (tmp / _COMPLETE).write_text(url + "\n")
        try:
            os.replace(tmp, out)
        except OSError:  # another loader published the same content first: use theirs
            if not (out / _COMPLETE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in parent.iterdir():  # earlier contents of this prefix: the engine holds weights in memory
        if old != out and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return out


def check_bucket(url: str, secret: str | None = None) -> None:
    """StorageError now, when ``url``'s bucket is missing or refuses the credentials: a TuningJob
    fails before it tunes rather than at the upload of its result."""
    bucket, _ = parse(url)
    s3 = client(credentials(secret))
    try:
        s3.head_bucket(Bucket=bucket)
    except Exception as exc:
        raise _error(exc, url, "bucket") from exc


def upload(local_dir: str | Path, url: str, secret: str | None = None) -> str:
    """Every file of ``local_dir`` under ``url`` (adapter_config.json last); returns ``url``."""
    bucket, prefix = parse(url)
    root = Path(local_dir)
    files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: (p.name in _LAST, str(p)))
    if not files:
        raise StorageError(Reason.ARTIFACT_NOT_FOUND, f"nothing to upload in {root}")
    s3 = client(credentials(secret))
    for path in files:
        key = "/".join(x for x in (prefix, path.relative_to(root).as_posix()) if x)
        try:
            s3.upload_file(str(path), bucket, key)
        except Exception as exc:
            from boto3.exceptions import S3UploadFailedError

            # upload_file wraps the service's error in text only: map it from the message.
            if isinstance(exc, S3UploadFailedError):
                text = str(exc)
                for code, reason in (
                    ("NoSuchBucket", Reason.STORAGE_BUCKET_NOT_FOUND),
                    ("InvalidAccessKeyId", Reason.STORAGE_ACCESS_DENIED),
                    ("SignatureDoesNotMatch", Reason.STORAGE_ACCESS_DENIED),
                    ("AccessDenied", Reason.STORAGE_ACCESS_DENIED),
                    ("403", Reason.STORAGE_ACCESS_DENIED),
                ):
                    if code in text:
                        raise StorageError(reason, f"upload to s3://{bucket}/{key}: {text}") from exc
                raise StorageError(
                    Reason.STORAGE_UNREACHABLE, f"upload to s3://{bucket}/{key}: {text}"
                ) from exc
            raise _error(exc, f"s3://{bucket}/{key}", "upload to") from exc
    return url
