"""Bounded waits and intent before effect in the control core (issue 24 items 2 and 4), against a real
Redis with scripted workers (the helpers of test_control_core.py): an attempt that never starts, one
that stalls, and one whose result event was lost each end (retried, or failed with the reason after the
retry limit) instead of staying Running forever; the attempt is in the stored status before any worker
is told to start it; a publication is in status only once its LoRAAdapter exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_control_core import MODEL, cond, job, pop, post, run_to_dispatch, worker
from test_control_core import env as env  # the core under test, a fixture shared with test_control_core

from elastune_common.bus import Bus
from elastune_contract.protocol import Assignment, WorkerState
from elastune_contract.vocabulary import Reason
from elastune_operator.control import core as core_module
from elastune_operator.control.attempt_timeouts import AttemptTimeouts
from elastune_operator.control.core import ControlCore
from elastune_operator.control.records import JobRecord

LIMITS = AttemptTimeouts()  # the core's defaults


def busy(env: dict[str, Any], wid: str, a: Assignment) -> None:
    """The worker's registry record while it runs ``a``."""
    worker(
        env["bus"], wid, env["clock"], WorkerState.BUSY, job=a.job, attempt=a.attempt, rank=a.rank, world=1
    )


def running(rec: JobRecord) -> tuple[str, str, str]:
    c = next(c for c in rec.status.conditions if c.type == "Running")
    return c.status, c.reason, c.message


def no_assignment(bus: Bus, wid: str) -> bool:
    return bus.pop_assignment(wid, timeout=0.05) is None


def test_a_lost_result_event_is_retried_and_the_job_finishes_exactly_once(env: dict[str, Any]) -> None:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    rec = job("lost")
    (a,) = run_to_dispatch(env, rec, ["w1"])
    busy(env, "w1", a)
    post(bus, a, "progress", iterations=20, checkpointed=20, seconds_per_iteration=0.1)
    clock.t += 2
    core.tick()
    # The worker finished and went back to READY, but its "succeeded" post was lost in a Redis blip.
    worker(bus, "w1", clock)
    for _ in range(5):  # a few seconds: the result may still be on its way
        clock.t += 1
        core.tick()
    assert cond(rec, "Running") == ("True", "Tuning") and no_assignment(bus, "w1")
    clock.t += LIMITS.result_grace_s
    core.tick()
    # Cancelled and retried from the checkpoint on the same warm worker, the reason in the status.
    assert bus.cancelled(rec.key, 1)
    b = pop(bus, "w1")
    assert running(rec) == ("True", "Tuning", "attempt 2 on w1, resuming at iteration 20 after ResultLost")
    assert b.attempt == 2 and core.state.jobs[rec.key].done_iterations == 20
    busy(env, "w1", b)
    # The first attempt's result arrives late (the worker's retry got through): a straggler, ignored.
    post(bus, a, "succeeded", iterations=50, artifact="/out/lost", reason="MaxIterations")
    clock.t += 1
    core.tick()
    assert not rec.terminal
    post(
        bus,
        b,
        "succeeded",
        iterations=50,
        value=0.9,
        prompt="p",
        artifact="/out/lost",
        reason="MaxIterations",
    )
    clock.t += 1
    core.tick()
    assert cond(rec, "Succeeded") == ("True", "MaxIterations") and rec.status.attempts == 2
    finished = core.metrics.jobs_finished.labels(MODEL, "default", "succeeded")._value.get()
    for _ in range(3):
        worker(bus, "w1", clock)
        clock.t += 30
        core.tick()
    assert core.metrics.jobs_finished.labels(MODEL, "default", "succeeded")._value.get() == finished == 1
    assert no_assignment(bus, "w1")


def test_an_attempt_never_started_is_retried_after_its_deadline_then_fails(env: dict[str, Any]) -> None:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    rec = job("never")
    run_to_dispatch(env, rec, ["w1"])  # popped, but the worker never runs it (its record stays READY)
    deadline = LIMITS.start_timeout_s
    clock.t += deadline - 1
    core.tick()
    assert cond(rec, "Running") == ("True", "Tuning")
    clock.t += 2
    core.tick()
    assert bus.cancelled(rec.key, 1) and running(rec)[2].endswith("after AttemptNotStarted")
    b = pop(bus, "w1")
    assert b.attempt == 2
    clock.t += deadline + 1
    core.tick()  # max_attempts = 2: the job fails with the reason
    assert cond(rec, "Succeeded") == ("False", Reason.ATTEMPT_NOT_STARTED) and rec.terminal
    assert "did not start" in next(c.message for c in rec.status.conditions if c.type == "Failed")


def test_a_stalled_attempt_is_retried_after_what_its_own_step_time_allows(env: dict[str, Any]) -> None:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    rec = job("stall", iterations=400)
    (a,) = run_to_dispatch(env, rec, ["w1"])
    busy(env, "w1", a)
    # 6 s per iteration, progress every 10 iterations: a 600 s gap is normal, 10 of them are not.
    post(bus, a, "progress", iterations=10, checkpointed=10, seconds_per_iteration=6.0)
    clock.t += 1
    core.tick()
    allowed = LIMITS.stall_factor * core.settings.progress_every * 6.0
    assert allowed > LIMITS.stall_floor_s
    clock.t += allowed - 10
    core.tick()
    assert cond(rec, "Running") == ("True", "Tuning")
    clock.t += 20
    core.tick()
    assert bus.cancelled(rec.key, 1) and running(rec)[2].endswith("after AttemptStalled")
    assert pop(bus, "w1").attempt == 2


