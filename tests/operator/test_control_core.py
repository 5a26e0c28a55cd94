"""The control core against a real Redis, with scripted workers: the test plays the worker side of the
protocol (registry records, popping assignments, posting events), so every transition is exact and
fast. No torch here; test_local_mode.py runs the same core with real worker processes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elastune_common.bus import Bus
from elastune_contract.api.resources import parse_resource
from elastune_contract.protocol import Assignment, Event, PromptBankReport, WorkerRecord, WorkerState
from elastune_contract.vocabulary import Reason
from elastune_operator.control.backend import WorkerExit
from elastune_operator.control.core import ControlCore
from elastune_operator.control.records import CoreSettings, JobRecord, PoolConfig

MODEL = "test/model"
POOL = "default/pool"  # the pool's id: the scheduler's per-pool state is keyed by it


class FakeBackend:
    """Records what the core asks for; the test decides which workers appear or die."""

    def __init__(self) -> None:
        self.grown: list[tuple[str, int]] = []
        self.shrunk: list[str] = []
        self.dead: dict[str, WorkerExit] = {}
        self.busy: set[str] = set()

    def grow(self, pool: str, model: str, count: int) -> None:
        self.grown.append((pool, count))

    def shrink(self, pool: str, worker_ids: list[str]) -> None:
        self.shrunk += worker_ids

    def mark_busy(self, pool: str, worker_ids: list[str], busy: bool) -> None:
        self.busy = set(worker_ids) if busy else self.busy - set(worker_ids)

    def exited(self) -> dict[str, WorkerExit]:
        return dict(self.dead)

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env(redis_server: Any, tmp_path: Path) -> dict[str, Any]:
    bus = Bus(redis_server.url, namespace=f"core{time.time_ns()}")
    backend, clock = FakeBackend(), Clock()
    settings = CoreSettings(cold_capacity=4, channel_url=redis_server.url, work_dir=tmp_path, max_attempts=2)
    pool = PoolConfig(
        "pool", MODEL, max_warm=4, idle_window_seconds=30, cold_start_seconds=5, seconds_per_iteration=0.1
    )
    core = ControlCore(backend, bus, settings, [pool], clock=clock)
    return {"bus": bus, "backend": backend, "clock": clock, "core": core, "settings": settings, "pool": pool}


def job(name: str, *, model: str = MODEL, deadline: str = "10m", iterations: int = 50) -> JobRecord:
    res = parse_resource(
        {
            "apiVersion": "elastune.dev/v1alpha1",
            "kind": "TuningJob",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "model": model,
                "dataset": "/d.jsonl",
                "termination": {"maxIterations": iterations},
                "deadline": deadline,
            },
        }
    )
    return JobRecord(f"default/{name}", res.spec, 1_800_000_000.0, "/d.jsonl", f"/out/{name}", generation=1)


def worker(bus: Bus, wid: str, clock: Clock, state: WorkerState = WorkerState.READY, **kw: Any) -> None:
    bus.publish_worker(
        WorkerRecord(
            id=wid, pool="pool", model=MODEL, state=state, started_at=clock.t - 3, ready_at=clock.t, **kw
        )
    )


def cond(rec: JobRecord, ctype: str) -> tuple[str, str]:
    c = next(c for c in rec.status.conditions if c.type == ctype)
    return c.status, c.reason


def pop(bus: Bus, wid: str) -> Assignment:
    a = bus.pop_assignment(wid, timeout=0.5)
    assert a is not None, f"no assignment for {wid}"
    return a


def run_to_dispatch(env: dict[str, Any], rec: JobRecord, workers: list[str]) -> list[Assignment]:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    core.submit(rec)
    core.tick()
    assert env["backend"].grown == [("default/pool", len(workers))]
    assert cond(rec, "Scheduled") == ("False", "PoolGrowing")
    for wid in workers:
        worker(bus, wid, clock)
    clock.t += 5
    core.tick()
    return [pop(bus, wid) for wid in workers]


def post(bus: Bus, a: Assignment, type_: str, **kw: Any) -> None:
    bus.post(Event(type=type_, job=a.job, attempt=a.attempt, rank=a.rank, worker="w", proof=a.proof, **kw))


def test_job_grows_the_pool_binds_warm_workers_runs_and_succeeds(env: dict[str, Any]) -> None:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    rec = job("a")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    assert (a.rank, a.world, a.attempt, a.model) == (0, 1, 1, MODEL)
    assert cond(rec, "Running") == ("True", "Tuning") and rec.status.pods == ["w1"]
    assert core.estimator.cold_start(POOL) == pytest.approx(3.0)  # measured start-to-ready time

    post(bus, a, "progress", iterations=0, resumed_from=0, initial_value=0.2, metric="loss")
    post(bus, a, "progress", iterations=20, checkpointed=20, value=0.5, seconds_per_iteration=0.2)
    clock.t += 4
    core.tick()
    assert rec.status.iterations == 20 and rec.status.current_metric == "0.5"
    assert rec.status.initial_metric == "0.2" and rec.checkpointed == 20
    post(bus, a, "succeeded", iterations=50, value=0.9, prompt="p", artifact="/out/a", reason="MaxIterations")
    clock.t += 4
    core.tick()
    assert cond(rec, "Succeeded") == ("True", "MaxIterations")
    assert rec.status.optimized_prompt == "p" and rec.status.artifact_uri == "file:///out/a"
    assert rec.status.slo_met is True and rec.status.allocated_gpus == 0
    assert float(rec.status.gpu_seconds) == pytest.approx(8.0)  # 1 GPU from dispatch to the result
    assert core.state.counts(POOL)["idle"] == 1 and core.done()


def test_permanent_failure_fails_the_job_and_cancels_the_other_ranks(env: dict[str, Any]) -> None:
    core, bus = env["core"], env["bus"]
    rec = job("b", deadline="40s", iterations=400)  # 40 s of work on one GPU: needs two to fit
    a0, a1 = run_to_dispatch(env, rec, ["w1", "w2"])
    assert (a0.world, a1.rank) == (2, 1) and a0.comm_job == a1.comm_job
    post(bus, a1, "failed", reason="DatasetMalformed", message="line 3: invalid JSON")
    core.tick()
    assert cond(rec, "Succeeded") == ("False", "DatasetMalformed")
    assert cond(rec, "Failed")[0] == "True" and "line 3" in next(
        c.message for c in rec.status.conditions if c.type == "Failed"
    )
    assert bus.cancelled(rec.key, 1)
    assert core.state.counts(POOL)["idle"] == 2


def test_transient_failure_retries_under_a_new_attempt_and_key(env: dict[str, Any]) -> None:
    core, bus = env["core"], env["bus"]
    rec = job("c")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    post(bus, a, "progress", iterations=30, checkpointed=30)
    post(bus, a, "failed", reason="CollectiveTimeout", message="peer 1 silent")
    core.tick()
    assert bus.cancelled(rec.key, 1) and not rec.terminal
    core.tick()  # the retry is scheduled on the now idle warm worker
    b = pop(bus, "w1")
    assert b.attempt == 2 and b.comm_job != a.comm_job and b.checkpoint_dir == a.checkpoint_dir
    post(bus, b, "failed", reason="CollectiveTimeout", message="again")
    core.tick()
    assert cond(rec, "Succeeded") == ("False", "CollectiveTimeout")  # max_attempts = 2


def test_a_lost_worker_reschedules_its_job_from_the_checkpoint(env: dict[str, Any]) -> None:
    core, bus, backend = env["core"], env["bus"], env["backend"]
    rec = job("d")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    post(bus, a, "progress", iterations=27, checkpointed=20)
    core.tick()
    backend.dead["w1"] = WorkerExit(MODEL, "exit code -9")
    core.tick()
    assert bus.cancelled(rec.key, 1) and cond(rec, "Running") == ("False", "WorkerLost")
    assert core.state.jobs[rec.key].done_iterations == 20
    assert ("default/pool", 1) in backend.grown[1:]  # a replacement GPU leaves the cold pool
    worker(bus, "w2", env["clock"])
    core.tick()
    b = pop(bus, "w2")
    assert b.attempt == 2 and rec.status.attempts == 2


def test_workers_that_die_before_becoming_warm_fail_the_job_after_max_attempts(env: dict[str, Any]) -> None:
    core, backend = env["core"], env["backend"]
    rec = job("e")
    core.submit(rec)
    core.tick()
    backend.dead["pool-w1"] = WorkerExit(MODEL, "exit code 1: ModuleNotFoundError: No module named 'torch'")
    core.tick()
    assert not rec.terminal  # one crash: relaunch
    backend.dead["pool-w2"] = WorkerExit(MODEL, "exit code 1: ModuleNotFoundError: No module named 'torch'")
    core.tick()
    assert cond(rec, "Succeeded") == ("False", "WorkerStartFailed")
    assert "No module named 'torch'" in next(c.message for c in rec.status.conditions if c.type == "Failed")


def test_start_failures_fail_waiting_jobs_with_the_pods_reason_and_spare_running_ones(
    env: dict[str, Any],
) -> None:
    core, bus, backend, clock = env["core"], env["bus"], env["backend"], env["clock"]
    running = job("g1")
    run_to_dispatch(env, running, ["w1"])
    waiting = job("g2")
    core.submit(waiting)
    core.tick()
    assert backend.grown[-1] == ("default/pool", 1)
    # Registered while loading its weights, then OOMKilled: its record outlives it, still "starting".
    worker(bus, "pool-w2", clock, WorkerState.STARTING)
    core.tick()
    backend.dead["pool-w2"] = WorkerExit(MODEL, "pod pool-w2: OOMKilled (exit code 137)", Reason.OOM_KILLED)
    core.tick()
    assert not waiting.terminal and "pool-w2" in backend.shrunk  # the failed pod leaves the pool
    pull = 'pod pool-w3: ImagePullBackOff (container worker): Back-off pulling image "x:1"'
    backend.dead["pool-w3"] = WorkerExit(MODEL, pull, Reason.IMAGE_PULL_BACK_OFF)
    core.tick()
    assert cond(waiting, "Succeeded") == ("False", "ImagePullBackOff")  # max_attempts = 2
    assert pull in next(c.message for c in waiting.status.conditions if c.type == "Failed")
    assert not running.terminal and cond(running, "Running") == ("True", "Tuning")


def test_a_model_that_cannot_load_fails_waiting_jobs(env: dict[str, Any]) -> None:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    rec = job("f")
    core.submit(rec)
    core.tick()
    worker(bus, "w1", clock, WorkerState.FAILED, reason="ModelLoadFailed", message="no config.json")
    core.tick()
    assert cond(rec, "Succeeded") == ("False", "ModelLoadFailed")
    assert env["backend"].shrunk == ["w1"]


def test_unknown_model_and_deletion(env: dict[str, Any]) -> None:
    core, bus = env["core"], env["bus"]
    bad = job("g", model="other/model")
    core.submit(bad)
    assert cond(bad, "Succeeded") == ("False", "UnknownModel")
    rec = job("h")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    core.cancel(rec.key)
    assert bus.cancelled(rec.key, a.attempt)
    assert rec.key not in core.jobs and core.state.counts(POOL)["idle"] == 1


def test_idle_workers_return_to_the_cold_pool_after_the_window(env: dict[str, Any]) -> None:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    rec = job("i")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    post(bus, a, "succeeded", iterations=50, value=0.1)
    core.tick()
    clock.t += 29
    core.tick()
    assert env["backend"].shrunk == []
    clock.t += 2
    core.tick()
    assert env["backend"].shrunk == ["w1"] and core.state.cold_free == 4


def test_two_warm_pools_keep_their_own_idle_windows(env: dict[str, Any]) -> None:
    """Regression: adding a second WarmPool used to overwrite the first pool's idle window."""
    core, bus, clock = env["core"], env["bus"], env["clock"]
    other = PoolConfig("pool-b", "test/other", max_warm=4, idle_window_seconds=300, cold_start_seconds=5)
    core.add_pool(other)  # added after "pool" (30 s window)
    rec_a, rec_b = job("a"), job("b", model="test/other")
    core.submit(rec_a)
    core.submit(rec_b)
    core.tick()
    worker(bus, "wa", clock)
    bus.publish_worker(
        WorkerRecord(
            id="wb", pool="pool-b", model="test/other", state=WorkerState.READY,
            started_at=clock.t - 3, ready_at=clock.t,
        )
    )  # fmt: skip
    clock.t += 5
    core.tick()
    for a in (pop(bus, "wa"), pop(bus, "wb")):
        post(bus, a, "succeeded", iterations=50, value=0.1)
    core.tick()
    clock.t += 31
    core.tick()
    assert env["backend"].shrunk == ["wa"]  # pool's 30 s window passed; pool-b's 300 s has not
    clock.t += 270
    core.tick()
    assert env["backend"].shrunk == ["wa", "wb"]


