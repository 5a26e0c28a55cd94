"""Fetch a WarmPool's model (hf://, s3://, pvc://) once into the model cache; torch-free.

What the pool's ``<pool>-model-fetch`` Job runs before any worker starts (KServe's storage initializer
does the same for InferenceServices), and what tests call in-process:

    python -m elastune_worker.model_fetch --source hf://org/name@main --cache /mnt/models

- ``hf://``: the real ``huggingface_hub`` client (``snapshot_download``), honouring ``HF_ENDPOINT`` (a
  mirror, a private hub, the tests' stand-in) and the token (``HF_TOKEN``, from the Secret the WarmPool
  names); ``s3://``: boto3 through worker/storage/s3.py (the Secret mounted as for LoRAAdapters, or the
  pod's own identity only when the pool sets useAmbientCredentials: ``--s3-secret @ambient``; with
  neither the fetch is refused, ModelAccessDenied);
  ``pvc://``: a copy from the claim's mount.
- Each source gets its own directory of the cache (``ModelSource.cache_dir``), downloaded into a temp
  directory beside it and renamed into place with FETCHED_MARKER inside: a reader never sees half a
  model, and a second pool of the same source finds the marker and downloads nothing.
- The model must be one the engine serves: config.json's ``model_type`` among SUPPORTED_MODEL_TYPES
  (the keys of engine/model_runner/models/loader.py ARCHITECTURES; kept here so this check needs no torch,
  and tests/worker/test_model_fetch.py fails if the two lists part).
- Failures are FetchError with a vocabulary reason (ModelAccessDenied, ModelNotFound,
  ModelRevisionNotFound, ModelUnsupported, ModelFetchFailed). The command writes ``Reason: message`` as
  the container's termination message (Kubernetes: the kubelet mounts a file at the container's
  terminationMessagePath, /dev/termination-log by default, and puts its content in the pod's
  ``state.terminated.message``) and as its last line of stderr (what terminationMessagePolicy
  FallbackToLogsOnError reads when the file is empty), so the operator reads it from the pod's status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from elastune_contract import storage
from elastune_contract.model_source import (
    FETCHED_MARKER,
    HF,
    MODEL_CACHE_ENV,
    S3,
    ModelSource,
    parse_model_source,
)
from elastune_contract.vocabulary import Reason

#: config.json model_type values the engine loads (engine/model_runner/models/loader.py ARCHITECTURES).
SUPPORTED_MODEL_TYPES: Final = frozenset({"llama", "mistral", "qwen2", "gpt2"})
DEFAULT_TERMINATION_LOG: Final = "/dev/termination-log"
#: The kubelet keeps at most 4096 bytes of a termination message (core/v1 Container docs).
MAX_TERMINATION_MESSAGE: Final = 4096


class FetchError(Exception):
    """A fetch that failed; ``reason`` goes on the WarmPool's ModelReady condition as it is."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def termination_message(self) -> str:
        return f"{self.reason}: {self}"


def fetched_dir(cache: Path, source: ModelSource) -> Path:
    """Where ``source`` lives in the cache (complete once FETCHED_MARKER is in it)."""
    return Path(cache) / source.cache_dir


def is_fetched(cache: Path, source: ModelSource) -> bool:
    return (fetched_dir(cache, source) / FETCHED_MARKER).is_file()


