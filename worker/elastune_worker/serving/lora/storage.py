"""Where an adapter's artifact is read from (the storage tier).

Implemented: a local directory (``/path``, ``file:///path``) and ``pvc://<claim>/<path>`` — a
PersistentVolumeClaim mounted into the worker pod at ``$ELASTUNE_PVC_ROOT/<claim>`` (default
``/mnt/pvc``; the chart mounts each claim there). Not implemented: ``s3://`` and ``http(s)://``
(the error says so; copy the artifact to a volume).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from elastune_contract.api.constants import DEFAULT_PVC_ROOT, PVC_ROOT_ENV
from elastune_worker.serving.lora.weights import AdapterError


def resolve_artifact(url: str) -> str:
    """A local directory for ``url``, or AdapterError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        path = Path(parts.path if parts.scheme == "file" else url).expanduser()
    elif parts.scheme == "pvc":
        root = Path(os.environ.get(PVC_ROOT_ENV, DEFAULT_PVC_ROOT))
        path = root / parts.netloc / parts.path.lstrip("/")
    elif parts.scheme in ("s3", "http", "https"):
        raise AdapterError(
            f"{parts.scheme}:// adapter artifacts are not supported yet; put the PEFT directory on a volume "
            "(pvc://claim/path) or a local path"
        )
    else:
        raise AdapterError(f"unknown adapter location {url!r}: use a path, file://, or pvc://claim/path")
    if not path.is_dir():
        raise AdapterError(f"adapter artifact {url!r}: {path} is not a directory")
    return str(path)
