"""`elastune bench sync` (`elastune_bench.tuning.sync`): a minimal real run (own servers, worker processes)
and the shape of its report. Figures are only checked for sanity: performance lives in the benchmark."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from elastune_bench.tuning import sync
from elastune_demo import build as tiny_build
from tiny_test_model import TEST_SPEC  # the small model the worker tests already cache


def test_quick_bench_reports_compute_and_sync_per_worker_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    model = tiny_build.ensure_tiny_model(spec=TEST_SPEC)
    out = tmp_path / "sync.json"
    argv = ["--quick", "--steps", "5", "--warmup", "2", "--workers", "1,2", "--batch-size", "4"]
    assert sync.main([*argv, "--model-dir", str(model), "--json", str(out)]) == 0

    report = json.loads(out.read_text())
    assert report["config"]["quick"] is True and report["config"]["workers"] == [1, 2]
    assert report["machine"]["cores"] >= 1 and report["gradient"]["floats"] > 1
    for backend in ("redis", "memcached"):
        for n in (1, 2):
            cell = report[backend][f"workers_{n}"]
            assert cell["samples"] == n * (5 - 2)  # warm-up dropped, every worker's steps kept
            figures = [
                cell[k]
                for k in ("compute_ms", "sync_ms", "step_ms", "step_cpu_ms", "sync_share", "steps_per_s")
            ]
            assert all(math.isfinite(x) and x >= 0 for x in figures), cell
            assert cell["compute_ms"] > 0 and cell["steps_per_s"] > 0
            assert 0 <= cell["sync_share"] < 1
        assert report[backend]["workers_2"]["sync_ms"] > 0  # a real round trip through the store
        assert report[backend]["workers_2"]["per_worker_batch"] == [2, 2]  # same global batch, split
        assert "without touching the store" in report[backend]["workers_1"]["sync_mode"]
    # world=1 never touches a store: one run serves both backends
    assert report["redis"]["workers_1"] == report["memcached"]["workers_1"]

    printed = capsys.readouterr().out
    assert "sync share" in printed and "memcached" in printed and "0.4-0.5 %" in printed
