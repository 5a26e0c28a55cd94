"""``elastune bench tenancy --quick`` end to end on short phases: the three modes (the gateway's fair line,
FCFS, and FCFS in front of a worker whose engine queue shares by key) are measured, each phase reports the
victim's and the flooder's answers, and the goal is computed from them. The shape only: the figures of a
few seconds on shared cores are not the goal's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_quick_bench_reports_both_modes_and_the_goal(tmp_path: Path) -> None:
    out = tmp_path / "tenancy.json"
    cmd = [sys.executable, "-m", "elastune_bench.routing.tenancy", "--quick", "--phase-s", "2"]
    cmd += ["--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["capacity_per_s"] > 0
    assert abs(result["flood_rate_per_s"] - 10 * result["victim_rate_per_s"]) < 0.1
    for mode in ("fair", "fcfs", "engine_fair"):
        row = result[mode]
        for phase in ("victim_alone", "victim_with_flood", "flood"):
            p = row[phase]
            assert p["sent"] > 0, (mode, phase)
            assert p["statuses"].get("200", 0) > 0, (mode, phase, p)
            assert {"ttft_ms_p50", "ttft_ms_p99", "served_per_s", "unfinished"} <= set(p)
    for mode in ("fcfs", "engine_fair"):  # no line, no per-key bound without the gateway's fairness
        assert "429" not in result[mode]["flood"]["statuses"]
    goal = result["goal"]
    assert goal["victim_p99_ratio_at_most"] == 1.5 and isinstance(goal["met"], bool)
    assert "engine_fair_victim_p99_ratio" in goal
