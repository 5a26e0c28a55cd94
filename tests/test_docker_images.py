"""The images carry every import package their components import (no container engine here to build
them, so the Dockerfiles are read): a package missing from a COPY fails only when the image starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Image -> the top-level folders (import packages) its processes import.
NEEDS = {
    "worker.Dockerfile": {"contract", "common", "worker", "batching", "ssjf"},
    "operator.Dockerfile": {"contract", "common", "operator", "gateway", "batching"},
}


@pytest.mark.parametrize("image", sorted(NEEDS))
def test_the_image_copies_every_package_its_processes_import(image: str) -> None:
    text = (REPO / "docker" / image).read_text()
    copied = set(re.findall(r"^COPY\s+(\w+)/\s", text, flags=re.MULTILINE))
    assert NEEDS[image] <= copied, f"{image} lacks COPY of {sorted(NEEDS[image] - copied)}"