# --------------------------------------------------------------------------- control-plane restarts
def restarted(env: dict[str, Any], rec: JobRecord) -> tuple[ControlCore, JobRecord]:
    """A new core (the operator restarted) and the job rebuilt from its persisted status."""
    old = env["core"]
    core = ControlCore(env["backend"], env["bus"], old.settings, list(old.pools.values()), clock=env["clock"])
    again = JobRecord(
        rec.key, rec.spec, rec.created, rec.dataset, rec.artifact_dir, uid=rec.uid, generation=1
    )
    again.status = rec.status.model_copy(deep=True)
    again.attempt = rec.status.attempts or 0
    return core, again


def test_restart_adopts_an_attempt_that_still_runs_and_finishes_it_once(env: dict[str, Any]) -> None:
    bus, clock = env["bus"], env["clock"]
    rec = job("r1", deadline="40s", iterations=400)
    a0, a1 = run_to_dispatch(env, rec, ["w1", "w2"])
    post(bus, a0, "progress", iterations=10, checkpointed=10)
    env["core"].tick()
    for a, wid in ((a0, "w1"), (a1, "w2")):
        worker(bus, wid, clock, WorkerState.BUSY, job=rec.key, attempt=1, rank=a.rank, world=2)
    core, again = restarted(env, rec)
    core.submit(again)
    core.tick()
    assert again.workers == ["w1", "w2"] and core.state.counts(POOL)["busy"] == 2
    assert again.status.iterations == 10 and not again.terminal
    post(bus, a0, "succeeded", iterations=400, value=0.3)
    core.tick()
    assert cond(again, "Succeeded") == ("True", "Completed")
    assert bus.pop_assignment("w1", timeout=0.1) is None  # never dispatched again
    assert core.metrics.jobs_finished.labels(MODEL, "default", "succeeded")._value.get() == 1


