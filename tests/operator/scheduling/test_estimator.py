"""The execution-time estimator (§4.4): T_warm(a), fewest GPUs for a budget (warm and cold), online
updates of the per-iteration table and of T_cold, and profile validation. Expected values are worked
out by hand from the simple profile in scheduling_helpers (T_warm(a) = iterations / a, T_cold = 10 s)."""

import itertools

import pytest

from elastune_operator.scheduling.estimator import Estimator, LLMProfile, model_iteration_seconds
from elastune_operator.scheduling.state import Job
from scheduling_helpers import LLM, make_estimator, make_profile

# -- T_warm ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        (1, 24.0),  # 24 / 1
        (2, 12.0),  # 24 / 2
        (3, 8.0),  # 24 / 3
        (4, 6.0),  # 24 / 4
        (6, 4.0),  # 24 / 6
        (8, 3.0),  # 24 / 8
        (16, 3.0),  # clamped to max_gpus_per_job = 8: 24 / 8
    ],
)
def test_t_warm_is_iterations_over_gpus(gpus, expected):
    est = make_estimator()
    assert est.t_warm(LLM, 24, gpus) == pytest.approx(expected, abs=1e-12)


def test_t_warm_adds_bank_and_overhead_and_comm_term():
    est = make_estimator(warm_overhead_seconds=2.0, comm_fraction=0.5)
    assert est.t_warm(LLM, 24, 1) == 26.0  # 24 × 1.0 + 2 overhead (no sync term on one GPU)
    assert est.t_warm(LLM, 24, 2) == 20.0  # 24 × (1/2 × 1.5 = 0.75) + 2 = 18 + 2
    assert est.t_warm(LLM, 24, 4, bank_seconds=6.0) == 17.0  # 6 bank + 24 × (1/4 × 1.5) + 2 = 6 + 9 + 2
    assert model_iteration_seconds(make_profile(comm_fraction=0.5), 4) == 0.375  # 1/4 × 1.5


def test_iteration_seconds_and_accessors():
    est = make_estimator()
    assert est.iteration_seconds(LLM, 4) == 0.25  # 1 / 4
    assert est.iteration_seconds(LLM, 99) == 0.125  # clamped to 8 GPUs: 1 / 8
    assert est.max_gpus(LLM) == 8
    assert est.warm_overhead(LLM) == 0.0
    assert est.llms() == [LLM]


# -- fewest GPUs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("iterations", "budget", "bank", "expected"),
    [
        (24, 24.0, 0.0, 1),  # 24/1 = 24 ≤ 24 (boundary fits)
        (24, 6.0, 0.0, 4),  # 24/3 = 8 > 6, 24/4 = 6 ≤ 6 (boundary fits)
        (24, 5.9, 0.0, 5),  # 24/4 = 6 > 5.9, 24/5 = 4.8 ≤ 5.9
        (8, 2.0, 0.0, 4),  # 8/4 = 2 ≤ 2 exactly
        (24, 3.0, 0.0, 8),  # 24/8 = 3 ≤ 3: the largest allowed count, boundary fits
        (24, 2.999, 0.0, 0),  # even 24/8 = 3 > 2.999: nothing fits
        (24, 10.0, 4.0, 4),  # room 10 − 4 bank = 6 → 24/4 = 6
        (24, 3.9, 4.0, 0),  # bank alone exceeds the budget
        (0, 0.0, 0.0, 1),  # nothing left to do: one GPU
    ],
)
def test_fewest_gpus(iterations, budget, bank, expected):
    assert make_estimator().fewest_gpus(LLM, iterations, budget, bank) == expected


def test_fewest_gpus_counts_warm_overhead():
    est = make_estimator(warm_overhead_seconds=2.0)
    assert est.fewest_gpus(LLM, 24, 8.0) == 4  # room 8 − 2 = 6 → 24/4 = 6
    assert est.fewest_gpus(LLM, 24, 7.9) == 5  # room 5.9 → 24/5 = 4.8
    assert est.fewest_gpus(LLM, 24, 1.9) == 0  # room < 0


def test_fewest_gpus_matches_algorithm1_linear_search():
    """The O(log n) search equals Algorithm 1's 'A += 1 while T_warm(A) > budget' on a grid."""
    est = make_estimator(warm_overhead_seconds=0.5, comm_fraction=0.1)
    checked = 0
    for iterations in (1, 7, 24, 100):
        times = [est.t_warm(LLM, iterations, a) for a in range(1, 9)]
        for quarter in range(0, 400):
            budget = quarter / 4
            if any(abs(t - budget) < 1e-9 for t in times):
                continue  # exact ties: see test_fewest_gpus_agrees_with_t_warm_at_rounding_ties
            linear = next((a for a, t in enumerate(times, start=1) if t <= budget), 0)
            assert est.fewest_gpus(LLM, iterations, budget) == linear, (iterations, budget)
            checked += 1
    assert checked > 1500


