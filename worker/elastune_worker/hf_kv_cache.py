"""The KV-cache argument of a transformers model's forward, under either of its names.

transformers 5.24 renamed a forward's ``past_key_values`` argument and output field to ``cache``; the
supported range (pyproject: transformers >= 4.57) spans both names. A forward that takes ``**kwargs``
drops the name it does not know without an error: a co-served job on transformers 5.23 passed
``cache=`` and ran each token window without the keys and values of the earlier ones, so it trained a
different prompt than the dedicated trainer and said nothing. The model's own signature says which name
it takes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any

NAMES = ("cache", "past_key_values")


def cache_kwargs(model: Any, kv: Any) -> dict[str, Any]:
    """``{name: kv}`` for ``model(...)``, the name the model's forward takes."""
    return {_name_taken_by(type(model).forward): kv}


def output_cache(outputs: Any) -> Any:
    """The KV cache a forward returned (``use_cache=True``), under either name."""
    return outputs.cache if "cache" in outputs else outputs.past_key_values  # a ModelOutput: a mapping


@cache
def _name_taken_by(forward: Callable[..., Any]) -> str:
    params = inspect.signature(forward).parameters
    for name in NAMES:
        if name in params:
            return name
    raise TypeError(f"{forward.__qualname__} takes no KV cache argument (one of {NAMES})")
