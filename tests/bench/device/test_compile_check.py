"""Every Triton kernel variant the engine launches compiles for an H100/H200 (sm_90) on this machine,
without a GPU (bench/elastune_bench/device/compile_check.py): the CPU's interpreter accepts code that
Hopper's compiler may not, and the GPU runs are short and rare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="compiling the kernels needs the triton package")

ENV = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
MODULE = "elastune_bench.device.compile_check"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args], env=ENV, capture_output=True, text=True, timeout=600
    )


def test_every_variant_the_engine_launches_compiles_for_sm90(tmp_path: Path) -> None:
    out, saved = tmp_path / "result.json", tmp_path / "launches.json"
    proc = run("--json", str(out), "--save-launches", str(saved))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failed"] == 0 and result["arch"] == 90
    rows = result["results"]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"paged_attention_kernel", "merge_splits_kernel", "add_rms_norm_kernel", "rope_kernel",
                       "silu_mul_kernel", "lora_shrink_kernel", "lora_expand_kernel"}  # fmt: skip
    decode = [r["constexprs"] for r in rows if r["kernel"] == "paged_attention_kernel"]
    assert {c["SPLITS"] for c in decode if c["TILE_Q"] == 1} == {1, 2, 4, 8, 16}  # the GPU's split counts
    assert {c["TILE_Q"] for c in decode} == {1, 16}  # decodes and the cached-prefix tile
    lora = [r["constexprs"] for r in rows if r["kernel"].startswith("lora_")]
    assert lora and all(c["UPCAST"] is False for c in lora)  # as a GPU compiles them
    assert all(r["shared_bytes"] <= 232_448 for r in rows)

    # A variant the compiler refuses is reported by name and fails the check.
    launches = json.loads(saved.read_text())
    shrink = next(x for x in launches if x["name"] == "lora_shrink_kernel")
    bad = shrink | {"values": shrink["values"] | {"BLOCK_M": 3}}  # tl.arange needs a power of 2
    (tmp_path / "bad.json").write_text(json.dumps([bad]))
    proc = run("--launches", str(tmp_path / "bad.json"), "--json", str(out))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    assert not row["ok"] and row["constexprs"]["BLOCK_M"] == 3 and row["error"]
    assert "FAIL lora_shrink_kernel" in proc.stdout
