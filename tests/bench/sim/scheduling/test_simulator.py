"""The discrete-event simulator (reproducibility, accounting, exact hand-computed timelines) and the
workload generator (seeded traces, SLO formula, CSV replay)."""

import math
import re
from pathlib import Path

import numpy as np
import pytest

from elastune_bench.sim.scheduling.simulator import (
    DEFAULT_PRICE_PER_GPU_HOUR,
    SimConfig,
    SimResult,
    Simulator,
)
from elastune_bench.sim.scheduling.workload import (
    LOADS,
    SimJob,
    SimLLM,
    WorkloadConfig,
    generate,
    paper_llms,
    read_arrivals_csv,
)
from elastune_operator.scheduling.baselines import ElasticFlowConfig, ElasticFlowPolicy
from elastune_operator.scheduling.prompttuner import PromptTunerPolicy
from scheduling_helpers import LLM, make_estimator, make_profile
from sim_helpers import SMALL, run

TIMING_KEYS = {"round_ms_mean", "round_ms_max", "round_ms_p99"}  # wall-clock: never reproducible


def deterministic(result: SimResult) -> dict[str, object]:
    return {k: v for k, v in result.summary().items() if k not in TIMING_KEYS}


# -- reproducibility and accounting ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["promptTuner", "infless", "elasticflow"])
def test_same_seed_same_result_different_seed_different(policy):
    _, a = run(policy, seed=3)
    _, b = run(policy, seed=3)
    _, c = run(policy, seed=4)
    assert deterministic(a) == deterministic(b)
    assert a.latencies == b.latencies
    assert deterministic(a) != deterministic(c)


@pytest.mark.parametrize("policy", ["promptTuner", "infless", "elasticflow"])
def test_every_job_ends_finished_or_dropped(policy):
    sim, result = run(policy, seed=5)
    assert len(sim.state.jobs) == sum(SMALL.values())
    for job in sim.state.jobs.values():
        assert (job.finished_at is not None) != job.dropped, job.id
        if job.finished_at is not None:
            assert job.finished_at >= job.arrival
    assert result.unfinished == 0
    late = sum(j.finished_at > j.deadline + 1e-9 for j in sim.state.jobs.values() if not j.dropped)
    assert result.slo_violations == late + result.dropped
    assert len(result.latencies) == result.jobs - result.dropped
    assert result.busy_gpu_seconds <= result.paid_gpu_seconds + 1e-6


def test_fixed_cluster_cost_is_cluster_size_times_makespan():
    sim, result = run("elasticflow", seed=2, config=ElasticFlowConfig(cluster_gpus=12))
    assert sim.policy.cluster_gpus(sim.state) == 12  # type: ignore[attr-defined]
    assert result.paid_gpu_seconds == pytest.approx(12 * result.makespan_seconds)
    assert result.cost_usd == pytest.approx(12 * result.makespan_seconds * DEFAULT_PRICE_PER_GPU_HOUR / 3600)
    # Every GPU of the cluster is busy, loading for a job (no runtime reuse) or holding nothing.
    assert result.starting_held_gpu_seconds > 0
    assert result.idle_gpu_seconds == pytest.approx(
        result.paid_gpu_seconds - result.busy_gpu_seconds - result.starting_held_gpu_seconds
    )
    assert sim.state.gpus == {}  # no runtime reuse: everything went back to cold


def test_unfinished_jobs_count_as_misses_at_max_seconds():
    llms = {LLM: SimLLM(make_profile(), true_iteration_factor=1.0)}
    jobs = [SimJob("j", LLM, 0.0, 1000.0, 100, 100, 1.0, 1, 100.0)]
    cfg = SimConfig(cold_capacity=1, cold_start_jitter=0.0, max_seconds=50.0)
    result = Simulator(llms, jobs, PromptTunerPolicy(make_estimator()), cfg).run()
    # 1 GPU: warm at 10, 100 iterations → would finish at 110 > 50 s of simulated time.
    assert (result.unfinished, result.slo_violations) == (1, 1)


