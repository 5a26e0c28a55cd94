"""PromptTuner's switchable mechanisms against idle and starting spend: early release of idle warm GPUs,
idle windows sized on T_cold, and sizing Prompt-Bank jobs on the bank's minimum speedup.

Profile (scheduling_helpers): T_warm(a) = iterations / a, T_cold = 10 s, at most 8 GPUs per job."""

import pytest

from elastune_operator.scheduling.policy import PoolLimits
from elastune_operator.scheduling.prompttuner import PromptTunerConfig, PromptTunerPolicy, _poisson_quantile
from elastune_operator.scheduling.state import ClusterState, Job
from scheduling_helpers import LLM, allocation_map, make_estimator, make_gpus_warm, make_running, make_state


def policy(**config) -> PromptTunerPolicy:
    return PromptTunerPolicy(make_estimator(), PromptTunerConfig(**config))


def early(**config) -> PromptTunerPolicy:
    """Early release over a one-minute arrival window (default three) for round numbers."""
    return policy(**{"early_release": True, "arrival_window_seconds": 60.0, **config})


def arrived(state: ClusterState, jid: str, at: float) -> None:
    """A job that arrived at ``at`` and is no longer waiting (the arrival rate counts every arrival;
    taking it off the queue by ``drop`` keeps it from asking for GPUs in this round)."""
    state.submit(Job(jid, LLM, at, 100.0, 40))
    state.drop(jid)


def _one_idle_one_running(finish: float) -> ClusterState:
    """GPU 0 idle since 0; job r (arrived at 0, SLO 100, 40 iterations → asks for 1 GPU) runs on GPU 1
    with a predicted finish at ``finish``. Arrivals expected in the next T_cold: Poisson with mean
    1 × 10 s / 60 s = 0.17, whose 90 % quantile is 1 (P(0) = 0.85): 1 GPU asked for."""
    state = make_state(capacity=4, idle={LLM: 1})
    make_running(state, Job("r", LLM, 0.0, 100.0, 40), gpus=1, started=0.0, predicted_finish=finish)
    return state


# -- early release ----------------------------------------------------------------------------------


def test_early_release_releases_an_idle_gpu_when_a_running_job_frees_one_within_t_cold():
    # At 5: r frees its GPU at 12 ≤ 5 + T_cold = 15, which covers the 1 GPU asked for by then.
    assert early().round(_one_idle_one_running(12.0), 5.0).releases == [0]


def test_early_release_keeps_the_gpu_when_the_running_job_frees_it_after_t_cold():
    state = _one_idle_one_running(20.0)  # 20 > 5 + 10: nothing covers the GPU asked for
    pol = early()
    assert pol.round(state, 5.0).empty()
    assert pol._cache.horizon == 10.0  # r's release enters the T_cold horizon at 20 − 10
    assert early().round(state, 9.99).empty()
    assert early().round(state, 10.0).releases == [0]


def test_early_release_is_off_by_default():
    assert policy().round(_one_idle_one_running(12.0), 5.0).empty()  # idle for 5 s < the 60 s window


def test_early_release_keeps_gpus_the_recent_arrival_rate_asks_for():
    """At 15, 13 jobs (1 GPU each) arrived within the last minute: 13 × 10 / 60 = 2.17 expected in the
    next T_cold. At 90 % confidence that is 4 (P(N ≤ 3) = 0.83, P(N ≤ 4) = 0.93): r's GPU covers 1,
    all 3 idle GPUs stay. At 50 % it is 2: 1 stays and the two oldest go."""
    state = make_state(capacity=8)
    make_gpus_warm(state, LLM, 1, at=0.0)  # GPU 0, oldest idle
    make_gpus_warm(state, LLM, 2, at=1.0)  # GPUs 1, 2
    make_running(state, Job("r", LLM, 0.0, 100.0, 40), gpus=1, started=0.0, predicted_finish=12.0)
    for i in range(12):
        arrived(state, f"f{i}", 1.0 + i)
    assert early(idle_window_seconds=600.0).round(state, 15.0).empty()
    half = early(idle_window_seconds=600.0, early_release_confidence=0.5)
    assert half.round(state, 15.0).releases == [0, 1]
    # Once every arrival has left the window nothing is asked for: all three go.
    assert early(idle_window_seconds=600.0).round(state, 72.5).releases == [0, 1, 2]