def fetch(
    source: str | ModelSource,
    cache: Path,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    s3_secret: str | None = None,
    pvc_root: Path | None = None,
) -> Path:
    """The cache directory of ``source``, downloaded first unless it is already there."""
    try:
        src = parse_model_source(source) if isinstance(source, str) else source
    except ValueError as exc:
        raise FetchError(Reason.MODEL_FETCH_FAILED, str(exc)) from exc
    if not src.fetched:
        raise FetchError(
            Reason.MODEL_FETCH_FAILED, f"{src.uri!r} is a built-in name: there is nothing to fetch"
        )
    out = fetched_dir(cache, src)
    if is_fetched(cache, src):
        return out
    Path(cache).mkdir(parents=True, exist_ok=True)
    with _lock(out):  # two pools of one model fetching at once: the second waits, then finds it
        if is_fetched(cache, src):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=cache))
        try:
            if src.kind == HF:
                revision = _fetch_hf(src, tmp, token=token, endpoint=endpoint)
            elif src.kind == S3:
                revision = _fetch_s3(src, tmp, s3_secret)
            else:
                revision = _fetch_pvc(src, tmp, pvc_root)
            model_type = check_architecture(tmp, src)
            marker = {
                "source": src.uri,
                "revision": revision,
                "modelType": model_type,
                "fetchedAt": time.time(),
            }
            (tmp / FETCHED_MARKER).write_text(json.dumps(marker) + "\n")
            if out.exists():  # an unfinished leftover without the marker (a killed fetch of old)
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_architecture(path: Path, source: ModelSource) -> str:
    """config.json's model_type when the engine serves it; FetchError(ModelUnsupported) otherwise."""
    try:
        cfg: dict[str, Any] = json.loads((path / "config.json").read_text())
    except FileNotFoundError as exc:
        raise FetchError(
            Reason.MODEL_UNSUPPORTED,
            f"{source.uri} has no config.json: not a model directory in Hugging Face format",
        ) from exc
    except (OSError, ValueError) as exc:
        raise FetchError(
            Reason.MODEL_UNSUPPORTED, f"{source.uri}: config.json is unreadable ({exc})"
        ) from exc
    model_type = str(cfg.get("model_type") or "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        names = ", ".join(cfg.get("architectures") or []) or "none named"
        raise FetchError(
            Reason.MODEL_UNSUPPORTED,
            f"{source.uri} is a {model_type or 'model without a model_type'} model (architectures: {names}); "
            f"the engine serves model_type {', '.join(sorted(SUPPORTED_MODEL_TYPES))}",
        )
    return model_type


# -- sources --------------------------------------------------------------------------------------


def _fetch_hf(src: ModelSource, into: Path, *, token: str | None, endpoint: str | None) -> str:
    """snapshot_download into ``into``; returns the commit the revision resolved to."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    token = token or os.environ.get("HF_TOKEN") or None
    where = f"{src.uri} at {endpoint or 'huggingface.co'}"
    try:
        # The commit first, so the marker records what was fetched even when the revision is a branch.
        info = HfApi(endpoint=endpoint, token=token).model_info(src.location, revision=src.revision)
        snapshot_download(
            src.location,
            revision=info.sha or src.revision,
            local_dir=into,
            # The client's own cache (refs, tree listings) stays in the temp directory, not $HOME.
            cache_dir=into / ".hf-cache",
            token=token,
            endpoint=endpoint,
        )
    except RevisionNotFoundError as exc:
        raise FetchError(
            Reason.MODEL_REVISION_NOT_FOUND,
            f"{where}: the repository has no revision {src.revision!r} (a branch, tag or commit)",
        ) from exc
    except GatedRepoError as exc:  # a RepositoryNotFoundError too: test it first
        raise FetchError(
            Reason.MODEL_ACCESS_DENIED,
            f"{where}: gated repository; the token's account has not been granted access",
        ) from exc
    except RepositoryNotFoundError as exc:
        # The Hub answers a private repository without a valid token as if it did not exist.
        raise FetchError(
            Reason.MODEL_NOT_FOUND,
            f"{where}: no such repository (or it is private and "
            f"{'the token cannot see it' if token else 'no token was given'})",
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise FetchError(
                Reason.MODEL_ACCESS_DENIED,
                f"{where}: the hub refused the token (HTTP {status}); check the Secret's key token",
            ) from exc
        raise FetchError(Reason.MODEL_FETCH_FAILED, f"{where}: {_first_line(exc)}") from exc
    except LocalEntryNotFoundError as exc:  # the hub could not be reached
        raise FetchError(Reason.MODEL_FETCH_FAILED, f"{where}: hub unreachable: {_first_line(exc)}") from exc
    except Exception as exc:  # connection refused, timeouts (httpx), a full disk: worth a retry
        raise FetchError(
            Reason.MODEL_FETCH_FAILED, f"{where}: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    for leftover in (into / ".hf-cache", into / ".cache"):  # the client's bookkeeping, not the model
        shutil.rmtree(leftover, ignore_errors=True)
    return str(info.sha or src.revision)


def _fetch_s3(src: ModelSource, into: Path, secret: str | None) -> str:
    from elastune_worker.storage import s3

    staging = into / ".s3"
    try:
        got = s3.download(src.uri, secret, cache=staging)
    except s3.StorageError as exc:
        reason = {
            Reason.STORAGE_ACCESS_DENIED: Reason.MODEL_ACCESS_DENIED,
            Reason.STORAGE_SECRET_NOT_FOUND: Reason.MODEL_ACCESS_DENIED,
            Reason.STORAGE_CREDENTIALS_UNSET: Reason.MODEL_ACCESS_DENIED,
            Reason.STORAGE_BUCKET_NOT_FOUND: Reason.MODEL_NOT_FOUND,
            Reason.ARTIFACT_NOT_FOUND: Reason.MODEL_NOT_FOUND,
        }.get(exc.reason, Reason.MODEL_FETCH_FAILED)
        raise FetchError(reason, f"{src.uri}: {exc}") from exc
    for child in got.iterdir():
        if child.name != ".elastune-complete":
            os.replace(child, into / child.name)
    shutil.rmtree(staging, ignore_errors=True)
    return ""


def _fetch_pvc(src: ModelSource, into: Path, root: Path | None) -> str:
    path = storage.local_path(src.uri, root=root)
    if not path.is_dir():
        raise FetchError(
            Reason.MODEL_NOT_FOUND,
            f"{src.uri}: {path} is not a directory on the claim (is the "
            f"claim {src.location} mounted, and the path right?)",
        )
    shutil.copytree(path, into, dirs_exist_ok=True, symlinks=False)
    return ""


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    import fcntl

    with (target.parent / f".{target.name}.lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# -- command --------------------------------------------------------------------------------------


def write_termination_message(text: str, path: str | None) -> None:
    """``text`` as the container's termination message. Without an explicit path, only where the
    kubelet provided the file (it exists): a process outside a pod never writes into /dev."""
    target = Path(path or DEFAULT_TERMINATION_LOG)
    if path is None and not target.exists():
        return
    with contextlib.suppress(OSError):
        target.write_bytes(text.encode()[:MAX_TERMINATION_MESSAGE])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elastune_worker.model_fetch", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--source", required=True, help="hf://org/name[@revision], s3://bucket/prefix or pvc://claim/path"
    )
    parser.add_argument("--cache", default=os.environ.get(MODEL_CACHE_ENV), help="the model cache directory")
    parser.add_argument(
        "--s3-secret",
        default=None,
        help="the Secret mounted under $ELASTUNE_S3_SECRETS_ROOT, or @ambient: the pod's own identity",
    )
    parser.add_argument(
        "--termination-log", default=None, help=f"default {DEFAULT_TERMINATION_LOG}, if present"
    )
    args = parser.parse_args(argv)
    if not args.cache:
        parser.error(f"--cache or ${MODEL_CACHE_ENV} is required")
    try:
        out = fetch(args.source, Path(args.cache), s3_secret=args.s3_secret)
    except FetchError as exc:
        write_termination_message(exc.termination_message, args.termination_log)
        print(exc.termination_message, file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # anything unforeseen still ends with a reason the operator can show
        err = FetchError(
            Reason.MODEL_FETCH_FAILED, f"{args.source}: {type(exc).__name__}: {_first_line(exc)}"
        )
        write_termination_message(err.termination_message, args.termination_log)
        print(err.termination_message, file=sys.stderr, flush=True)
        return 1
    write_termination_message(f"{Reason.MODEL_FETCHED}: {args.source} in {out}", args.termination_log)
    print(f"{Reason.MODEL_FETCHED}: {args.source} in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