# -- an exact timeline -------------------------------------------------------------------------------


def test_two_job_timeline_by_hand():
    """T_warm(a) = iterations / a, T_cold = 10.01 s, no jitter, true iteration time = the profile's,
    bank lookup 0 s (so the bank runs, speedup 1.0). Rounds every 50 ms: tick k is at k × 0.05 s."""
    profile = make_profile(cold_start_seconds=10.01)
    llms = {LLM: SimLLM(profile, true_iteration_factor=1.0)}
    jobs = [
        SimJob("a", LLM, 0.0, 25.0, 20, 20, 1.0, 2, 10.0),  # deadline 25
        SimJob("b", LLM, 12.02, 30.0, 10, 10, 1.0, 1, 10.0),  # deadline 42.02
    ]
    sim = Simulator(
        llms,
        jobs,
        PromptTunerPolicy(make_estimator(profile)),
        SimConfig(cold_capacity=8, cold_start_jitter=0.0),
    )
    result = sim.run()
    a, b = sim.state.jobs["a"], sim.state.jobs["b"]
    # t = 0: a needs 20/A + 10.01 ≤ 25 → A = 2 → Launch(m, 2); warm at 10.01 → seen at tick 201 (10.05),
    # 14.95 s left: 20/2 = 10 ≤ 14.95 → both GPUs → a runs 10.05 → 10.05 + 20/2 = 20.05.
    assert a.started_at == pytest.approx(10.05)
    assert a.finished_at == pytest.approx(20.05)
    # b arrives 12.02 (tick 241, 12.05): E = [20.05, 20.05] → 20.05 + 10/1 = 30.05 ≤ 42.02 → delayed.
    # tick 401 (20.05): a's GPUs idle → b: 10/1 = 10 ≤ 21.97 → 1 GPU → runs 20.05 → 30.05.
    assert b.started_at == pytest.approx(20.05)
    assert b.finished_at == pytest.approx(30.05)
    assert sim.state.pool_size[LLM] == 2  # never grown a second time
    assert result.slo_violations == 0 and result.bank_used == 2
    assert result.makespan_seconds == pytest.approx(30.05)  # the tick that saw the last finish
    # Ticks 0..601 (602 rounds) with 2 GPUs paid: 2 × 602 × 0.05 = 60.2 GPU-s.
    assert result.rounds == 602
    assert result.paid_gpu_seconds == pytest.approx(60.2)
    # Busy: a 2 GPUs × ticks 201..400 + b 1 GPU × ticks 401..600 = (400 + 200) × 0.05 = 30.
    assert result.busy_gpu_seconds == pytest.approx(30.0)
    # Idle: 1 GPU over ticks 401..600, 2 at tick 601 → 202 × 0.05 = 10.1.
    assert result.idle_gpu_seconds == pytest.approx(10.1)
    # Starting: 2 GPUs loading over ticks 0..200 → 20.1; busy + idle + starting/held = paid.
    assert result.starting_held_gpu_seconds == pytest.approx(20.1)
    assert result.breakdown() == {
        "busy_gpu_s": 30.0,
        "idle_gpu_s": 10.1,
        "starting_held_gpu_s": 20.1,
        "paid_gpu_s": 60.2,
    }
    # Both jobs got warm GPUs and started in the same round: no initialisation wait.
    assert result.init_wait_fractions == [0.0, 0.0]
    assert result.cost_usd == pytest.approx(60.2 / 3600 * DEFAULT_PRICE_PER_GPU_HOUR)
    assert sorted(result.latencies) == pytest.approx([30.05 - 12.02, 20.05])  # b: 18.03, a: 20.05