def test_restart_takes_a_result_posted_while_the_control_plane_was_down(env: dict[str, Any]) -> None:
    bus = env["bus"]
    rec = job("r2")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    post(bus, a, "succeeded", iterations=50, value=0.4, prompt="q")
    core, again = restarted(env, rec)
    core.submit(again)
    core.tick()
    assert cond(again, "Succeeded")[0] == "True" and again.status.optimized_prompt == "q"


def test_restart_reruns_an_attempt_whose_workers_are_gone_after_the_grace(env: dict[str, Any]) -> None:
    bus, clock = env["bus"], env["clock"]
    rec = job("r3")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    post(bus, a, "progress", iterations=25, checkpointed=20)
    bus.forget_worker("w1")  # the worker died with the operator
    core, again = restarted(env, rec)
    core.submit(again)
    core.tick()
    assert again.key in core.recovering and not bus.cancelled(rec.key, 1)
    clock.t += core.settings.recovery_grace_s + 1
    core.tick()
    assert bus.cancelled(rec.key, 1) and cond(again, "Running") == ("False", "AttemptLost")
    assert core.state.jobs[rec.key].done_iterations == 20
    worker(bus, "w9", clock)
    core.tick()
    core.tick()
    b = pop(bus, "w9")
    assert b.attempt == 2 and b.checkpoint_dir == a.checkpoint_dir


