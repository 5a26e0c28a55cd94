"""A TuningJob is read once where it enters the control plane (issue 41 item 3): its deadline is parsed
once (``JobRecord.deadline``), its Prompt Bank budget computed once (by the policy at admission, then
carried to the status message, the dispatch's ``Assignment.bank_budget_s`` and the attempt's setup
allowance), and its pool resolved once (the operator's ``submit_job`` hands it to the core).

The counts are taken on the real code paths: a profile hook counts every call of the functions that
compute each value, whoever makes it. The control core runs against a real Redis with the test playing
the worker (test_control_core.py's helpers); the operator's runtime against the Kubernetes API emulator
(tests/operator_site.py)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from test_control_core import MODEL, cond, pop, post, worker
from test_control_core import env as env  # the core under test, a fixture shared with test_control_core

from elastune_contract.api import units
from elastune_contract.api.resources import parse_resource
from elastune_contract.api.tuningjob import TuningJob
from elastune_operator.control import records
from elastune_operator.control.resources import job_record

DEADLINE, DEADLINE_S = "1h30m", 5400


@contextmanager
def counted(**wanted: Callable[[FrameType], bool]) -> Iterator[Counter[str]]:
    """Counts calls, in this thread, of functions named by ``wanted``'s keys (a function's name) whose
    frame passes its test: every caller is seen, however it reached the function."""
    counts: Counter[str] = Counter()

    def hook(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and (test := wanted.get(frame.f_code.co_name)) is not None and test(frame):
            counts[frame.f_code.co_name] += 1

    sys.setprofile(hook)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def _is(fn: Callable[..., Any]) -> Callable[[FrameType], bool]:
    return lambda frame: frame.f_code is fn.__code__


def _on_model(frame: FrameType) -> bool:
    return frame.f_code is records.resolve_pool.__code__ and frame.f_locals.get("model") == MODEL


def _resource(name: str, deadline: str) -> TuningJob:
    res = parse_resource(
        {
            "apiVersion": "elastune.dev/v1alpha1",
            "kind": "TuningJob",
            "metadata": {"name": name, "namespace": "default", "generation": 1},
            "spec": {
                "model": MODEL,
                "dataset": "/d.jsonl",
                "termination": {"maxIterations": 50},
                "deadline": deadline,
            },
        }
    )
    assert isinstance(res, TuningJob)
    return res


def _counters() -> dict[str, Callable[[FrameType], bool]]:
    on_deadline = _is(units.parse_duration)
    return {
        "parse_duration": lambda f: on_deadline(f) and f.f_locals.get("value") in (DEADLINE, "20s"),
        "resolve_pool": _on_model,
        "bank_budget_seconds": lambda f: True,  # any policy's rule
        "decide_prompt_bank": lambda f: True,  # fraction x SLO inside it
    }


def test_submit_rounds_dispatch_and_result_read_the_job_once(env: dict[str, Any]) -> None:
    core, bus, clock = env["core"], env["bus"], env["clock"]
    resource = _resource("walk", DEADLINE)  # validated at the API boundary, before the control plane
    with counted(**_counters()) as calls:
        rec = job_record(resource, created=clock.t, dataset="/d.jsonl", artifact="/out/walk")
        core.submit(rec)
        core.tick()
        worker(bus, "w1", clock)
        clock.t += 5
        for _ in range(3):  # the dispatch, then rounds with the attempt in flight
            core.tick()
            clock.t += 1
        (a,) = [pop(bus, "w1")]
        post(bus, a, "progress", iterations=20, checkpointed=20, seconds_per_iteration=0.2)
        core.tick()
        post(bus, a, "succeeded", iterations=50, value=0.9)
        core.tick()
    assert dict(calls) == {"parse_duration": 1, "resolve_pool": 1, "bank_budget_seconds": 1}, calls
    assert cond(rec, "Succeeded") == ("True", "Completed") and rec.status.slo_met is True
    assert core.state.jobs[rec.key].slo == DEADLINE_S and rec.deadline.at == rec.created + DEADLINE_S
    assert (a.prompt_bank, a.bank_budget_s) == ("auto", pytest.approx(0.2 * DEADLINE_S))


def test_a_skipped_lookup_says_the_budget_computed_once(env: dict[str, Any]) -> None:
    core = env["core"]
    resource = _resource("short", "20s")  # 20 % of 20 s = 4 s < the 6 s predicted lookup
    with counted(**_counters()) as calls:
        rec = job_record(resource, created=env["clock"].t, dataset="/d.jsonl", artifact="/out/short")
        core.submit(rec)
        core.tick()
    pb = rec.status.prompt_bank
    assert pb is not None and pb.reason == "LatencyBudgetExceeded" and "budget 4.0 s" in (pb.message or "")
    assert dict(calls) == {"parse_duration": 1, "resolve_pool": 1, "bank_budget_seconds": 1}, calls


def test_the_operator_resolves_a_jobs_pool_once(tmp_path: Path, redis_server: Any) -> None:
    """kopf's create handler to the core: the hold check, the s3 Secret's mount, the storage placement
    and the core's admission use one resolution (``ControlCore.resolve``, counted on the runtime's own
    core)."""
    pytest.importorskip("kmock")
    from operator_site import OperatorSite, wait_for

    site = OperatorSite(tmp_path, redis_server.url, "readonce")
    try:
        site.pool("tiny", volumes=[{"claimName": "out", "jobStorage": True}])
        resolved: list[tuple[str, str]] = []
        real = site.runtime.core.resolve

        def resolve(namespace: str, model: str) -> Any:
            resolved.append((namespace, model))
            return real(namespace, model)

        site.runtime.core.resolve = resolve
        site.job("once", output={"secretName": "s3", "uri": "s3://bucket/prompts/once"})
        scheduled = wait_for("the job admitted", lambda: site.condition("once", "Scheduled"))
        assert scheduled["reason"] == "PoolGrowing", scheduled
        assert resolved == [("default", MODEL)]
        assert site.runtime.call(lambda: site.runtime.backend.s3_secrets.get("default/tiny"), 5) == {"s3"}
        assert site.runtime.call(lambda: site.runtime.core.jobs["default/once"].pool, 5) == "default/tiny"
    finally:
        site.close()
