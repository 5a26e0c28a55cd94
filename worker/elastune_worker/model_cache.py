"""The model cache: where built artifacts live, and building one into it atomically.

Artifacts (the tiny models and their adapters, the Prompt Bank's model, SSJF's predictor) live under
``<ELASTUNE_CACHE | ~/.cache/elastune>``; each is built under a file lock in a sibling temp dir and
renamed into place whole, so parallel builders (test workers, pods sharing a volume) wait and then find
it, and a killed build never leaves half an artifact where loaders look.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elastune_worker.fsutil import swap_into_place

INFO_FILE = "build_info.json"


def cache_root(cache_dir: Path | None = None) -> Path:
    """`cache_dir`, else `$ELASTUNE_CACHE`, else `~/.cache/elastune`."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("ELASTUNE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "elastune"


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Serialise builds of one artifact across processes (e.g. parallel test workers)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: atomic rename alone still prevents torn artifacts
        yield
        return
    lock_path = target.parent / f".{target.name}.lock"
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a build on exactly ``n`` torch threads (reproducible, and no oversubscription)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_atomically(
    out_dir: Path,
    complete: Callable[[Path], bool],
    write: Callable[[Path], dict[str, Any]],
    *,
    force: bool = False,
    info_file: str = INFO_FILE,
) -> Path:
    """Build an artifact into exactly ``out_dir`` unless ``complete(out_dir)`` says it is there: under
    a lock (parallel builders wait, then find it), in a sibling temp dir that ``write`` fills (its
    returned dict becomes ``info_file``) and that is renamed into place only when whole, so a killed
    build never leaves half an artifact where loaders look. The tiny models, their adapters and the
    SSJF predictor are built this way."""
    out_dir = Path(out_dir).resolve()
    if not force and complete(out_dir):
        return out_dir  # before any write: a prebuilt artifact may sit on a read-only filesystem
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(out_dir):
        if not force and complete(out_dir):  # another process built it while we waited
            return out_dir
        # Leftovers of builds killed without cleanup (SIGKILL, SIGTERM); ours to delete under the lock.
        prefixes = (f".{out_dir.name}.tmp-", f".{out_dir.name}.old-")
        for stale in out_dir.parent.iterdir():
            if stale.name.startswith(prefixes) and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            # A fixed thread count keeps results reproducible and avoids oversubscribing small machines.
            with torch_threads(max(1, min(4, os.cpu_count() or 1))):
                info = write(tmp)
            (tmp / info_file).write_text(json.dumps(info, indent=2) + "\n")
            # mkdtemp makes 0700 dirs; a cache shared with other users or a serving image must be readable.
            for f in tmp.iterdir():
                f.chmod(0o644)
            tmp.chmod(0o755)
            swap_into_place(tmp, out_dir)  # a stale, incomplete or forced one is swapped out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
