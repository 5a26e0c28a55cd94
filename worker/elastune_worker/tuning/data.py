"""TuningJob datasets: JSONL of {"input": str, "target": str}, loaded with errors a user can act on.

Every failure is a ``DatasetError`` whose ``reason`` is a CamelCase constant the operator can copy into a
condition as is (Kubernetes API conventions), and whose message names the file and, for a bad record, the
line and what is wrong with it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Final, TypedDict
from urllib.parse import unquote, urlsplit

from elastune_contract import storage
from elastune_contract.vocabulary import Reason

__all__ = [
    "DATASET_EMPTY",
    "DATASET_MALFORMED",
    "DATASET_NOT_FOUND",
    "DATASET_UNSUPPORTED_SCHEME",
    "DatasetError",
    "Record",
    "load_dataset",
    "resolve_local_path",
    "split",
]

DATASET_NOT_FOUND: Final = Reason.DATASET_NOT_FOUND
DATASET_MALFORMED: Final = Reason.DATASET_MALFORMED
DATASET_EMPTY: Final = Reason.DATASET_EMPTY
DATASET_UNSUPPORTED_SCHEME: Final = Reason.DATASET_UNSUPPORTED_SCHEME

# Schemes the TuningJob API accepts (tuningjob.py) but this worker cannot fetch yet.
_NOT_IMPLEMENTED_SCHEMES: Final = ("s3", "http", "https")
_FIELDS: Final = ("input", "target")


class Record(TypedDict):
    input: str
    target: str


class DatasetError(ValueError):
    """The dataset cannot be used; ``reason`` is a CamelCase constant (``DatasetNotFound``, ...)."""

    def __init__(self, reason: str, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.line = line  # 1-based line number for DatasetMalformed, else None


def resolve_local_path(uri: str) -> Path:
    """The local file a dataset URI names: a plain path or ``file://[localhost]/abs/path``."""
    if not uri or not uri.strip():
        raise DatasetError(DATASET_NOT_FOUND, "dataset URI is empty")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    # A one-letter "scheme" is a Windows drive (C:\...), not a URL.
    if scheme == "" or len(scheme) == 1:
        return Path(uri)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise DatasetError(
                DATASET_UNSUPPORTED_SCHEME,
                f"dataset {uri!r}: file:// URIs must name a local file (host {parts.netloc!r} given); "
                "use file:///absolute/path",
            )
        return Path(unquote(parts.path))
    if scheme == "pvc":  # the claim's mount in this pod, resolved as for checkpoints and adapters
        try:
            return storage.local_path(uri)
        except ValueError as exc:
            raise DatasetError(DATASET_UNSUPPORTED_SCHEME, f"dataset {uri!r}: {exc}") from exc
    if scheme in _NOT_IMPLEMENTED_SCHEMES:
        raise DatasetError(
            DATASET_UNSUPPORTED_SCHEME,
            f"dataset {uri!r}: {scheme}:// datasets are not implemented yet in the worker; "
            "use a local path or file:// URI",
        )
    raise DatasetError(
        DATASET_UNSUPPORTED_SCHEME,
        f"dataset {uri!r}: unknown scheme {scheme!r}; supported: local path, file://, pvc://claim/path",
    )


def load_dataset(uri: str) -> list[Record]:
    """Records of a JSONL dataset; blank lines are skipped, extra keys ignored."""
    path = resolve_local_path(uri)
    if not path.exists():
        raise DatasetError(DATASET_NOT_FOUND, f"dataset {uri!r}: {path} does not exist")
    if not path.is_file():
        raise DatasetError(DATASET_NOT_FOUND, f"dataset {uri!r}: {path} is not a regular file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(DATASET_NOT_FOUND, f"dataset {uri!r}: cannot read {path}: {exc}") from exc

    records: list[Record] = []
    for lineno, line_bytes in enumerate(raw.splitlines(), start=1):

        def bad(what: str, lineno: int = lineno) -> DatasetError:
            return DatasetError(DATASET_MALFORMED, f"dataset {uri!r}: line {lineno}: {what}", line=lineno)

        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise bad(f"invalid JSON: {exc.msg} (column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise bad(f'expected a JSON object {{"input": ..., "target": ...}}, got {type(obj).__name__}')
        for key in _FIELDS:
            if key not in obj:
                raise bad(f"missing key {key!r}")
            if not isinstance(obj[key], str):
                raise bad(f"{key!r} must be a string, got {type(obj[key]).__name__}")
        if not obj["target"].strip():
            # An empty target gives no token to learn from and makes every metric degenerate.
            raise bad("'target' is empty")
        records.append(Record(input=obj["input"], target=obj["target"]))
    if not records:
        raise DatasetError(DATASET_EMPTY, f"dataset {uri!r}: {path} holds no records")
    return records


def split(
    records: Sequence[Record], eval_fraction: float, max_eval: int, seed: int
) -> tuple[list[Record], list[Record]]:
    """(train, eval): a seeded random choice of ``min(max_eval, round(n * eval_fraction))`` eval records.

    Deterministic in (records, eval_fraction, max_eval, seed) on every machine (string-seeded
    ``random.Random`` hashes with SHA-512, unlike ``hash()``); both parts keep the input order. At least
    one record stays in train, and a positive fraction always yields at least one eval record.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if max_eval < 0:
        raise ValueError(f"max_eval must be >= 0, got {max_eval}")
    n = len(records)
    if n == 0:
        raise DatasetError(DATASET_EMPTY, "cannot split an empty dataset")
    n_eval = min(max_eval, round(n * eval_fraction), n - 1)
    if eval_fraction > 0 and max_eval > 0 and n >= 2:
        n_eval = max(1, n_eval)
    chosen = set(random.Random(f"elastune/split/{seed}").sample(range(n), n_eval))
    train = [r for i, r in enumerate(records) if i not in chosen]
    evals = [r for i, r in enumerate(records) if i in chosen]
    return train, evals