def test_terminal_jobs_stay_terminal_after_a_restart(env: dict[str, Any]) -> None:
    bus = env["bus"]
    rec = job("r4")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    post(bus, a, "succeeded", iterations=50, value=0.4)
    env["core"].tick()
    core, again = restarted(env, rec)
    core.submit(again)
    core.tick()
    assert again.terminal and rec.key not in core.state.jobs
    assert bus.pop_assignment("w1", timeout=0.1) is None


# --------------------------------------------------------------------------- the Prompt Bank
def test_bank_decision_reaches_the_status_and_a_retry_reuses_the_pick(env: dict[str, Any]) -> None:
    core, bus = env["core"], env["bus"]
    rec = job("pb")  # promptBank auto (default); 6 s predicted lookup fits 20 % of 10 min
    (a,) = run_to_dispatch(env, rec, ["w1"])
    assert (a.prompt_bank, a.initial_prompt) == ("auto", None)
    assert a.bank_budget_s == pytest.approx(120.0)
    report = PromptBankReport(
        source="bank", prompt="Classify it.", score=1.25, evaluations=57, latency_seconds=2.5,
        predicted_seconds=2.0, reason=Reason.PROMPT_BANK_USED, message="picked",
    )  # fmt: skip
    post(bus, a, "progress", iterations=0, prompt_bank=report)
    post(bus, a, "failed", reason="CollectiveTimeout", message="peer lost")
    core.tick()
    pb = rec.status.prompt_bank
    assert (
        pb is not None and pb.used and (pb.prompt, pb.score, pb.evaluations) == ("Classify it.", "1.25", 57)
    )
    assert core.estimator.profile(POOL).bank_lookup_seconds == 2.0  # the bank's own prediction
    core.tick()
    b = pop(bus, "w1")  # the retry starts from the prompt the first attempt picked, without a lookup
    assert (b.attempt, b.prompt_bank, b.initial_prompt) == (2, "never", "Classify it.")


