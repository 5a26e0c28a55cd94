"""`elastune bench chaos` cannot rot: two of its cheap experiments through the bench's own entry point, on
its real local stack, the light one (redis-server, `elastune serve` with one warm local worker, the gateway
and API keys; no TuningJob, no broken pool or adapters, which these two need not): a poison
registry record and event, and one bad request (seed 2**64) among 8 streams. Both must hold, and the JSON
has one {"held", "detail", "seconds", "cases"} entry per experiment run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from elastune_bench.faults import chaos

CHEAP = ("poison-record-and-event", "bad-request-among-8-streams")


def test_two_cheap_experiments_hold_and_are_written_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chaos.json"
    argv = ["--quick", "--light", "--keep", str(tmp_path / "state"), "--json", str(out)]
    for name in CHEAP:
        argv += ["--only", name]
    rc = chaos.main(argv)
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert sorted(doc) == sorted(CHEAP), printed
    for name in CHEAP:
        assert set(doc[name]) == {"held", "detail", "seconds", "cases"} and doc[name]["detail"], doc
        assert doc[name]["held"] is True, f"{name}: {doc[name]['detail']}\n{printed}"
        assert f"| {name}" in printed  # the table row
    assert "8/8 streams completed" in doc["bad-request-among-8-streams"]["detail"]
    assert rc == 0


def test_table_marks_lost_experiments() -> None:
    text = chaos.table({"a": chaos.Outcome(True, "fine"), "bb": chaos.Outcome(False, "404 for 80 s")})
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()]
    assert rows[0] == ["experiment", "held/lost", "what was seen"]
    assert rows[2:] == [["a", "held", "fine"], ["bb", "LOST", "404 for 80 s"]]
