"""The baselines (paper §3, §6.1): INFless-like serverless autoscaling (instances per GPU, held for the
job until all are warm, keep-alive, traffic-based pre-warming, FIFO) and ElasticFlow-like elastic
training (admission control with minimum shares, EDF, elastic leftover GPUs, no runtime reuse).

Profile (scheduling_helpers): T_warm(a) = iterations / a, T_cold = 10 s, at most 8 GPUs per job."""

import pytest

from elastune_bench.sim.scheduling.simulator import SimConfig, Simulator
from elastune_bench.sim.scheduling.workload import SimJob, SimLLM
from elastune_operator.scheduling.baselines import (
    ElasticFlowConfig,
    ElasticFlowPolicy,
    INFlessConfig,
    INFlessPolicy,
)
from elastune_operator.scheduling.factory import make_policy
from elastune_operator.scheduling.state import Allocation, ClusterState, GPUState, Job, Launch
from scheduling_helpers import (
    LLM,
    apply,
    make_estimator,
    make_gpus_warm,
    make_profile,
    make_running,
    make_state,
)


def infless(**config) -> INFlessPolicy:
    return INFlessPolicy(make_estimator(), INFlessConfig(**config))


# -- INFless -----------------------------------------------------------------------------------------


def test_infless_admit_always_runs_the_bank_unless_never():
    pol = INFlessPolicy(make_estimator(bank_lookup_seconds=6.0))
    state = make_state()
    auto = Job("auto", LLM, 0.0, 10.0, 10)  # PromptTuner's budget would say no: 6 > 0.2 × 10
    never = Job("never", LLM, 0.0, 10.0, 10, bank_mode="never")
    pol.admit(state, auto, 0.0)
    pol.admit(state, never, 0.0)
    assert (auto.use_bank, auto.bank_seconds) == (True, 6.0)
    assert (never.use_bank, never.bank_seconds) == (False, 0.0)


def test_infless_takes_the_idle_instances_and_launches_the_rest_held_for_the_job():
    state = make_state(capacity=8, idle={LLM: 1})  # GPU 0 idle, 7 cold
    pol = infless()
    job = Job("j", LLM, 0.0, 20.0, 40)
    pol.admit(state, job, 0.0)
    d = pol.round(state, 0.0)
    # Warm: 40/2 = 20 ≤ 20 → A = 2 > 1 idle → sized for a cold start: 40/A + 10 ≤ 20 → A = 4.
    # 1 idle instance + 3 launched for the job. (Pre-warm target: ceil(2 × 20 GPU-s / 60 s) = 1 ≤ pool.)
    assert d.allocations == [Allocation("j", [0], 4)]
    assert d.launches == [Launch(LLM, 3, "j")]
    apply(state, d, 0.0)
    assert job.target_gpus == 4 and job.gpus == [0, 1, 2, 3]
    assert state.gpus[0].state is GPUState.HELD
    # The job starts only when every instance is warm.
    for gid in (1, 2):
        state.gpu_ready(gid, 10.0)
        assert not state.startable("j")
    state.gpu_ready(3, 11.0)
    assert state.startable("j")
    assert pol.round(state, 11.0).empty()  # nothing more for the job: it holds all 4


def test_infless_job_waits_without_holding_anything_when_the_cluster_is_full():
    state = make_state(capacity=2, idle={LLM: 1})  # 1 idle + 1 cold; the job needs 1 + 3
    pol = infless()
    pol.admit(state, Job("j", LLM, 0.0, 20.0, 40), 0.0)
    d = pol.round(state, 0.0)
    assert d.empty()  # all-or-nothing: the idle instance stays free for jobs that fit
    assert state.jobs["j"].pending


def test_infless_evicts_other_models_idle_instances_oldest_first():
    est = make_estimator(make_profile("m"), make_profile("n"))
    pol = INFlessPolicy(est, INFlessConfig(prewarm=False))
    state = make_state(capacity=4, llms=("m", "n"))
    make_gpus_warm(state, "n", 1, at=5.0)  # GPU 0
    make_gpus_warm(state, "n", 1, at=1.0)  # GPU 1: idle longer
    make_gpus_warm(state, "n", 1, at=3.0)  # GPU 2
    pol.admit(state, Job("j", "m", 6.0, 22.0, 24), 6.0)
    d = pol.round(state, 6.0)
    # No m instance: 24/A + 10 ≤ 22 → A = 2 cold, only 1 free → evict n's oldest idle instance (GPU 1).
    assert d.releases == [1]
    assert d.launches == [Launch("m", 2, "j")]