def test_bank_skipped_by_the_latency_budget_or_by_the_spec(env: dict[str, Any]) -> None:
    core = env["core"]
    short = job("short", deadline="20s", iterations=10)  # 20 % of 20 s = 4 s < 6 s predicted lookup
    core.submit(short)
    assert short.status.prompt_bank.reason == "LatencyBudgetExceeded" and not short.status.prompt_bank.used
    never = job("never")
    never.spec = never.spec.model_copy(update={"prompt_bank": "never"})
    core.submit(never)
    assert never.status.prompt_bank.reason == "PromptBankDisabled"


@pytest.mark.parametrize("policy", ["promptTuner", "infless", "elasticflow"])
def test_the_policy_is_a_typed_setting_and_each_runs_a_job(redis_server: Any, tmp_path: Path, policy) -> None:
    """The core applies any policy's decisions; policies without runtime reuse (ElasticFlow-like: a
    fixed cluster, every allocation cold) hand the finished job's workers back at once."""
    bus = Bus(redis_server.url, namespace=f"core{time.time_ns()}")
    backend, clock = FakeBackend(), Clock()
    settings = CoreSettings(
        cold_capacity=4, channel_url=redis_server.url, work_dir=tmp_path, max_attempts=2, policy=policy
    )
    pool = PoolConfig("pool", MODEL, max_warm=4, idle_window_seconds=30, cold_start_seconds=5)
    core = ControlCore(backend, bus, settings, [pool], clock=clock)
    assert core.policy.name == policy
    rec = job("p")
    core.submit(rec)
    core.tick()
    assert backend.grown and sum(n for _, n in backend.grown) >= 1
    wids = [f"w{i}" for i in range(sum(n for _, n in backend.grown))]
    for wid in wids:
        worker(bus, wid, clock)
    clock.t += 5
    core.tick()
    popped = {wid: bus.pop_assignment(wid, timeout=0.2) for wid in wids}
    assigned = [a for a in popped.values() if a is not None]
    ran_on = sorted(wid for wid, a in popped.items() if a is not None)
    assert assigned and cond(rec, "Running") == ("True", "Tuning")
    post(bus, assigned[0], "succeeded", iterations=50, value=0.1)
    core.tick()
    assert cond(rec, "Succeeded") == ("True", "Completed") and core.done()
    if policy == "elasticflow":
        assert sorted(backend.shrunk) == ran_on
        assert core.state.cold_free == 4
    else:
        assert backend.shrunk == [] and core.state.counts(POOL)["idle"] == len(assigned)


def test_an_unknown_policy_is_refused_with_the_variable_named() -> None:
    from elastune_operator.k8s.settings import OperatorSettings, SettingsError

    env = {"ELASTUNE_REDIS_URL": "redis://r:6379/0", "ELASTUNE_SCHEDULING_POLICY": "fifo"}
    with pytest.raises(SettingsError, match="ELASTUNE_SCHEDULING_POLICY='fifo': must be one of promptTuner"):
        OperatorSettings.from_env(env)
    env["ELASTUNE_SCHEDULING_POLICY"] = "infless"
    assert OperatorSettings.from_env(env).scheduling_policy == "infless"