def test_the_attempt_is_in_the_stored_status_before_its_assignment_is_pushed(
    env: dict[str, Any], redis_server: Any, tmp_path: Path
) -> None:
    stored: dict[str, int] = {}  # job key -> attempts as last stored by the status sink
    seen: list[tuple[int, int]] = []  # (assignment's attempt, stored attempts when it was pushed)

    def on_status(rec: JobRecord) -> None:
        stored[rec.key] = rec.status.attempts or 0

    class OrderedBus(Bus):
        def assign(self, worker_id: str, assignment: Assignment) -> None:
            seen.append((assignment.attempt, stored.get(assignment.job, 0)))
            super().assign(worker_id, assignment)

    bus = OrderedBus(redis_server.url, namespace=env["bus"].ns + "o")
    core = ControlCore(
        env["backend"], bus, env["settings"], [env["pool"]], clock=env["clock"], on_status=on_status
    )
    env2 = {**env, "bus": bus, "core": core}
    rec = job("order")
    run_to_dispatch(env2, rec, ["w1"])
    assert seen == [(1, 1)]


def test_an_attempt_whose_status_write_fails_is_not_pushed_until_it_is_stored(
    env: dict[str, Any], redis_server: Any
) -> None:
    refuse = [True]

    def persist(rec: JobRecord) -> bool:
        return not refuse[0]

    core = ControlCore(
        env["backend"], env["bus"], env["settings"], [env["pool"]], clock=env["clock"], persist=persist
    )
    env2 = {**env, "core": core}
    rec = job("unstored")
    core.submit(rec)
    core.tick()
    worker(env["bus"], "w1", env["clock"])
    env["clock"].t += 5
    core.tick()
    core.tick()
    assert rec.attempt == 1 and no_assignment(env["bus"], "w1")
    refuse[0] = False
    core.tick()
    assert pop(env2["bus"], "w1").attempt == 1


def _published_job(env: dict[str, Any], core: ControlCore, name: str) -> tuple[JobRecord, Assignment]:
    from elastune_contract.api.resources import parse_resource

    res = parse_resource(
        {
            "apiVersion": "elastune.dev/v1alpha1",
            "kind": "TuningJob",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "model": MODEL,
                "dataset": "/d.jsonl",
                "termination": {"maxIterations": 50},
                "deadline": "10m",
                "output": {"publish": f"{name}-adapter"},
            },
        }
    )
    rec = JobRecord(f"default/{name}", res.spec, 1_800_000_000.0, "/d.jsonl", f"/out/{name}", generation=1)
    (a,) = run_to_dispatch({**env, "core": core}, rec, ["w1"])
    return rec, a


def test_status_says_published_only_once_the_adapter_exists(env: dict[str, Any]) -> None:
    bus, clock = env["bus"], env["clock"]
    calls: list[str] = []
    outcome: list[Exception | None] = [RuntimeError("503 Service Unavailable")]

    def on_publish(rec: JobRecord, adapter: Any) -> None:
        calls.append(adapter.key)
        if outcome[0] is not None:
            raise outcome[0]

    core = ControlCore(
        env["backend"], bus, env["settings"], [env["pool"]], clock=clock, on_publish=on_publish
    )
    rec, a = _published_job(env, core, "pub")
    post(bus, a, "succeeded", iterations=50, artifact="/out/pub", reason="MaxIterations")
    core.tick()
    assert cond(rec, "Succeeded")[0] == "True"
    assert rec.status.published_adapter is None and calls == ["default/pub-adapter"]
    clock.t += 3
    outcome[0] = None
    core.tick()  # retried: the API takes it now
    assert rec.status.published_adapter == "pub-adapter" and cond(rec, "Published") == ("True", "Published")
    assert calls == ["default/pub-adapter"] * 2


def test_a_publish_name_taken_becomes_a_condition_with_the_reason(env: dict[str, Any]) -> None:
    bus = env["bus"]

    def on_publish(rec: JobRecord, adapter: Any) -> None:
        raise core_module.PublishRefused(
            Reason.PUBLISH_NAME_TAKEN, "LoRAAdapter ns/taken-adapter is a user's"
        )

    core = ControlCore(
        env["backend"], bus, env["settings"], [env["pool"]], clock=env["clock"], on_publish=on_publish
    )
    rec, a = _published_job(env, core, "taken")
    post(bus, a, "succeeded", iterations=50, artifact="/out/taken", reason="MaxIterations")
    core.tick()
    assert cond(rec, "Succeeded")[0] == "True"
    assert cond(rec, "Published") == ("False", Reason.PUBLISH_NAME_TAKEN)
    assert rec.status.published_adapter is None


def test_the_stall_allowance_follows_the_measured_step_time_and_the_bank_lookup() -> None:
    from elastune_operator.control.attempt_timeouts import AttemptWatch, overdue

    w = AttemptWatch(1, 0.0, 0.0, started=True, setup_s=600.0)  # a Prompt Bank lookup of up to 600 s
    assert overdue(w, LIMITS, 850.0, progress_every=10, guess_seconds_per_iteration=0.1) is None
    late = overdue(w, LIMITS, 950.0, progress_every=10, guess_seconds_per_iteration=0.1)
    assert late is not None and late[0] == Reason.ATTEMPT_STALLED
    w.on_event(1000.0, 8.0, progress=True)  # 8 s per iteration: 10 x 10 x 8 = 800 s allowed
    assert overdue(w, LIMITS, 1790.0, progress_every=10, guess_seconds_per_iteration=0.1) is None
    assert overdue(w, LIMITS, 1810.0, progress_every=10, guess_seconds_per_iteration=0.1) is not None
    w.on_event(2000.0, 0.01, progress=True)  # fast steps: the floor, not the bank budget any more
    assert overdue(w, LIMITS, 2290.0, progress_every=10, guess_seconds_per_iteration=0.1) is None
    assert overdue(w, LIMITS, 2310.0, progress_every=10, guess_seconds_per_iteration=0.1) is not None
