"""`elastune_bench.attention_cpu` at its smallest sizes: every variant is timed or carries its error,
and the flex variants were checked against the engine's gather + SDPA before any timing. No speed is
asserted (a shared CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from elastune_bench.attention_cpu import VARIANTS


def test_smallest_run_times_or_records_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "attention_cpu.json"
    argv = ["--shapes", "llama-micro", "--batches", "1", "--contexts", "128", "--rounds", "1",
            "--sample-s", "0.002", "--json", str(out)]  # fmt: skip
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [sys.executable, "-m", "elastune_bench.attention_cpu", *argv],
        env=env, capture_output=True, text=True, timeout=120,  # ~7 s; a cold inductor cache ~15 s
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["rounds"] == 1 and data["load_avg_start"] and data["load_avg_end"]
    [case] = data["cases"]
    assert (case["shape"], case["batch"], case["context"]) == ("llama-micro", 1, 128)
    variants = case["variants"]
    assert set(variants) == set(VARIANTS)
    assert variants["gather"]["us"] > 0 and variants["gather"]["speedup"] == 1.0
    for name in ("flex_eager", "flex_compiled"):
        v = variants[name]
        assert ("us" in v) != ("error" in v), (name, v)  # timed, or an error recorded instead
        if "us" in v:  # timed only after it matched gather
            assert v["checked"] and v["correct"] and v["max_abs_err"] <= data["atol"]
            assert len(v["rounds_us"]) == 1 and v["speedup"] > 0
    # the correctness check ran (the eager flex is small enough here to run on any machine)
    assert variants["flex_eager"]["checked"] is True
    assert "micro_bar_met" in data["decision"]