def test_a_job_on_a_pod_that_serves_inference_is_co_served_and_others_say_why_not(
    env: dict[str, Any],
) -> None:
    """FlexLLM co-serving in the control plane: a one-pod attempt whose pod served a request within the
    last minute runs co-served (under the pool's TPOT SLO); a spec the engine cannot co-serve (a target
    metric: co-served jobs evaluate only at the end) runs on a dedicated pod the pool grows for, with the
    reason in status; a pod that serves nobody gets a dedicated attempt."""
    from datetime import datetime

    from elastune_contract.api.tuningjob import TuningJobSpec
    from elastune_contract.api.warmpool import ServingSpec
    from elastune_contract.protocol import ServingCost, ServingState

    core, bus, clock = env["core"], env["bus"], env["clock"]
    core.serving.add_pool("pool", MODEL, ServingSpec.model_validate({"slo": {"tpotMilliseconds": 40}}))

    cpu_cost = ServingCost(prefill_s_per_token=1e-4, decode_step_base_s=0.01, decode_step_per_seq_s=0.001)
    cpu_cost.device = "cpu"

    def serving(last: float | None, running: int = 0) -> ServingState:
        return ServingState(model=MODEL, max_model_len=128, running=running, last_request_at=last)

    co, target = job("co", iterations=5), job("target", iterations=5)
    target.spec = TuningJobSpec.model_validate(
        {
            **target.spec.model_dump(by_alias=True),
            "termination": {"maxIterations": 5, "target": {"metric": "loss", "value": "0.5"}},
        }
    )
    core.submit(co)
    core.tick()
    worker(bus, "w1", clock, serving=serving(clock.t - 10))
    clock.t += 5
    core.tick()
    a = pop(bus, "w1")
    assert a.coserve is True and a.tpot_slo_s == pytest.approx(0.04)
    assert co.status.co_served is True and co.status.pods == ["w1"]
    # Its progress is not a dedicated iteration time: the estimator does not learn from it.
    before = core.estimator.observed_iteration_seconds(POOL)
    post(bus, a, "progress", iterations=2, checkpointed=0, seconds_per_iteration=9.0)
    clock.t += 1
    core.tick()
    assert core.estimator.observed_iteration_seconds(POOL) == before
    assert core.estimator.coserved_iteration_seconds(POOL) == 9.0  # learned apart
    # ... and it predicts the co-served job's end: 3 iterations left at 9 s each.
    assert co.status.predicted_completion_time is not None
    predicted = datetime.fromisoformat(co.status.predicted_completion_time.replace("Z", "+00:00"))
    assert predicted.timestamp() == pytest.approx(clock.t + 27, abs=1)
    post(bus, a, "succeeded", iterations=5, artifact="/out/co", reason="MaxIterations")
    clock.t += 1
    core.tick()

    # A job the engine cannot co-serve does not take the serving pod from inference: the pool grows
    # and it runs on a dedicated pod, its status saying why it was not co-served.
    worker(bus, "w1", clock, serving=serving(None, running=2))
    grown = len(env["backend"].grown)
    core.submit(target)
    clock.t += 1
    core.tick()
    assert env["backend"].grown[grown:] == [("default/pool", 1)]
    assert bus.pop_assignment("w1", timeout=0.2) is None
    worker(bus, "w2", clock)
    clock.t += 5
    core.tick()
    b = pop(bus, "w2")
    assert b.coserve is False and target.status.co_served is False
    assert "termination.target" in (target.status.co_serving_reason or "")
    post(bus, b, "succeeded", iterations=5, artifact="/out/target", reason="MaxIterations")
    clock.t += 1
    core.tick()

    idle = job("idle", iterations=5)
    worker(bus, "w1", clock, serving=serving(clock.t - 600))
    # w2 is saturated by inference on a CPU: no spare budget (rate 0), so neither free nor co-servable.
    full = serving(None, running=2).model_copy(update={"utilization": 1.0, "cost": cpu_cost})
    worker(bus, "w2", clock, serving=full)
    core.submit(idle)
    clock.t += 1
    core.tick()
    c = pop(bus, "w1")
    assert core.state.coserve_rate == {core.fleet.gpu_of["w2"]: 0.0}
    assert c.coserve is False and idle.status.co_served is False and idle.status.co_serving_reason is None

    # The attempts counter tells co-served from dedicated placements (the dashboard's co-serving row).
    def attempts(placement: str) -> float | None:
        labels = {"model": MODEL, "pool_namespace": "default", "placement": placement}
        return core.metrics.registry.get_sample_value("elastune_tuningjob_attempts_started_total", labels)

    assert attempts("coserved") == 1 and attempts("dedicated") == 2