def test_elasticflow_restart_keeps_checkpointed_progress():
    # ElasticFlow, 4 GPUs: r (SLO 100, 40 iterations) starts on all 4 at 10 (T_cold 10, no jitter);
    # n arrives at 12 and r restarts on 1 GPU after 2 s × 4 it/s = 8 iterations, then needs
    # 32 more: warm at 12 + 10 = 22, finishes 22 + 32 = 54. n: 3 GPUs at 12 → warm 22 → 22 + 40/3.
    llms = {LLM: SimLLM(make_profile(), true_iteration_factor=1.0)}
    jobs = [
        SimJob("r", LLM, 0.0, 100.0, 40, 40, 1.0, 1, 40.0),
        SimJob("n", LLM, 12.0, 30.0, 40, 40, 1.0, 1, 40.0),
    ]
    sim = Simulator(
        llms, jobs, ElasticFlowPolicy(make_estimator()), SimConfig(cold_capacity=4, cold_start_jitter=0.0)
    )
    result = sim.run()
    r, n = sim.state.jobs["r"], sim.state.jobs["n"]
    assert r.finished_at == pytest.approx(54.0)
    assert n.finished_at == pytest.approx(22.0 + 40 / 3)
    # Initialisation waits (Fig. 3b): r 10 s at first and 10 s after its restart, of 54 s; n 10 s of
    # its 22 + 40/3 − 12 s.
    assert sorted(result.init_wait_fractions) == pytest.approx(sorted([20 / 54, 10 / (10 + 40 / 3)]))


def test_bank_speedup_divides_the_true_iterations():
    # Bank lookup 0 s is within budget → the job runs the bank; 40 iterations / speedup 4 = 10 real ones.
    llms = {LLM: SimLLM(make_profile(), true_iteration_factor=1.0)}
    jobs = [SimJob("j", LLM, 0.0, 50.0, 40, 40, 4.0, 1, 40.0)]
    sim = Simulator(
        llms, jobs, PromptTunerPolicy(make_estimator()), SimConfig(cold_capacity=8, cold_start_jitter=0.0)
    )
    sim.run()
    # 40/A + 10 ≤ 50 → A = 1: warm at 10, 10 real iterations on 1 GPU → finishes at 20.
    assert sim.state.jobs["j"].finished_at == pytest.approx(20.0)


# -- workload ----------------------------------------------------------------------------------------


def test_generate_is_seeded_and_reproducible():
    assert generate(WorkloadConfig(seed=7)) == generate(WorkloadConfig(seed=7))
    assert generate(WorkloadConfig(seed=7)) != generate(WorkloadConfig(seed=8))


@pytest.mark.parametrize("s", [0.5, 1.0, 1.5])
def test_generate_follows_the_paper_recipe(s):
    cfg = WorkloadConfig(jobs_per_llm=dict(LOADS["low"]), slo_emergence=s, seed=1)
    jobs = generate(cfg)
    llms = paper_llms()
    counts = {name: sum(j.llm == name for j in jobs) for name in llms}
    assert counts == LOADS["low"]  # 41 / 55 / 42
    assert [j.arrival for j in jobs] == sorted(j.arrival for j in jobs)
    assert len({j.id for j in jobs}) == len(jobs)
    lo, hi = cfg.duration_bounds
    for j in jobs:
        profile = llms[j.llm].profile
        assert 0.0 <= j.arrival < cfg.minutes * 60.0
        assert j.slo == pytest.approx(j.trace_duration * s + profile.cold_start_seconds)
        assert lo <= j.trace_duration <= hi
        assert j.trace_gpus in cfg.gpu_choices
        # Iterations reproduce the trace duration on the trace GPU count at the true speed.
        assert j.iterations == max(
            1, math.ceil(j.trace_duration / llms[j.llm].true_iteration_seconds(j.trace_gpus))
        )
        assert j.max_iterations == j.iterations
        assert 1.0 <= j.bank_speedup <= 4.5
        assert j.bank_mode == "auto"


