"""Named workload profiles (calibrated, heavy) and the calibration fit: profile selection, the
profiles' recipes, residual and loss arithmetic, and the search on a synthetic objective."""

import math

import pytest

from elastune_bench.sim.scheduling import calibrate, paper
from elastune_bench.sim.scheduling.workload import (
    CALIBRATED,
    HEAVY,
    LOADS,
    PROFILE_NAMES,
    PROFILES,
    WorkloadConfig,
    WorkloadProfile,
    generate,
    paper_llms,
    profile,
)


def test_profile_selection_by_name():
    assert PROFILE_NAMES == ("calibrated", "heavy")
    assert set(PROFILES) == set(PROFILE_NAMES)
    assert profile("calibrated") is CALIBRATED
    assert profile("heavy") is HEAVY
    with pytest.raises(ValueError, match="calibrated, heavy"):
        profile("paper")


@pytest.mark.parametrize(("load", "s"), [("low", 0.5), ("medium", 1.0), ("high", 1.5)])
def test_heavy_profile_is_the_workload_before_calibration(load, s):
    """The heavy profile reproduces the old default WorkloadConfig trace for trace, job for job."""
    old = WorkloadConfig(jobs_per_llm=dict(LOADS[load]), slo_emergence=s, seed=3)
    assert generate(HEAVY.config(load, s, seed=3)) == generate(old)


def test_calibrated_profile_follows_its_recipe():
    cfg = CALIBRATED.config("medium", 1.5, seed=2)
    assert cfg.jobs_per_llm == LOADS["medium"] and cfg.slo_emergence == 1.5 and cfg.seed == 2
    colds = {n: m.profile.cold_start_seconds for n, m in cfg.llms.items()}
    assert colds == pytest.approx({"gpt2-base": 14.0, "gpt2-large": 21.0, "vicuna-7b": 35.0})
    jobs = generate(cfg)
    assert len(jobs) == sum(LOADS["medium"].values())
    for j in jobs:
        assert j.slo == pytest.approx(j.trace_duration * 1.5 + 0.6 * colds[j.llm])
        assert paper.BANK_MIN_SPEEDUP <= j.bank_speedup <= 4.7
    single = sum(j.trace_gpus == 1 for j in jobs) / len(jobs)
    assert 0.85 <= single <= 0.95  # 90 % of the trace on one GPU


def test_calibrated_constants_are_the_fitted_point():
    assert calibrate.profile_from(calibrate.FITTED) == CALIBRATED
    assert CALIBRATED.burstiness == calibrate.BURSTINESS


def test_profile_validation_and_unknown_load():
    with pytest.raises(ValueError):
        WorkloadProfile(10.0, 1.0, (1.0, 0.0, 0.0), 1.0, 1.0, 1.0, (1.5, 0.35, 1.2, 4.7))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        WorkloadProfile(10.0, 1.0, (1, 0, 0, 0), 1.0, 0.0, 1.0, (1.5, 0.35, 1.2, 4.7))
    with pytest.raises(ValueError, match="unknown load"):
        HEAVY.config("extreme")
    with pytest.raises(ValueError):
        paper_llms(cold_start_scale=0.0)


def test_gpu_weights_are_geometric_and_normalised():
    assert calibrate.gpu_weights(0.1) == (0.9, 0.09, 0.009, 0.001)
    assert calibrate.gpu_weights(1.0) == (0.25, 0.25, 0.25, 0.25)
    assert math.isclose(sum(calibrate.gpu_weights(0.55)), 1.0, abs_tol=2e-3)


def _measurement(**anchors: float) -> calibrate.Measurement:
    values = {k: target for k, (target, _, _) in calibrate.ANCHORS.items()}
    values.update(anchors)
    return calibrate.Measurement(values, {})


def test_residuals_and_weighted_loss():
    m = _measurement(pt_cost_usd=22.9 * 1.1, infless_init_wait_pct=22.0)
    res = m.residuals()
    assert res["pt_violation_pct"] == 0.0 and res["ef_utilization_pct"] == 0.0
    assert res["pt_cost_usd"] == pytest.approx(0.1)
    assert res["infless_init_wait_pct"] == pytest.approx(1.0)
    # (0.1 / 0.10)² + (1.0 / 0.40)² = 1 + 6.25
    assert m.loss() == pytest.approx(7.25)


def test_fit_is_a_deterministic_coordinate_descent(monkeypatch):
    """On a synthetic objective (no simulation) the search reaches the grid's minimum, and twice the
    same answer."""
    target = {"a": 2.0, "b": 30.0}

    def fake_measure(prof: WorkloadProfile, seeds, sim=None) -> calibrate.Measurement:
        a, b = prof.duration_median_seconds, prof.cold_start_scale
        # Cost grows with a, violations with |b − 30| (as multiples of their tolerance).
        return _measurement(
            pt_cost_usd=22.9 * (1 + 0.1 * abs(a - target["a"])),
            pt_violation_pct=12.4 * (1 + 0.01 * abs(b - target["b"])),
        )

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    space = {
        "duration_median_seconds": (1.0, 2.0, 3.0, 4.0),
        "cold_start_scale": (10.0, 20.0, 30.0, 40.0),
        "duration_sigma": (1.0,),
        "gpu_decay": (0.5,),
        "slo_overhead_factor": (1.0,),
        "bank_median": (1.5,),
    }
    start = {k: v[0] for k, v in space.items()}
    runs = [calibrate.fit(space=space, start=start, samples=3) for _ in range(2)]
    assert runs[0].point == runs[1].point
    assert runs[0].point["duration_median_seconds"] == 2.0 and runs[0].point["cold_start_scale"] == 30.0
    assert runs[0].measurement.loss() == pytest.approx(0.0)


def test_paper_data_module_transcriptions():
    assert paper.TABLE8["workloadScheduler"] == (12.4, 22.9)
    assert paper.ABSTRACT_UP_TO == {
        "slo_vs_infless": 4.0,
        "slo_vs_elasticflow": 7.9,
        "cost_vs_infless": 1.6,
        "cost_vs_elasticflow": 4.5,
    }
    assert paper.FIG7["medium_S0.5"].cost_saving_vs_infless == 0.38
    assert paper.FIG7["medium_S1.5"].cost_saving_vs_elasticflow_max == 0.70
    implied = paper.implied_ratios_medium()
    assert implied["slo_vs_infless"] == pytest.approx(((12.4 + 15) / 12.4, (12.4 + 25) / 12.4))
    assert implied["cost_vs_infless"][0] == pytest.approx(1 / 0.77)