def test_infless_is_fifo_not_deadline_ordered():
    state = make_state(capacity=2, idle={LLM: 2})
    pol = infless()
    pol.admit(state, Job("a", LLM, 0.0, 100.0, 20), 0.0)  # deadline 100, 20/1 ≤ 100 → 1
    pol.admit(state, Job("b", LLM, 1.0, 10.0, 20), 1.0)  # deadline 11: needs 2 warm (20/2 = 10)
    d = pol.round(state, 1.0)
    # a (arrived first) takes GPU 1; b: 2 > 1 idle; cold 20/A + 10 ≤ 10 impossible → best effort
    # A* = 2 (20/2 ≤ SLO 10): 1 idle + 1 cold, but the cold pool is empty → b waits.
    assert d.allocations == [Allocation("a", [1], 1)]
    assert d.launches == []


def test_infless_keep_alive_releases_idle_instances_after_60_s():
    state = make_state(capacity=2, idle={LLM: 2})  # idle since 0
    pol = infless(prewarm=False)
    assert pol.round(state, 59.95).empty()
    assert pol.round(state, 60.0).releases == [0, 1]  # 0 + 60 ≤ 60


def test_infless_prewarm_keeps_instances_for_recent_demand():
    state = make_state(capacity=2, idle={LLM: 2})  # idle since 0
    pol = infless()
    # Demand only (the job itself is submitted to a scratch state): 40 iterations, SLO 20 → A = 2,
    # 2 × T_warm(2) = 2 × 20 = 40 GPU-seconds in the last 60 s → target ceil(40 / 60) = 1 instance.
    pol.admit(make_state(), Job("j", LLM, 30.0, 20.0, 40), 30.0)
    assert pol.round(state, 60.0).releases == [0]  # surplus 2 − 1
    # The demand leaves the window once 30 < now − 60, i.e. after t = 90 → target 0.
    assert infless_with_demand_of(pol).round(state, 90.0).releases == [0]
    assert infless_with_demand_of(pol).round(state, 90.05).releases == [0, 1]


def infless_with_demand_of(pol: INFlessPolicy) -> INFlessPolicy:
    fresh = infless()
    fresh._demand = {llm: type(q)(q) for llm, q in pol._demand.items()}
    return fresh


def test_infless_prewarms_to_the_demand_target():
    state = make_state(capacity=8)
    pol = infless()
    # 480 iterations, SLO 120: A = 4 (480/4 = 120) → 4 × 120 = 480 GPU-s / 60 s → target 8 instances.
    pol.admit(make_state(), Job("x", LLM, 0.0, 120.0, 480), 0.0)
    assert pol.round(state, 0.0).launches == [Launch(LLM, 8)]


def test_infless_start_waits_for_the_slowest_instance_in_the_simulator():
    llms = {LLM: SimLLM(make_profile(), true_iteration_factor=1.0)}
    jobs = [SimJob("j", LLM, 0.0, 20.0, 40, 40, 1.0, 4, 10.0)]
    sim = Simulator(llms, jobs, infless(prewarm=False), SimConfig(cold_capacity=8, cold_start_jitter=0.3))
    ready: dict[int, float] = {}
    gpu_ready = sim.state.gpu_ready

    def record(gid: int, now: float) -> None:
        ready[gid] = now
        gpu_ready(gid, now)

    sim.state.gpu_ready = record  # type: ignore[method-assign]
    sim.run()
    job = sim.state.jobs["j"]
    warm = [ready[g] for g in job.gpus]
    assert len(warm) == 4 and len(set(warm)) == 4  # jittered: every instance warms at its own time
    # It starts in the first 50 ms round at or after its slowest instance, not before.
    assert max(warm) <= job.started_at < max(warm) + 0.05 + 1e-9
    assert job.finished_at == pytest.approx(job.started_at + 40 / 4)


def test_infless_decides_afresh_each_round():
    """The baselines keep no round cache: a policy that saw t = 11 answers at t = 16 like a fresh one."""
    state = make_state(capacity=2)
    pol = infless()
    pol.admit(state, Job("j", LLM, 0.0, 30.0, 40), 0.0)  # deadline 30; A* = 2 (40/2 = 20 ≤ 30)
    make_gpus_warm(state, LLM, 2, at=11.0)
    # t = 11: warm 40/A ≤ 19 → A = 3 > 2 idle → cold 40/A + 10 ≤ 19 → A = 5: 2 idle + 3 cold, none
    # free → waits.
    assert pol.round(state, 11.0).empty()
    # From t > 15 no cold A fits (40/8 + 10 = 15) → best effort A* = 2 ≤ 2 idle: it would run now.
    fresh = infless_with_demand_of(pol).round(state, 16.0)
    assert fresh.allocations == [Allocation("j", [0, 1], 2)]
    assert pol.round(state, 16.0) == fresh


# -- ElasticFlow -------------------------------------------------------------------------------------


def elasticflow(**config) -> ElasticFlowPolicy:
    return ElasticFlowPolicy(make_estimator(), ElasticFlowConfig(**config))


