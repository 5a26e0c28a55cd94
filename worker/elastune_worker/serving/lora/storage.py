"""Where an adapter's artifact is read from (the storage tier).

Implemented: a local directory (``/path``, ``file:///path``) and ``pvc://<claim>/<path>`` — a
PersistentVolumeClaim mounted into the worker pod at ``$ELASTUNE_PVC_ROOT/<claim>`` (default
``/mnt/pvc``; the chart mounts each claim there). Not implemented: ``s3://`` and ``http(s)://``
(the error says so; copy the artifact to a volume).
"""

from __future__ import annotations

from elastune_contract import storage
from elastune_worker.serving.lora.weights import AdapterError


def resolve_artifact(url: str) -> str:
    """A local directory for ``url`` (pvc:// through the one resolver, as the tuner wrote it), or
    AdapterError naming what is wrong."""
    try:
        loc = storage.parse(url)
    except ValueError as exc:
        raise AdapterError(f"adapter location {exc}") from exc
    if loc.is_local:
        path = storage.local_path(loc)
    elif loc.scheme in ("s3", "http", "https"):
        raise AdapterError(
            f"{loc.scheme}:// adapter artifacts are not supported yet; put the PEFT directory on a volume "
            "(pvc://claim/path) or a local path"
        )
    else:
        raise AdapterError(f"unknown adapter location {url!r}: use a path, file://, or pvc://claim/path")
    if not path.is_dir():
        raise AdapterError(f"adapter artifact {url!r}: {path} is not a directory")
    return str(path)