@pytest.mark.parametrize(
    ("overrides", "iterations", "budget"),
    [
        # T_warm(8) = 648 × 0.1 = 64.8 ≤ 64.8 fits, but fewest_gpus returns 0 (64.8 / 648 < 0.1).
        ({"iteration_seconds": 0.8}, 648, 64.8),
        # T_warm(8) = 100 × 0.1375 + 0.5 = 14.250000000000002 > 14.25, but fewest_gpus returns 8.
        ({"warm_overhead_seconds": 0.5, "comm_fraction": 0.1}, 100, 14.25),
    ],
)
def test_fewest_gpus_agrees_with_t_warm_at_rounding_ties(overrides, iterations, budget):
    est = make_estimator(**overrides)
    linear = next((a for a in range(1, 9) if est.t_warm(LLM, iterations, a) <= budget), 0)
    assert est.fewest_gpus(LLM, iterations, budget) == linear


@pytest.mark.parametrize(
    ("iterations", "budget", "expected"),
    [
        (24, 16.0, 4),  # 24/4 + 10 = 16 ≤ 16 (boundary); 24/3 + 10 = 18 > 16
        (24, 34.0, 1),  # 24 + 10 = 34
        (24, 13.0, 8),  # 24/8 + 10 = 13
        (24, 12.9, 0),  # 24/8 + 10 = 13 > 12.9
        (24, 9.0, 0),  # less than T_cold alone
    ],
)
def test_fewest_gpus_cold(iterations, budget, expected):
    assert make_estimator().fewest_gpus_cold(LLM, iterations, budget) == expected


def test_fewest_gpus_cold_scans_past_a_cold_start_quantile_jump():
    est = make_estimator()
    for s in (8.0, 10.0, 12.0, 20.0):
        est.observe_cold_start(LLM, s)
    # sorted [8, 10, 12, 20]; index int(A/(A+1) × 4): A=1 → 2, A=2 → int(2.67) = 2, A=3 → 3, A≥4 → 3.
    assert [est.cold_start(LLM, a) for a in (1, 2, 3, 4, 8)] == [12.0, 12.0, 20.0, 20.0, 20.0]
    assert est.fewest_gpus_cold(LLM, 24, 24.0) == 2  # 24/2 + 12 = 24 ≤ 24
    # budget 23: 24/2 + 12 = 24 > 23; 24/3 + 20 = 28; … 24/7 + 20 = 23.43; 24/8 + 20 = 23 ≤ 23.
    assert est.fewest_gpus_cold(LLM, 24, 23.0) == 8
    assert est.fewest_gpus_cold(LLM, 24, 22.9) == 0  # 24/8 + 20 = 23 > 22.9


# -- online updates ----------------------------------------------------------------------------------


def _table(est: Estimator) -> list[float]:
    return list(est.curve(LLM)[0])


def test_observe_iteration_ewma_and_correction():
    est = make_estimator(ewma_alpha=0.5)
    assert _table(est) == pytest.approx([1 / a for a in range(1, 9)])

    est.observe_iteration(LLM, 2, 1.0)
    # observed[2] = 1.0 (first sample); ratio = 1.0 / 0.5 = 2 → correction = 0.5 × 1 + 0.5 × 2 = 1.5.
    # a ≠ 2 use model × 1.5: [1.5, (1.0), 0.5, 0.375, 0.3, 0.25, 1.5/7, 0.1875].
    assert _table(est) == pytest.approx([1.5, 1.0, 0.5, 0.375, 0.3, 0.25, 1.5 / 7, 0.1875])

    est.observe_iteration(LLM, 2, 0.5)
    # observed[2] = 0.5 × 1.0 + 0.5 × 0.5 = 0.75; ratio 0.5/0.5 = 1 → correction = 0.5 × 1.5 + 0.5 = 1.25.
    assert _table(est) == pytest.approx([1.25, 0.75, 1.25 / 3, 0.3125, 0.25, 1.25 / 6, 1.25 / 7, 0.15625])
    assert est.t_warm(LLM, 8, 2) == pytest.approx(6.0)  # 8 × 0.75