def test_elasticflow_cluster_size():
    state = make_state(capacity=8)
    assert elasticflow().cluster_gpus(state) == 8  # None → the cold pool's capacity
    assert elasticflow(cluster_gpus=4).cluster_gpus(state) == 4
    assert elasticflow(cluster_gpus=16).cluster_gpus(state) == 8  # never more than exists


def test_elasticflow_admission_drops_what_the_fixed_cluster_cannot_guarantee():
    state = make_state(capacity=4)
    pol = elasticflow()
    jobs = [Job(f"j{i}", LLM, 0.0, 30.0, 40) for i in (1, 2, 3)]  # minimum share: 40/A + 10 ≤ 30 → 2
    impossible = Job("x", LLM, 0.0, 5.0, 40)  # SLO 5 < T_cold: no share works
    for job in [*jobs, impossible]:
        pol.admit(state, job, 0.0)
    # j1: 0 + 2 ≤ 4, j2: 2 + 2 ≤ 4, j3: 4 + 2 > 4 → dropped; x: share 0 → dropped.
    assert [j.dropped for j in jobs] == [False, False, True]
    assert impossible.dropped
    assert list(state.pending[LLM]) == ["j1", "j2"]
    d = pol.round(state, 0.0)
    assert d.launches == [Launch(LLM, 2, "j1"), Launch(LLM, 2, "j2")]  # no GPU left over


def test_elasticflow_guarantee_ends_with_the_job():
    state = make_state(capacity=4)
    pol = elasticflow()
    first, second = Job("a", LLM, 0.0, 30.0, 40), Job("b", LLM, 0.0, 30.0, 40)
    pol.admit(state, first, 0.0)
    pol.admit(state, second, 0.0)
    apply(state, pol.round(state, 0.0), 0.0, keep_warm=False)
    state.finish("a", 5.0, keep_warm=False)
    third = Job("c", LLM, 5.0, 30.0, 40)  # 2 + 2 ≤ 4 again now that a's guarantee is gone
    pol.admit(state, third, 5.0)
    assert not third.dropped


def test_elasticflow_gives_at_least_the_share_that_still_meets_the_deadline():
    state = make_state(capacity=3)
    pol = elasticflow()
    job = Job("j", LLM, 0.0, 30.0, 40)
    pol.admit(state, job, 0.0)  # minimum share 2
    # At t = 5: 25 s left: 40/2 + 10 = 30 > 25, 40/3 + 10 = 23.3 ≤ 25 → 3 > the admitted 2.
    assert pol.round(state, 5.0).launches == [Launch(LLM, 3, "j")]


def test_elasticflow_leftover_gpus_go_to_the_largest_marginal_gain():
    state = make_state(capacity=7)
    pol = elasticflow()
    a = Job("a", LLM, 0.0, 30.0, 40)  # share 2 (40/2 + 10 = 30)
    b = Job("b", LLM, 0.0, 31.0, 30)  # share 2 (30/2 + 10 = 25; 30 + 10 = 40 > 31)
    pol.admit(state, a, 0.0)
    pol.admit(state, b, 0.0)
    d = pol.round(state, 0.0)
    # 3 left over. Gains T(a) − T(a+1): a 2→3: 20 − 13.33 = 6.67 vs b 2→3: 15 − 10 = 5 → a = 3;
    # a 3→4: 13.33 − 10 = 3.33 vs b 5 → b = 3; a 3.33 vs b 3→4: 10 − 7.5 = 2.5 → a = 4.
    assert d.launches == [Launch(LLM, 4, "a"), Launch(LLM, 3, "b")]


def test_elasticflow_single_job_grows_to_its_maximum():
    state = make_state(capacity=16)
    pol = elasticflow()
    pol.admit(state, Job("j", LLM, 0.0, 30.0, 40), 0.0)
    assert pol.round(state, 0.0).launches == [Launch(LLM, 8, "j")]  # max_gpus_per_job = 8


def test_elasticflow_shrinks_a_running_job_to_admit_a_new_one():
    state = make_state(capacity=4)
    pol = elasticflow()
    r = Job("r", LLM, 0.0, 100.0, 40)
    pol.admit(state, r, 0.0)  # share 1 (40 + 10 ≤ 100)
    d = pol.round(state, 0.0)
    assert d.launches == [Launch(LLM, 4, "r")]  # elastic: all 4
    apply(state, d, 0.0, keep_warm=False)
    for gid in list(state.gpus):
        state.gpu_ready(gid, 10.0)
    state.start("r", 10.0, 20.0)
    n = Job("n", LLM, 12.0, 30.0, 40)
    pol.admit(state, n, 12.0)  # share 2 (40/2 + 10 = 30); committed 1 + 2 ≤ 4
    d = pol.round(state, 12.0)
    # n needs 2, none free → r (share now: 40 + 10 ≤ 88 → 1) restarts on 1, freeing 3;
    # n gets 2 + the leftover 1.
    assert d.restarts == [("r", 1)]
    assert d.launches == [Launch(LLM, 3, "n")]


