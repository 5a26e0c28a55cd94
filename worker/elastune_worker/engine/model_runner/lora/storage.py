"""Where an adapter's artifact is read from (the storage tier).

Implemented: a local directory (``/path``, ``file:///path``) and ``pvc://<claim>/<path>`` — a
PersistentVolumeClaim mounted into the worker pod at ``$ELASTUNE_PVC_ROOT/<claim>`` (default
``/mnt/pvc``; the chart mounts each claim there), and ``s3://bucket/prefix``, downloaded once into a
local cache (elastune_worker.storage.s3). Not implemented: ``http(s)://`` (the error says so).
"""

from __future__ import annotations

from elastune_contract import storage
from elastune_worker.engine.model_runner.lora.weights import AdapterError
from elastune_worker.storage import s3


def resolve_artifact(url: str) -> str:
    """A local directory for ``url`` (pvc:// through the one resolver, as the tuner wrote it), or
    AdapterError naming what is wrong."""
    try:
        loc = storage.parse(url)
    except ValueError as exc:
        raise AdapterError(f"adapter location {exc}") from exc
    if loc.is_local:
        path = storage.local_path(loc)
    elif loc.scheme == "s3":
        # The vLLM API's lora_path and --lora-modules: the worker's own AWS_* environment. Adapters the
        # control plane places arrive here already downloaded, with their Secret (server.placement).
        try:
            return str(s3.download(url))
        except s3.StorageError as exc:
            raise AdapterError(f"{exc.reason}: {exc}") from exc
    elif loc.scheme in ("http", "https"):
        raise AdapterError(
            f"{loc.scheme}:// adapter artifacts are not supported yet; use s3://bucket/prefix, a volume "
            "(pvc://claim/path) or a local path"
        )
    else:
        raise AdapterError(f"unknown adapter location {url!r}: use a path, file://, or pvc://claim/path")
    if not path.is_dir():
        raise AdapterError(f"adapter artifact {url!r}: {path} is not a directory")
    return str(path)
