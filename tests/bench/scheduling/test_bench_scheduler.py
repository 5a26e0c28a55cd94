"""The scheduler benchmark's comparison logic on synthetic grids: ratios, the grid maxima set beside
the abstract's "up to" figures, and the per-setting comparison with the paper's §6.2 values."""

import pytest

from elastune_bench.scheduling.scheduler import grid_max, ratios, versus_paper
from elastune_bench.sim.scheduling.experiments import Cell


def cells(pt: tuple[float, float], inf: tuple[float, float], ef: tuple[float, float]) -> dict[str, Cell]:
    """(violation %, cost $) per policy."""
    return {
        name: Cell(slo_violation_pct=v, cost_usd=c, utilization_pct=0.0)
        for name, (v, c) in (("promptTuner", pt), ("infless", inf), ("elasticflow", ef))
    }


def test_ratios_are_baseline_over_prompttuner():
    r = ratios(cells((10.0, 20.0), (30.0, 26.0), (60.0, 57.0)))
    assert r == {
        "slo_vs_infless": 3.0,
        "slo_vs_elasticflow": 6.0,
        "cost_vs_infless": 1.3,
        "cost_vs_elasticflow": 2.85,
    }
    # No PromptTuner violation: infinite ratio unless the baseline has none either.
    assert ratios(cells((0.0, 1.0), (5.0, 1.0), (0.0, 1.0)))["slo_vs_infless"] == float("inf")
    assert ratios(cells((0.0, 1.0), (5.0, 1.0), (0.0, 1.0)))["slo_vs_elasticflow"] == 1.0


def test_grid_max_takes_each_ratio_at_its_own_setting():
    grid = {
        "low_S1.0": {"slo_vs_infless": 4.5, "cost_vs_infless": 1.2},
        "medium_S1.0": {"slo_vs_infless": 3.0, "cost_vs_infless": 1.7},
        "high_S1.5": {"slo_vs_infless": 4.5, "cost_vs_infless": 1.1},
    }
    best, at = grid_max(grid)
    assert best == {"slo_vs_infless": 4.5, "cost_vs_infless": 1.7}
    assert at == {"slo_vs_infless": "low_S1.0", "cost_vs_infless": "medium_S1.0"}  # first on ties


def test_grid_max_of_a_grid_from_cells():
    grid = {
        "a": ratios(cells((10.0, 20.0), (20.0, 30.0), (80.0, 60.0))),
        "b": ratios(cells((5.0, 30.0), (25.0, 33.0), (40.0, 60.0))),
    }
    best, at = grid_max(grid)
    assert best == {
        "slo_vs_infless": 5.0,
        "slo_vs_elasticflow": 8.0,
        "cost_vs_infless": 1.5,
        "cost_vs_elasticflow": 3.0,
    }
    assert at == {
        "slo_vs_infless": "b",
        "slo_vs_elasticflow": "a",
        "cost_vs_infless": "a",
        "cost_vs_elasticflow": "a",
    }


def test_versus_paper_points_and_savings_next_to_the_papers():
    out = versus_paper("medium_S1.0", cells((12.4, 22.9), (32.4, 29.74), (62.4, 57.25)))
    assert out["ours"] == {
        "viol_points_vs_infless": 20.0,
        "viol_points_vs_elasticflow": 50.0,
        "cost_saving_vs_infless": pytest.approx(0.23, abs=1e-3),
        "cost_saving_vs_elasticflow": pytest.approx(0.6, abs=1e-3),
    }
    reported = out["paper"]
    assert reported["viol_points_vs_infless"] == (15.0, 25.0)
    assert reported["viol_points_vs_elasticflow"] == (48.0, 51.0)
    assert reported["cost_saving_vs_infless"] == 0.23
    assert "cost_saving_vs_elasticflow_max" not in reported  # stated for S = 1.5 only
    assert "§6.2" in reported["source"]


def test_versus_paper_on_a_setting_the_paper_does_not_plot():
    assert versus_paper("low_S0.5", cells((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)))["paper"] is None
