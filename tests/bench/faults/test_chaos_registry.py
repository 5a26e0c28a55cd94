"""The chaos bench keeps every case of issue 38's Why (22 fault and bad-input cases) as an experiment, with at
least 20 experiments, and lists them without running anything (`elastune bench chaos --list`)."""

from __future__ import annotations

import pytest

from elastune_bench.faults import chaos, registry

#: The cases the issue found lost (its items (1)-(8), FLUSHALL and Redis down apart), by what broke.
LOST = {"W1": "SIGTERM", "W2": "paused", "K1": "Redis down", "K2": "FLUSHALL", "A1": "overflow",
        "A2": "failed to load", "I1": "surrogate", "L1": "Redis killed", "L2": "run"}  # fmt: skip


def test_every_case_of_the_issue_is_kept_by_an_experiment() -> None:
    assert len(registry.CASES) == 22 and len({c.id for c in registry.CASES}) == 22
    assert (
        sum(c.was == "lost" for c in registry.CASES) == 9
        and sum(c.was == "held" for c in registry.CASES) == 13
    )
    assert len(registry.EXPERIMENTS) >= 20 and len(registry.BY_NAME) == len(registry.EXPERIMENTS)
    assert registry.uncovered() == []
    cases = {c.id: c for c in registry.CASES}
    for cid, words in LOST.items():
        assert cases[cid].was == "lost" and words.lower() in cases[cid].what.lower(), cases[cid]
    for exp in registry.EXPERIMENTS:
        assert exp.run.__doc__, f"{exp.name}: says what it does and what held means"


def test_list_prints_every_case_and_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    assert chaos.main(["--list"]) == 0
    printed = capsys.readouterr().out
    for case in registry.CASES:
        assert f"| {case.id} |" in printed
    for exp in registry.EXPERIMENTS:
        assert f"| {exp.name} |" in printed


def test_only_refuses_a_name_that_is_no_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        chaos.main(["--only", "bad-key,no-such-experiment"])
    assert "no such experiment: no-such-experiment" in capsys.readouterr().err