def test_elasticflow_gpus_go_straight_back_to_cold():
    pol = elasticflow()
    assert pol.keep_warm is False and pol.billing == "fixed_cluster"
    state = make_state(capacity=4)
    pol.admit(state, Job("j", LLM, 0.0, 30.0, 40), 0.0)
    apply(state, pol.round(state, 0.0), 0.0, keep_warm=pol.keep_warm)
    for gid in list(state.gpus):
        state.gpu_ready(gid, 10.0)
    state.start("j", 10.0, 20.0)
    state.finish("j", 20.0, keep_warm=pol.keep_warm)
    assert state.gpus == {} and state.cold_free == 4 and state.pool_size[LLM] == 0


def _tight_running_job(gpus: int, capacity: int, r_slo: float) -> tuple[ClusterState, ElasticFlowPolicy]:
    """r (40 iterations) runs on ``gpus`` warm GPUs since 10; n (SLO 30, 40 iterations, share 2)
    arrives at 12."""
    state = make_state(capacity=capacity)
    pol = elasticflow()
    r = Job("r", LLM, 0.0, r_slo, 40)
    pol.admit(state, r, 0.0)
    for _ in range(gpus):
        state.launch(LLM, 0.0, job="r", target=gpus)
    for gid in list(state.gpus):
        state.gpu_ready(gid, 10.0)
    state.start("r", 10.0, 10.0 + 40 / gpus)
    n = Job("n", LLM, 12.0, 30.0, 40)
    pol.admit(state, n, 12.0)
    assert not n.dropped
    return state, pol


def test_elasticflow_does_not_restart_when_shrinking_cannot_make_room():
    # r: SLO 40 → admitted share 2 (40/2 + 10 = 30 ≤ 40); runs on 4. n: share 2; committed 4 ≤ 4.
    state, pol = _tight_running_job(gpus=4, capacity=4, r_slo=40.0)
    d = pol.round(state, 12.0)
    # n needs 2, 0 free. r's share now: 28 s left → 40/3 + 10 = 23.3 → 3 → surplus 1 < 2.
    # Shrinking r cannot start n, so r must not be restarted. (Today: restarts == [("r", 3)], and in
    # the simulator r then finishes at 32.7 instead of 20 and n misses its deadline.)
    assert d.restarts == []
    assert d.launches == []


def test_elasticflow_does_not_shrink_a_job_a_restart_would_make_miss():
    # r: SLO 28 → admitted share 3 (40/3 + 10 = 23.3 ≤ 28), runs on 4, predicted to finish at 20.
    # n: share 2; committed 3 + 2 ≤ 5.
    state, pol = _tight_running_job(gpus=4, capacity=5, r_slo=28.0)
    d = pol.round(state, 14.0)
    # r has 14 s left: any restart costs 10 + 40/8 = 15 > 14 → share 0 → today m = max(1, 0) = 1 and r
    # is restarted on 1 GPU (finishing after 14 + 10 + 40 = 64 instead of 20) to make room for n.
    assert d.restarts == []


def test_elasticflow_decides_afresh_each_round():
    state, pol = _tight_running_job(gpus=4, capacity=5, r_slo=28.0)
    # t = 12: n needs 2, 1 free; r's share 40/A + 10 ≤ 16 → 7 > 4 running → no surplus → wait.
    assert pol.round(state, 12.0).empty()
    fresh = ElasticFlowPolicy(pol.estimator)
    fresh._min_share = dict(pol._min_share)
    assert pol.round(state, 14.0) == fresh.round(state, 14.0)


def test_make_policy_builds_the_baselines():
    est = make_estimator()
    inf = make_policy("infless", est, INFlessConfig(keep_alive_seconds=30.0))
    ef = make_policy("elasticflow", est, ElasticFlowConfig(cluster_gpus=4))
    assert isinstance(inf, INFlessPolicy) and inf.config.keep_alive_seconds == 30.0
    assert isinstance(ef, ElasticFlowPolicy) and ef.config.cluster_gpus == 4


def test_running_helper_sets_up_a_busy_job():
    state = make_state(capacity=2)
    ids = make_running(state, Job("r", LLM, 0.0, 10.0, 10), gpus=2, started=1.0, predicted_finish=6.0)
    assert [state.gpus[g].state for g in ids] == [GPUState.BUSY, GPUState.BUSY]
    assert state.jobs["r"].predicted_finish == 6.0 and list(state.running[LLM]) == ["r"]
