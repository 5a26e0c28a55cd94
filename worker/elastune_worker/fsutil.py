"""Small filesystem helpers shared by the worker's durable outputs (models, artifacts, checkpoints)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def swap_into_place(tmp: Path, out: Path) -> None:
    """Atomically publish the finished directory ``tmp`` as ``out``.

    An existing ``out`` (stale, incomplete or being replaced) is first renamed aside and then deleted,
    so readers see either the old or the new directory, never a half-written one.
    """
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, out)
