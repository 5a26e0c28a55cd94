"""tools/device_check.sh --smoke: every part of the prepared GPU check runs on this CPU with tiny shapes
and writes the JSON the GPU run will write, so the script cannot rot between GPU runs; and the 8B
run's memory plan and rooflines, computed from the config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from elastune_worker.bench.device.common import FULL
from elastune_worker.bench.device.engine import BLOCK, kv_blocks
from elastune_worker.bench.device.roofline import Shape
from elastune_worker.serving.runner.models.random_init import SHAPES

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_runs_every_part_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"PYTHON": sys.executable, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "device_check.sh"), "--smoke", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert [p["status"] for p in run["parts"]] == ["ok"] * 6
    checks = json.loads((out / "correctness.json").read_text())["checks"]
    assert all(c == "not available in this build" or isinstance(c, str) or c["ok"] for c in checks.values())
    assert checks["greedy_llama_vs_transformers"]["ok"] and checks["lora_unpadded_vs_peft"]["ok"]
    ceilings = json.loads((out / "ceilings.json").read_text())
    assert ceilings["copy_gbps"] > 0 and ceilings["matmul_tflops"] > 0
    engine = json.loads((out / "engine.json").read_text())
    assert set(engine["decode"]) == {"1", "4"} and engine["prefill"]["tokens_per_s"] > 0
    assert all(
        r["roofline_share"] > 0 and r["batch_running"] == r["batch"] for r in engine["decode"].values()
    )
    hf = json.loads((out / "hf_generate.json").read_text())
    assert hf["decode"]["4"]["engine_speedup"] > 0
    assert "EMULATED" in json.loads((out / "lora.json").read_text())["emulation"]  # on the CPU only
    coserve = json.loads((out / "coserve.json").read_text())
    assert "goal" in coserve or "skipped" in coserve
    table = (out / "table.md").read_text()
    assert "decode b=4" in table and proc.stdout.rstrip().endswith("(exit 0)")


def test_the_8b_run_fits_an_h100_with_its_kv_cache_for_batch_256() -> None:
    shape = Shape.of(SHAPES["llama-3-8b"])
    assert round(shape.params / 1e9, 2) == 8.03 and shape.kv_bytes_per_token(2) == 128 * 1024
    kv_tokens = kv_blocks(FULL) * BLOCK
    assert kv_tokens >= 256 * (FULL.context + FULL.warm_steps + FULL.decode_steps)
    weights_gib, kv_gib = shape.params * 2 / 2**30, kv_tokens * shape.kv_bytes_per_token(2) / 2**30
    assert weights_gib + kv_gib < 40  # of 78 GiB: activations, the gather copies and graphs fit beside


def test_rooflines_of_the_8b_shape() -> None:
    shape = Shape.of(SHAPES["llama-3-8b"])
    # Batch 64 at 528 tokens, 3 TB/s: 15.0 GB of weights (input embedding not read) + 4.4 GB of KV.
    step = shape.decode_step_bound_s(64, 528, 2, 3.0e12)
    assert abs(step - (shape.weight_bytes_per_step(2) + 64 * 528 * 131072) / 3.0e12) < 1e-12
    assert 6.0e-3 < step < 7.0e-3
    assert 29e12 < shape.prefill_flops(2048) < 31e12  # ~2 x 7.0 G matmul weights x 2048 + attention