def test_poisson_quantile():
    assert _poisson_quantile(0.0, 0.9) == 0
    assert _poisson_quantile(1 / 6, 0.9) == 1  # P(0) = 0.846
    assert _poisson_quantile(1 / 18, 0.9) == 0  # P(0) = 0.946
    assert _poisson_quantile(13 / 6, 0.9) == 4
    assert _poisson_quantile(13 / 6, 0.5) == 2
    assert _poisson_quantile(100.0, 0.5) == 100  # median ≈ mean for large means


def test_early_release_arrival_window_defaults_to_three_minutes():
    """A quiet minute must not read as no demand: one arrival 100 s ago still counts by default."""
    state = make_state(capacity=4, idle={LLM: 1})
    arrived(state, "a", 0.0)
    # 1 arrival per 180 s → mean 10/180 = 0.056 in T_cold: its 99 % quantile is 1 GPU → kept.
    assert policy(early_release=True, early_release_confidence=0.99).round(state, 50.0).empty()
    assert early(early_release_confidence=0.99, idle_window_seconds=600.0).round(state, 70.0).releases == [0]


def test_early_release_forgets_arrivals_that_left_the_window():
    state = make_state(capacity=8, idle={LLM: 1})
    for i in range(30):  # 30 arrivals at 0: 5 expected within T_cold, more than the idle one
        arrived(state, f"f{i}", 0.0)
    pol = early(idle_window_seconds=600.0)
    assert pol.round(state, 30.0).empty()
    assert pol._cache.horizon == 60.0  # the arrivals leave the 60 s window
    assert early(idle_window_seconds=600.0).round(state, 60.0).releases == [0]
    assert early(idle_window_seconds=600.0, arrival_window_seconds=120.0).round(state, 60.0).empty()


def test_early_release_counts_gpus_loading_for_the_pool_as_covering():
    state = make_state(capacity=4, idle={LLM: 1})
    arrived(state, "a", 0.0)
    assert early().round(state, 5.0).empty()  # 1 GPU asked for (90 % of Poisson(0.17)), none covers it
    state.launch(LLM, 5.0)  # a GPU warming up for the pool
    assert early().round(state, 5.0).releases == [0]


def test_early_release_keeps_min_warm_and_gpus_reserved_by_delay_schedulable():
    state = _one_idle_one_running(12.0)
    pol = early()
    pol.set_pool_limits(LLM, PoolLimits(min_warm=2))
    assert pol.round(state, 5.0).empty()  # pool of 2 = minimum

    state = make_state(capacity=3, idle={LLM: 2})  # GPUs 0, 1 idle since 0
    make_running(state, Job("r", LLM, 0.0, 200.0, 10), gpus=1, started=0.0, predicted_finish=8.0)
    state.submit(Job("d", LLM, 5.0, 25.0, 60))  # needs 3 GPUs (60/3 = 20 ≤ 25): waits for r's
    d = early().round(state, 5.0)
    assert d.empty()  # both idle GPUs are reserved for d (E = [5, 5, 8]: 8 + 20 ≤ 30)


# -- idle window sized on T_cold ---------------------------------------------------------------------


def test_cold_start_idle_window_is_t_cold_times_the_multiple():
    state = make_state(capacity=4, idle={LLM: 2})  # idle since 0; T_cold 10 s; default multiple 2
    assert policy(idle_window_mode="cold_start").round(state, 19.99).empty()
    assert policy(idle_window_mode="cold_start").round(state, 20.0).releases == [0, 1]
    assert policy(idle_window_mode="cold_start", idle_window_cold_multiple=1.0).round(state, 9.99).empty()
    assert policy(idle_window_mode="cold_start", idle_window_cold_multiple=1.0).round(
        state, 10.0
    ).releases == [
        0,
        1,
    ]
    assert policy(idle_window_mode="fixed").round(state, 59.99).empty()


