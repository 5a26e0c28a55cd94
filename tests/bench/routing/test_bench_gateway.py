"""``elastune bench gateway --quick`` end to end on a few requests: every front answers every request,
its CPU is measured, the added latency is against the direct calls of the same run, and a peer router
that cannot run here is reported as skipped with its reason (never silently left out)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REQUESTS = 24


def test_the_quick_bench_measures_every_front_on_the_same_worker(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    cmd = [sys.executable, "-m", "elastune_bench.routing.gateway", "--quick", "--requests", str(REQUESTS)]
    cmd += ["--concurrency", "4", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    for load in ("short", "stream"):
        fronts = result[load]
        assert {"direct", "elastune", "elastune_auth_off"} <= set(fronts)
        assert set(fronts) | set(result["skipped"]) >= {"vllm_router", "smg"}
        for name, row in fronts.items():
            assert row["errors"] == 0 and row["requests"] == REQUESTS, (load, name, row)
            assert row["cpu_ms_per_request"] > 0, (load, name)
            assert row["latency_ms_p50"] > 0
            if name != "direct":
                assert "added_ms_p50" in row and "added_ms_p99" in row
        if "smg" in fronts:
            ratio = fronts["elastune"]["cpu_ms_per_request"] / fronts["smg"]["cpu_ms_per_request"]
            assert result["goal"][load]["cpu_vs_smg"] == round(ratio, 2)
    for name, why in result["skipped"].items():
        assert why, name
