"""The images carry every import package their components import (no container engine here to build
them, so the Dockerfiles are read): a package missing from a COPY fails only when the image starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Image -> the top-level folders (import packages) its processes import.
NEEDS = {
    "worker.Dockerfile": {"contract", "common", "worker", "ssjf"},
    "operator.Dockerfile": {"contract", "common", "operator", "gateway", "worker", "cli"},
}


@pytest.mark.parametrize("image", sorted(NEEDS))
def test_the_image_copies_every_package_its_processes_import(image: str) -> None:
    text = (REPO / "docker" / image).read_text()
    copied = set(re.findall(r"^COPY\s+(\w+)/\s", text, flags=re.MULTILINE))
    assert NEEDS[image] <= copied, f"{image} lacks COPY of {sorted(NEEDS[image] - copied)}"


def test_the_worker_image_installs_the_demo_fixtures_apart_from_the_worker_package():
    """The demo models stay for a zero-setup first run, but as their own labelled step: demo/ is not in
    the tree `pip install` packs, and only the worker image carries it."""
    text = (REPO / "docker" / "worker.Dockerfile").read_text()
    install = text.index('pip install ".[worker]"')
    assert not re.search(r"^COPY demo/", text[:install], re.MULTILINE)
    demo = text[install:]
    assert re.search(r"^COPY demo/ /opt/elastune/demo/$", demo, re.MULTILINE)
    assert "ENV PYTHONPATH=/opt/elastune/demo" in demo and "python -m elastune_demo.build" in demo
    assert "demo/" not in (REPO / "docker" / "operator.Dockerfile").read_text().replace("No demo/", "")