def test_observe_iteration_keeps_the_table_non_increasing():
    est = make_estimator(ewma_alpha=0.5)
    est.observe_iteration(LLM, 2, 1.0)  # correction 1.5, observed[2] = 1.0 (see above)
    est.observe_iteration(LLM, 2, 0.5)  # correction 1.25, observed[2] = 0.75
    est.observe_iteration(LLM, 4, 2.0)  # a noisy sample: slower on 4 GPUs than on 2
    # observed[4] = 2.0; ratio = 2.0 / 0.25 = 8 → correction = 0.5 × 1.25 + 0.5 × 8 = 4.625.
    # raw: [4.625, 0.75, 1.5417, 2.0, 0.925, 0.7708, 0.6607, 0.5781]; clamped by the running minimum:
    expected = [4.625, 0.75, 0.75, 0.75, 0.75, 0.75, 4.625 / 7, 4.625 / 8]
    table = _table(est)
    assert table == pytest.approx(expected)
    assert all(b <= a for a, b in itertools.pairwise(table))
    assert est.curve(LLM)[1] == [-t for t in table]  # the bisect mirror is rebuilt too
    # fewest GPUs stays exact on the clamped table: 10 iterations, 7.5 s → 0.75 s/iter → a = 2;
    # 6.7 s → 0.67 s/iter → first entry ≤ 0.67 is a = 7 (0.6607).
    assert est.fewest_gpus(LLM, 10, 7.5) == 2
    assert est.fewest_gpus(LLM, 10, 6.7) == 7


def test_observe_iteration_ignores_nonsense():
    est = make_estimator()
    before = _table(est)
    est.observe_iteration(LLM, 9, 1.0)  # more GPUs than max_gpus_per_job = 8
    est.observe_iteration(LLM, 0, 1.0)
    est.observe_iteration(LLM, 2, 0.0)
    est.observe_iteration(LLM, 2, -1.0)
    assert _table(est) == before


def test_cold_start_defaults_to_profile_then_quantile_of_observations():
    est = make_estimator()
    assert est.cold_start(LLM) == 10.0  # configured
    assert est.cold_start(LLM, 4) == 10.0
    est.observe_cold_start(LLM, -1.0)  # ignored
    assert est.cold_start(LLM) == 10.0
    est.observe_cold_start(LLM, 7.0)
    assert est.cold_start(LLM, 1) == 7.0  # one sample: index min(0, int(0.5)) = 0
    for s in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 9.0, 10.0):
        est.observe_cold_start(LLM, s)
    # samples 1..10 sorted; index int(A/(A+1) × 10): A=1 → 5 (6 s), A=3 → 7 (8 s), A=4 → 8 (9 s),
    # A=9 → 9 (10 s), A=99 → int(9.9) = 9 (10 s).
    assert [est.cold_start(LLM, a) for a in (1, 3, 4, 9, 99)] == [6.0, 8.0, 9.0, 10.0, 10.0]


def test_cold_start_keeps_only_the_32_most_recent_samples():
    est = make_estimator()
    for s in range(1, 41):
        est.observe_cold_start(LLM, float(s))
    # kept: 9..40 (32 samples); A=1 → index 16 → 25; A=31 → index int(31/32 × 32) = 31 → 40.
    assert est.cold_start(LLM, 1) == 25.0
    assert est.cold_start(LLM, 31) == 40.0


# -- validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"iteration_seconds": 0.0},
        {"iteration_seconds": -1.0},
        {"cold_start_seconds": -0.1},
        {"max_gpus_per_job": 0},
    ],
)
def test_invalid_profiles_raise(overrides):
    with pytest.raises(ValueError, match="invalid profile for 'm'"):
        make_profile(**overrides)


def test_zero_cold_start_is_a_valid_profile():
    assert make_profile(cold_start_seconds=0.0).cold_start_seconds == 0.0


@pytest.mark.parametrize("alpha", [0.0, -0.5, 1.01])
def test_invalid_ewma_alpha_raises(alpha):
    with pytest.raises(ValueError, match="ewma_alpha"):
        Estimator([make_profile()], ewma_alpha=alpha)


def test_unknown_llm_raises_key_error_naming_known_ones():
    est = make_estimator()
    with pytest.raises(KeyError, match="no profile for LLM 'x'; known: \\['m'\\]"):
        est.t_warm("x", 1, 1)


def test_register_replaces_a_profile():
    est = make_estimator()
    est.register(LLMProfile("m", 2.0, 5.0, 0.0, 0.0, 0.0, 4))
    assert est.t_warm(LLM, 8, 8) == 4.0  # 8 × 2.0 / 4 (clamped to the new max of 4 GPUs)
    assert est.cold_start(LLM) == 5.0


@pytest.mark.parametrize(("slo", "iterations"), [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_invalid_jobs_raise(slo, iterations):
    with pytest.raises(ValueError, match="slo must be > 0"):
        Job("j", LLM, 0.0, slo, iterations)
