"""Where a WarmPool's model comes from: one parser, used by the API, the operator, the fetcher and the
worker, so ``spec.model`` is read one way everywhere (DESIGN.md §6, "Models come from where users keep
them").

Accepted forms of ``spec.model``:

- ``hf://<org>/<name>`` or ``hf://<org>/<name>@<revision>``: a Hugging Face Hub repository (or any
  endpoint that speaks its API, ``HF_ENDPOINT``) at a branch, tag or commit (default ``main``);
- ``s3://<bucket>/<prefix>``: every object under the prefix of an S3-compatible bucket;
- ``pvc://<claim>/<path>``: a directory on a PersistentVolumeClaim of the pool's namespace;
- any other name without ``://`` (``elastune/tiny-llama``, ``tiny-gpt2``, a path in the worker image):
  loaded as today, by name, with nothing fetched.

The first three are fetched once per pool into the model cache (a claim that outlives pods) under
``cache_dir``; workers load that directory offline. The repository id follows the Hub's own rule
(huggingface_hub ``utils/_validators.py`` ``validate_repo_id``: ``namespace/name`` of ``[A-Za-z0-9_.-]``,
at most 96 characters each, no ``--`` or ``..``). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Final, Literal

HF: Final = "hf"
S3: Final = "s3"
PVC: Final = "pvc"  # storage.PVC: pvc:// resolves the same way here (storage imports the api package,
# which imports this module, so storage is imported where it is used)
NAMED: Final = "named"
FETCHED_KINDS: Final = frozenset({HF, S3, PVC})
DEFAULT_REVISION: Final = "main"
MODEL_CACHE_ENV: Final = "ELASTUNE_MODEL_CACHE"
"""Where the model cache claim is mounted in the fetch Job's and the workers' pods."""
DEFAULT_MODEL_CACHE_PATH: Final = "/mnt/models"
FETCHED_MARKER: Final = ".elastune-fetched"
"""Written last into a source's cache directory: the directory is complete (the fetcher publishes it
by rename, so a reader sees either nothing or all of it, and this file)."""

ACCEPTED_FORMS: Final = (
    "hf://<org>/<name>[@<revision>], s3://<bucket>/<prefix>, pvc://<claim>/<path>, "
    "or a built-in model name such as elastune/tiny-llama"
)

_REPO_PART = r"[A-Za-z0-9_.-]{1,96}"
_REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
# Branch and tag names: git's check-ref-format in short (no whitespace, '..', '~^:?*[\\', leading '/').
_REVISION = re.compile(r"^[^\s~^:?*\[\\/][^\s~^:?*\[\\]*$")
_BUCKET = re.compile(r"^[a-z0-9](?:[-a-z0-9.]{1,61}[a-z0-9])$")

#: The CRD's pattern for spec.model (RE2: no lookahead), the same forms the parser accepts; the
#: parser's checks (repo-id rules, '..') are finer and run in the operator.
MODEL_SOURCE_PATTERN: Final = (
    r"^(?:hf://[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(?:@[^\s@]+)?"
    r"|s3://[a-z0-9][-a-z0-9.]*[a-z0-9](?:/\S*)?"
    r"|pvc://[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:/\S*)?"
    r"|[^\s:]+)$"
)
MODEL_SOURCE_DESCRIPTION: Final = f"must be one of {ACCEPTED_FORMS}"

Kind = Literal["hf", "s3", "pvc", "named"]


@dataclass(frozen=True)
class ModelSource:
    """A parsed ``spec.model``."""

    kind: Kind
    """hf, s3, pvc (fetched into the cache) or named (loaded by name, as before)."""
    location: str
    """hf: the repository id (org/name); s3: the bucket; pvc: the claim; named: the name itself."""
    path: str = ""
    """s3: the key prefix; pvc: the path in the claim (normalised, never '..'); else ""."""
    revision: str = ""
    """hf: the branch, tag or commit (``main`` when not given); else ""."""

    @property
    def fetched(self) -> bool:
        """Whether the pool fetches it into the model cache before its workers start."""
        return self.kind in FETCHED_KINDS

    @property
    def uri(self) -> str:
        """The canonical form (``hf://org/name@main`` when the revision was left out)."""
        if self.kind == HF:
            return f"hf://{self.location}@{self.revision}"
        if self.kind in (S3, PVC):
            return f"{self.kind}://{self.location}" + (f"/{self.path}" if self.path else "")
        return self.location

    @property
    def cache_dir(self) -> str:
        """The directory of this source inside the model cache: readable, unique per canonical URI
        (a short hash, since two URIs may flatten to the same readable part), one path segment."""
        readable = re.sub(r"[^A-Za-z0-9_.-]+", "--", f"{self.location}/{self.path}@{self.revision}")
        digest = hashlib.sha256(self.uri.encode()).hexdigest()[:12]
        return f"{self.kind}--{readable.strip('-.')[:80]}--{digest}"


def parse_model_source(text: str) -> ModelSource:
    """``text`` as a ModelSource, or ValueError with a sentence saying what is wrong and the accepted
    forms."""
    if (
        not isinstance(text, str)
        or not text.strip()
        or text != text.strip()
        or any(c.isspace() for c in text)
    ):
        raise ValueError(f"{text!r} is not a model source: it must be non-empty without whitespace, one of "
                         f"{ACCEPTED_FORMS}.")  # fmt: skip
    head, sep, rest = text.partition("://")
    if not sep:
        if ":" in text:
            raise ValueError(f"{text!r} is not a model source: a name must not contain ':'; use one of "
                             f"{ACCEPTED_FORMS}.")  # fmt: skip
        return ModelSource(NAMED, text)
    scheme = head.lower()
    if scheme == HF:
        repo, at, revision = rest.partition("@")
        if not _REPO_ID.match(repo) or "--" in repo or ".." in repo:
            raise ValueError(
                f"{text!r}: {repo!r} is not a Hugging Face repository id; write hf://<org>/<name> or "
                "hf://<org>/<name>@<revision> (letters, digits, '-', '_' and '.', at most 96 each, no '--' "
                "or '..')."
            )
        if at and (not revision or not _REVISION.match(revision) or ".." in revision):
            raise ValueError(
                f"{text!r}: {revision!r} is not a revision; after '@' give a branch, tag or commit such as "
                "main, v1.0 or a 40-character commit hash."
            )
        return ModelSource(HF, repo, revision=revision or DEFAULT_REVISION)
    if scheme in (S3, PVC):
        from elastune_contract import storage

        try:
            loc = storage.parse(text)
        except ValueError as exc:
            raise ValueError(
                f"{exc}; write {scheme}://<{'bucket' if scheme == S3 else 'claim'}>/<path>."
            ) from exc
        if scheme == S3 and not _BUCKET.match(loc.authority):
            raise ValueError(
                f"{text!r}: {loc.authority!r} is not an S3 bucket name (3 to 63 lower-case letters, digits, "
                "'-' and '.'); write s3://<bucket>/<prefix>."
            )
        return ModelSource(S3 if scheme == S3 else PVC, loc.authority, path=loc.path)
    raise ValueError(f"{text!r}: the scheme {scheme}:// is not a model source; use one of {ACCEPTED_FORMS}.")