def test_a_co_served_attempt_the_engine_refused_says_so_in_status(env: dict[str, Any]) -> None:
    from elastune_contract.api.warmpool import ServingSpec
    from elastune_contract.protocol import ServingState

    core, bus, clock = env["core"], env["bus"], env["clock"]
    core.serving.add_pool("pool", MODEL, ServingSpec())
    rec = job("refused", iterations=5)
    core.submit(rec)
    core.tick()
    worker(bus, "w1", clock, serving=ServingState(model=MODEL, max_model_len=128, running=1))
    clock.t += 5
    core.tick()
    a = pop(bus, "w1")
    assert a.coserve is True and rec.status.co_served is True
    post(bus, a, "started", coserved=False, message="co-serving refused: this engine already co-serves a job")
    clock.t += 1
    core.tick()
    assert rec.status.co_served is False
    assert "already co-serves a job" in (rec.status.co_serving_reason or "")
    # Its step times are then learned as the (dedicated) attempt's, not as co-served ones.
    post(bus, a, "progress", iterations=2, checkpointed=0, seconds_per_iteration=0.5)
    clock.t += 1
    core.tick()
    assert core.estimator.coserved_iteration_seconds(POOL) is None


def test_a_pool_with_co_serving_off_keeps_its_serving_pods_for_inference(env: dict[str, Any]) -> None:
    from elastune_contract.api.warmpool import ServingSpec
    from elastune_contract.protocol import ServingState

    core, bus, clock = env["core"], env["bus"], env["clock"]
    spec = ServingSpec.model_validate({"coServing": False})
    core.pools[POOL].serving = spec
    core.serving.add_pool("pool", MODEL, spec)
    worker(bus, "w1", clock, serving=ServingState(model=MODEL, max_model_len=128, running=1))
    core.tick()
    rec = job("dedicated", iterations=5)
    grown = len(env["backend"].grown)
    core.submit(rec)
    clock.t += 1
    core.tick()
    # The serving pod is reported at rate 0: neither free for dedicated tuning nor offered to co-serve.
    assert core.state.coserve_rate == {core.fleet.gpu_of["w1"]: 0.0}
    assert env["backend"].grown[grown:] == [("default/pool", 1)]
    assert bus.pop_assignment("w1", timeout=0.2) is None
    worker(bus, "w2", clock)
    clock.t += 5
    core.tick()
    a = pop(bus, "w2")
    assert a.coserve is False and rec.status.co_served is False
    assert "serving.coServing: false" in (rec.status.co_serving_reason or "")


def test_a_job_over_its_pools_job_limits_fails_at_admission_and_nothing_runs(env: dict[str, Any]) -> None:
    """Issue 25 item 5: batch size and iterations bounded by the pool's capacity (WarmPool spec.jobLimits),
    beyond the TuningJob schema's bounds: a job over either fails at once with the field and the limit
    named; a job within them is accepted; nothing is grown for the refused one."""
    settings, bus = env["settings"], env["bus"]
    pool = PoolConfig("pool", MODEL, max_warm=4, cold_start_seconds=5, max_batch_size=16, max_iterations=100)
    core = ControlCore(env["backend"], bus, settings, [pool], clock=env["clock"])
    big = job("big", iterations=500)
    big.spec.hyperparameters.batch_size = 64
    core.submit(big)
    status, reason = cond(big, "Succeeded")
    assert (status, reason) == ("False", "ExceedsPoolLimits") and big.terminal
    message = next(c.message for c in big.status.conditions if c.type == "Succeeded")
    assert "batchSize 64 is above WarmPool default/pool's jobLimits.maxBatchSize (16)" in message
    assert "maxIterations 500 is above WarmPool default/pool's jobLimits.maxIterations (100)" in message
    fits = job("fits", iterations=100)
    fits.spec.hyperparameters.batch_size = 16
    core.submit(fits)
    core.tick()
    assert not fits.terminal and env["backend"].grown == [("default/pool", 1)]
