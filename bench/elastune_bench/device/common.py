"""What every part of the device check shares: the sizes of a full and a smoke run, timing that
waits for the device, the engine features this build has, and writing a part's JSON."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Sizes:
    """A run's sizes: the full run on a GPU, or ``--smoke`` on any machine's CPU in seconds."""

    device: str
    shape: str
    """The engine benchmark's model (modeling/random_init.py SHAPES)."""
    dtype: str
    decode_batches: tuple[int, ...]
    context: int
    """Prompt tokens of each decode-benchmark request."""
    decode_steps: int
    """Timed decode steps per batch (after the warm-up steps)."""
    warm_steps: int
    prefill_len: int
    prefill_prompts: int
    max_batched_tokens: int
    hf_batches: tuple[int, ...]
    hf_new_tokens: int
    copy_bytes: int
    matmul_n: int


FULL = Sizes(
    device="cuda", shape="llama-3-8b", dtype="bfloat16", decode_batches=(1, 16, 64, 256), context=512,
    decode_steps=32, warm_steps=4, prefill_len=2048, prefill_prompts=8, max_batched_tokens=8192,
    hf_batches=(1, 64), hf_new_tokens=32, copy_bytes=2 << 30, matmul_n=8192,
)  # fmt: skip
SMOKE = Sizes(
    device="cpu", shape="llama-micro", dtype="float32", decode_batches=(1, 4), context=32,
    decode_steps=4, warm_steps=1, prefill_len=64, prefill_prompts=2, max_batched_tokens=256,
    hf_batches=(1, 4), hf_new_tokens=4, copy_bytes=16 << 20, matmul_n=256,
)  # fmt: skip


def sizes(smoke: bool) -> Sizes:
    return SMOKE if smoke else FULL


def part_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("out", type=Path, help="output folder")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on this machine's CPU")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return args


def write_part(out: Path, name: str, data: dict[str, Any]) -> Path:
    """Write ``out/<name>.json`` atomically (a reader never sees half a file)."""
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def read_part(out: Path, name: str) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return data


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Seconds ``fn`` takes, the device's queued work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def engine_features() -> dict[str, Any]:
    """The EngineConfig options of issue 26 items 1-2 that this build has (another change adds them):
    ``cuda_graphs`` (bool) and ``attention_backend`` (with its allowed values where a Literal says)."""
    import dataclasses
    import typing

    from elastune_worker.engine.core import config as C

    fields = {f.name: f for f in dataclasses.fields(C.EngineConfig)}
    hints = typing.get_type_hints(C.EngineConfig, vars(C))
    backends: list[str] = []
    if "attention_backend" in fields:
        backends = [a for a in typing.get_args(hints["attention_backend"]) if isinstance(a, str)]
    return {
        "options": sorted(fields),
        "cuda_graphs": "cuda_graphs" in fields,
        "attention_backend": "attention_backend" in fields,
        "attention_backends": backends,
        "attention_backend_default": fields["attention_backend"].default
        if "attention_backend" in fields
        else None,
    }


NOT_AVAILABLE = "not available in this build"


def figures(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant figures: a rate rounded to fixed decimals read 0.0 when a smoke
    run's tiny shape ran slowly beside other work (and failed its test)."""
    return float(f"{x:.{digits}g}")


def device_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": device}
    # The GPU image brings its own transformers and peft: their versions decide what runs (one name of
    # a forward's KV-cache argument or the other: elastune_worker/hf_kv_cache.py).
    for package in ("transformers", "peft", "triton"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                 "multiprocessors": p.multi_processor_count}  # fmt: skip
    else:
        info |= {"name": "cpu", "threads": torch.get_num_threads()}
    return info