def test_paper_llms_profiles():
    llms = paper_llms()
    assert {n: (m.profile.iteration_seconds, m.profile.cold_start_seconds) for n, m in llms.items()} == {
        "gpt2-base": (0.12, 20.0),
        "gpt2-large": (0.30, 30.0),
        "vicuna-7b": (0.80, 50.0),
    }
    # 10 % slower in reality than configured, and T_cold as configured.
    assert llms["vicuna-7b"].true_iteration_seconds(1) == pytest.approx(0.88)
    assert llms["vicuna-7b"].cold_start_mean == 50.0


def _csv(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "arrivals.csv"
    path.write_text(text)
    return path


def test_read_arrivals_csv_seconds_sorted_and_shifted(tmp_path):
    arr = read_arrivals_csv(_csv(tmp_path, "t,other\n5,x\n2.5,y\n10,z\n"))
    np.testing.assert_allclose(arr, [0.0, 2.5, 7.5])  # sorted, minus the first (2.5)


def test_read_arrivals_csv_iso_timestamps(tmp_path):
    text = "ts\n2024-01-01T00:01:30Z\n2024-01-01T00:00:00Z\n2024-01-01T01:00:10+01:00\n"
    np.testing.assert_allclose(read_arrivals_csv(_csv(tmp_path, text)), [0.0, 10.0, 90.0])


def test_read_arrivals_csv_named_column(tmp_path):
    arr = read_arrivals_csv(_csv(tmp_path, "a,b\nx,3\ny,1\n"), column="b")
    np.testing.assert_allclose(arr, [0.0, 2.0])


def test_read_arrivals_csv_errors_name_the_file_and_line(tmp_path):
    path = _csv(tmp_path, "t\n1\nhello\n")
    with pytest.raises(ValueError) as err:
        read_arrivals_csv(path)
    assert str(err.value) == f"{path}:3: t='hello' is neither seconds nor a timestamp"
    with pytest.raises(ValueError, match="no column 'z'; columns: \\['t'\\]"):
        read_arrivals_csv(_csv(tmp_path, "t\n1\n"), column="z")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'arrivals.csv'}: no rows")):
        read_arrivals_csv(_csv(tmp_path, "t\n"))


@pytest.mark.parametrize(("text", "line"), [("t\n1\nnan\n", 3), ("a,b\n1,2\n3\n", 3)])
def test_read_arrivals_csv_rejects_more_garbage(tmp_path, text, line):
    path = _csv(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(f"{path}:{line}:")):
        read_arrivals_csv(path, column="b" if text.startswith("a,b") else None)


def test_generate_replays_csv_arrivals(tmp_path):
    path = _csv(tmp_path, "t\n" + "".join(f"{x}\n" for x in (0, 1, 3, 6, 10, 15)))
    cfg = WorkloadConfig(jobs_per_llm={"gpt2-base": 4}, arrivals_csv=path, minutes=1, seed=0)
    jobs = generate(cfg)
    assert len(jobs) == 4
    arrivals = [j.arrival for j in jobs]
    assert arrivals[0] == 0.0 and arrivals[-1] == pytest.approx(60.0)  # stretched over 1 minute
    raw = generate(WorkloadConfig(jobs_per_llm={"gpt2-base": 4}, arrivals_csv=path, stretch_replay=False))
    # A window of 4 consecutive gaps from the trace, shifted to start at 0.
    windows = [[0, 1, 3, 6], [0, 2, 5, 9], [0, 3, 7, 12]]
    assert [j.arrival for j in raw] in windows


def test_generate_replay_never_silently_drops_jobs(tmp_path):
    path = _csv(tmp_path, "t\n0\n5\n9\n")
    cfg = WorkloadConfig(jobs_per_llm={"gpt2-base": 5}, arrivals_csv=path, seed=0)
    try:
        jobs = generate(cfg)
    except ValueError:
        return  # refusing is fine too
    assert len(jobs) == 5
