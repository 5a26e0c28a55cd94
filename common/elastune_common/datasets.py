"""The data files the repository ships (``data/``): where they are, and reading them whether gzipped or not.

Every reader (SSJF's predictor build, ``elastune bench serve|ssjf|coserve``, the gateway's routing
simulator) takes its default path from here, so a fresh clone finds the data with no setting and no
folder outside the checkout. ``data/README.md`` names each file's source and licence.

The files sit in the checkout's ``data/`` folder, found from this module's own location (the
repository layout: ``common/elastune_common/datasets.py``), which an editable install and a tree put on
``PYTHONPATH`` (tools/device_check.sh) both keep. ``data/`` is not a Python package: a wheel does not
carry it, so an install from a wheel passes a path (``--dataset``, ``$ELASTUNE_DATASET``).

Readers open files through ``open_text`` / ``read_bytes``: a file that starts with gzip's magic bytes
is decompressed, any other is read as is, so a user's own uncompressed copy works the same.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import IO, Any

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
"""The checkout's ``data/`` folder."""

SHAREGPT_FILE = "sharegpt_250.json.gz"
"""250 ShareGPT conversations' first prompt and response, token lengths, Poisson arrivals (1/s)."""
ALPACAEVAL_FILE = "alpacaeval_gpt35_0301.json.gz"
"""AlpacaEval's 805 instructions (five instruction sets) with gpt-3.5-turbo-0301's answers, ShareGPT format
plus each entry's ``source``: SSJF's second training source and its held-out one."""
AZURE_CONV_TRACE_FILE = "azure_llm_conv_2023.csv.gz"
"""Azure LLM inference trace 2023, conversation service: TIMESTAMP, ContextTokens, GeneratedTokens."""

DATASET_ENV = "ELASTUNE_DATASET"
"""Names another ShareGPT file for every reader at once (a user's own copy, a bigger sample)."""

_GZIP_MAGIC = b"\x1f\x8b"


def sharegpt_path() -> Path:
    """The ShareGPT dataset: ``$ELASTUNE_DATASET`` if set, else the shipped copy."""
    return Path(os.environ.get(DATASET_ENV) or DATA_DIR / SHAREGPT_FILE)


def alpacaeval_path() -> Path:
    """The AlpacaEval sample shipped in ``data/`` (tools/alpacaeval_sample.py wrote it)."""
    return DATA_DIR / ALPACAEVAL_FILE


def azure_trace_path() -> Path:
    """The Azure conversation trace shipped in ``data/``."""
    return DATA_DIR / AZURE_CONV_TRACE_FILE


def _is_gzip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(2) == _GZIP_MAGIC


def read_bytes(path: str | Path) -> bytes:
    """The file's content, decompressed if it is gzip (a digest of it names the data, not its packing)."""
    path = Path(path)
    return gzip.decompress(path.read_bytes()) if _is_gzip(path) else path.read_bytes()


def open_text(path: str | Path) -> IO[str]:
    """A text stream over the file, decompressed if it is gzip; ``newline=""`` as the csv module wants."""
    path = Path(path)
    # The caller closes it: ``with open_text(p) as f``.
    if _is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open(encoding="utf-8", newline="")


def read_json(path: str | Path) -> Any:
    return json.loads(read_bytes(path))


def not_found(path: Path, what: str, how: str) -> FileNotFoundError:
    """The error a reader raises for a missing file: what it is and how to point at another copy."""
    return FileNotFoundError(
        f"{what} {path} not found (the repository ships it in data/; name another copy with {how})"
    )


def display_path(path: str | Path) -> str:
    """``path`` relative to the checkout when it is inside it (``data/sharegpt_250.json.gz``), so what a
    benchmark records names the same file on every machine; any other path as given."""
    try:
        return Path(path).resolve().relative_to(DATA_DIR.parent).as_posix()
    except ValueError:
        return str(path)
