"""The demo model names a worker resolves through the ``elastune.models`` entry points (pyproject.toml).

The worker never imports this package: ``elastune_worker.server.models`` looks a WarmPool's ``model`` up in
that entry-point group and calls the builder it names, which builds the model offline on first use (no hub
download) and returns its directory.
"""

from __future__ import annotations

from pathlib import Path

from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model


def tiny_gpt2() -> Path:
    """``tiny-gpt2`` / ``elastune/tiny-gpt2``: the default tiny GPT-2."""
    return ensure_tiny_model()


def tiny_llama() -> Path:
    """``tiny-llama`` / ``elastune/tiny-llama``: the tiny Llama (2,048 positions, GQA, chat template)."""
    return ensure_tiny_model(spec=TINY_LLAMA_SPEC)
