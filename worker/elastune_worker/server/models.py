"""Resolve a WarmPool's ``model`` to a local directory and load it once: what makes a worker warm."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastune_contract.model_source import (
    DEFAULT_MODEL_CACHE_PATH,
    FETCHED_MARKER,
    MODEL_CACHE_ENV,
    parse_model_source,
)
from elastune_contract.vocabulary import Reason
from elastune_worker.tuning.trainer import pick_device

MODELS_GROUP = "elastune.models"
"""Entry-point group of named models a package adds (the demo fixtures: ``tiny-gpt2``, ``tiny-llama``):
each names a function that returns the model's directory. The worker never imports their package."""
DEMO_MODEL_NAMES = ("tiny-gpt2", "elastune/tiny-gpt2", "tiny-llama", "elastune/tiny-llama")
"""The names the demo package registers: a clear error when it is not installed."""

MODEL_LOAD_FAILED = Reason.MODEL_LOAD_FAILED


class ModelLoadError(RuntimeError):
    reason = MODEL_LOAD_FAILED


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: Any
    tokenizer: Any
    device: torch.device
    load_seconds: float


def fetched_model_dir(name: str) -> Path | None:
    """The model cache's directory of an hf://, s3:// or pvc:// ``name`` (the pool's fetch Job put it
    there: ``$ELASTUNE_MODEL_CACHE/<source dir>``, the cache claim mounted read-only); None for other
    names. ModelLoadError when it is not fetched (yet)."""
    try:
        source = parse_model_source(name)
    except ValueError:
        return None  # today's names (paths included) load as before
    if not source.fetched:
        return None
    cache = Path(os.environ.get(MODEL_CACHE_ENV) or DEFAULT_MODEL_CACHE_PATH)
    path = cache / source.cache_dir
    if not (path / FETCHED_MARKER).is_file():
        raise ModelLoadError(
            f"model {name!r} is not in the model cache ({path} has no {FETCHED_MARKER}): the pool's "
            "model-fetch Job fetches it before workers start"
        )
    return path


def named_model_dir(name: str) -> Path | None:
    """The directory of a model a package registers under ``name`` in the ``elastune.models`` entry
    points (built if missing); None when none does. A demo name without the demo package is a
    ModelLoadError that says what to install or name instead (production images may ship no demo models)."""
    from importlib.metadata import entry_points

    found = entry_points(group=MODELS_GROUP, name=name)
    builder = None
    if found:
        try:
            builder = next(iter(found)).load()
        except ImportError:  # registered by the distribution, its package left out (an image without demo)
            builder = None
    if builder is not None:
        return Path(builder())
    if name in DEMO_MODEL_NAMES:
        raise ModelLoadError(
            f"model {name!r} is a demo model of the elastune_demo package, which is not installed here: "
            "install it (pip install -e . from a checkout; the worker image's demo step) or name a real "
            "model (a Hugging Face id, a local directory, or an hf://, s3:// or pvc:// source)"
        )
    return None


def resolve_model(name: str) -> Path:
    """A local directory for ``name``: a fetched source's directory of the model cache (never downloaded
    here), a model a package registers by name (the demo's tiny models, built if missing), a path, or a
    Hugging Face id resolved through the local HF cache (downloaded only if the environment allows it —
    pods set HF_HUB_OFFLINE=1)."""
    fetched = fetched_model_dir(name)
    if fetched is not None:
        return fetched
    named = named_model_dir(name)
    if named is not None:
        return named
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or name.startswith("."):
        raise ModelLoadError(f"model {name!r}: {path} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1"))
    except Exception as exc:
        raise ModelLoadError(
            f"model {name!r} is neither a local directory nor a loadable Hugging Face id: {exc}"
        ) from exc


def load_model(name: str, device: torch.device | str | None = None) -> LoadedModel:
    """Tokenizer and base weights on the chosen device (GPU when there is one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    path = resolve_model(name)
    dev = torch.device(device) if device is not None else pick_device()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model {name!r} at {path} does not load: {exc}") from exc
    model.to(dev)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return LoadedModel(name, path, model, tokenizer, dev, time.perf_counter() - t0)