def test_cold_start_idle_window_follows_the_learned_t_cold():
    state = make_state(capacity=4, idle={LLM: 1})
    pol = policy(idle_window_mode="cold_start")
    for _ in range(10):
        pol.estimator.observe_cold_start(LLM, 30.0)
    assert pol.round(state, 59.99).empty()  # 2 × 30 s
    assert pol.round(state, 60.0).releases == [0]


def test_a_warm_pools_own_idle_window_wins_over_the_cold_start_window():
    state = make_state(capacity=4, idle={LLM: 1})
    pol = policy(idle_window_mode="cold_start")
    pol.set_pool_limits(LLM, PoolLimits(idle_window_seconds=100.0))
    assert pol.round(state, 50.0).empty()
    assert pol.round(state, 100.0).releases == [0]


# -- sizing Prompt-Bank jobs on the bank's minimum speedup -------------------------------------------


@pytest.mark.parametrize(("speedup", "mode", "gpus"), [(1.0, "auto", 3), (1.2, "auto", 2), (1.2, "never", 3)])
def test_bank_jobs_are_sized_on_the_minimum_speedup(speedup, mode, gpus):
    """120 iterations, SLO 55: on the upper bound 3 GPUs (120/2 = 60 > 55); counting on 1.2× from the
    bank, 100 iterations fit on 2 (50 ≤ 55). A job that skips the bank keeps the full bound."""
    pol = policy(bank_sizing_speedup=speedup)
    state = make_state(capacity=8, idle={LLM: 4})
    job = Job("j", LLM, 0.0, 55.0, 120, bank_mode=mode)
    pol.admit(state, job, 0.0)
    assert job.planned_iterations == pytest.approx(120 / speedup if mode == "auto" else 120)
    assert job.max_iterations == 120  # the termination bound itself is unchanged
    assert allocation_map(pol.round(state, 0.0)) == {"j": gpus}


@pytest.mark.parametrize(
    "config",
    [
        {"bank_sizing_speedup": 0.9},
        {"idle_window_cold_multiple": -1.0},
        {"arrival_window_seconds": 0.0},
        {"early_release_confidence": 1.0},
    ],
)
def test_invalid_spend_settings_raise(config):
    with pytest.raises(ValueError):
        PromptTunerConfig(**config)


def test_new_settings_default_to_the_papers_scheduler():
    cfg = PromptTunerConfig()
    assert (cfg.early_release, cfg.idle_window_mode, cfg.bank_sizing_speedup) == (False, "fixed", 1.0)


# -- in the simulator ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_early_release_cuts_idle_gpu_seconds_in_the_simulator(seed):
    """The small three-LLM trace of the simulator tests: idle warm GPU-seconds drop by at least a
    third and nothing else is lost (every job still ends)."""
    from sim_helpers import run

    _, base = run("promptTuner", seed, PromptTunerConfig())
    _, early_run = run("promptTuner", seed, PromptTunerConfig(early_release=True))
    assert early_run.idle_gpu_seconds < 2 / 3 * base.idle_gpu_seconds
    assert early_run.cost_usd < base.cost_usd
    assert early_run.unfinished == base.unfinished == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bank_min_speedup_sizing_cuts_starting_gpu_seconds_in_the_simulator(seed):
    from sim_helpers import run

    _, base = run("promptTuner", seed, PromptTunerConfig())
    _, sized = run("promptTuner", seed, PromptTunerConfig(bank_sizing_speedup=1.2))
    assert sized.starting_held_gpu_seconds <= base.starting_held_gpu_seconds
    assert sized.cost_usd < base.cost_usd
