"""Storage URIs, parsed and resolved one way by every component (docs/design.md §6).

The control plane (default artifact and checkpoint locations, LoRAAdapter checks), the tuner (where it
writes checkpoints and the artifact) and the adapter loader all turn a URI into a filesystem path here,
so a ``pvc://claim/path`` written by one is found by the others:

- ``/path`` (a plain path, relative ones too) and ``file:///path``: that path;
- ``pvc://<claim>/<path>``: ``$ELASTUNE_PVC_ROOT/<claim>/<path>`` (default ``/mnt/pvc``), where every
  worker pod of a WarmPool mounts each of the pool's claims;
- any other scheme (``s3://``, ``http(s)://``): no local path; ``local_path`` raises UnsupportedScheme
  and the caller handles that scheme itself (dispatch on ``parse(uri).scheme``).

Pure: no I/O beyond reading ELASTUNE_PVC_ROOT.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elastune_contract.api.constants import DEFAULT_PVC_ROOT, PVC_ROOT_ENV

PVC: str = "pvc"
FILE: str = "file"
LOCAL_SCHEMES: frozenset[str] = frozenset({"", FILE, PVC})
"""Schemes with a filesystem path in the worker pod ("" is a plain path)."""

# A claim is addressed as the first segment of the URI: a DNS label, as in the CRDs' URI pattern.
_DNS_LABEL = re.compile(r"^[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?$")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


class UnsupportedScheme(ValueError):
    """The URI names storage without a filesystem path (s3://, http(s)://, ...)."""


@dataclass(frozen=True)
class StorageURI:
    scheme: str
    """"" for a plain path, else the URI's scheme (lower case)."""
    authority: str
    """The claim of pvc://, the bucket of s3:// ...; "" for paths and file://."""
    path: str
    """A path or file:// URI: the path as given. Otherwise the part after the authority, without the
    leading '/', normalised ('a//b/' is 'a/b'), never containing '..' ("" is the claim's root)."""

    @property
    def is_local(self) -> bool:
        return self.scheme in LOCAL_SCHEMES

    def __str__(self) -> str:
        if self.scheme == "":
            return self.path
        if self.scheme == FILE:
            return f"file://{self.path}"
        return f"{self.scheme}://{self.authority}" + (f"/{self.path}" if self.path else "")


def parse(uri: str) -> StorageURI:
    """The URI's parts, or ValueError naming what is wrong (path traversal, a bad claim name, ...)."""
    if not uri or not uri.strip():
        raise ValueError("empty storage location")
    head, sep, rest = uri.partition("://")
    if not sep or uri.startswith("/") or not _SCHEME.match(head.lower()):
        return StorageURI("", "", uri)
    scheme = head.lower()
    if scheme == FILE:
        if not rest.startswith("/"):
            raise ValueError(f"{uri!r}: a file:// URI names a local absolute path: file:///<path>")
        return StorageURI(FILE, "", rest)
    authority, _, path = rest.partition("/")
    segments = [s for s in path.split("/") if s not in ("", ".")]
    if ".." in segments:
        raise ValueError(f"{uri!r}: '..' segments are not allowed (the path must stay inside {authority!r})")
    if scheme == PVC and not _DNS_LABEL.match(authority):
        raise ValueError(
            f"{uri!r}: {authority!r} is not a PersistentVolumeClaim name usable in pvc:// (a DNS label: "
            "lower-case letters, digits and '-', at most 63 characters)"
        )
    if not authority:
        raise ValueError(f"{uri!r}: no {scheme}:// authority (pvc://<claim>/<path>, s3://<bucket>/<key>)")
    return StorageURI(scheme, authority, "/".join(segments))


def pvc_root(env: Mapping[str, str] | None = None) -> Path:
    """Where the worker pods mount the pool's claims: $ELASTUNE_PVC_ROOT, default /mnt/pvc."""
    return Path((os.environ if env is None else env).get(PVC_ROOT_ENV) or DEFAULT_PVC_ROOT)


def local_path(uri: str | StorageURI, *, root: Path | str | None = None) -> Path:
    """The filesystem path of ``uri``; pvc:// under ``root`` (default: ``pvc_root()``).
    ValueError for a malformed URI; UnsupportedScheme for one without a local path."""
    loc = parse(uri) if isinstance(uri, str) else uri
    if loc.scheme == "":
        return Path(loc.path).expanduser()
    if loc.scheme == FILE:
        return Path(loc.path)
    if loc.scheme == PVC:
        base = Path(root) if root is not None else pvc_root()
        return base / loc.authority / loc.path if loc.path else base / loc.authority
    raise UnsupportedScheme(f"{loc}: {loc.scheme}:// has no local path (use a path, file:// or pvc://)")


def pvc_uri(claim: str, path: str = "") -> str:
    """``pvc://<claim>/<path>``, validated like any parsed URI."""
    return str(parse(f"pvc://{claim}/{path.lstrip('/')}"))


def join(base: str, *parts: str) -> str:
    """``base`` (a path or URI) with relative ``parts`` appended; ValueError if a part has '..'."""
    for part in parts:
        if part.startswith("/") or ".." in part.split("/"):
            raise ValueError(f"{part!r}: a relative path without '..' segments is required")
    loc = parse(base)
    if loc.scheme in ("", FILE):
        return str(StorageURI(loc.scheme, "", str(Path(loc.path, *parts))))
    return str(parse("/".join([str(loc).rstrip("/"), *parts])))
