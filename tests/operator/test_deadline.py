"""A TuningJob's deadline is read once, by the contract (``TuningJobSpec.deadline_seconds``): the job the
scheduler holds carries the deadline in seconds, and a deadline that got past an apiserver without the
CRD's schema (kopf hands the operator whatever is stored) fails the job with InvalidSpec naming
spec.deadline, never an operator error. The operator's runtime runs in this process against the
Kubernetes API emulator and a real Redis (tests/operator_site.py); no worker, no torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from elastune_contract.vocabulary import Reason
from operator_site import OperatorSite, wait_for


@pytest.fixture
def operator(tmp_path: Path, redis_server: Any) -> Iterator[OperatorSite]:
    site = OperatorSite(tmp_path, redis_server.url, "deadline")
    try:
        yield site
    finally:
        site.close()


def test_the_scheduler_holds_the_deadline_in_seconds(operator: OperatorSite) -> None:
    operator.pool("tiny", volumes=[{"claimName": "out"}])  # the job's output must be durable
    operator.job("ninety-minutes", deadline="1h30m", output={"uri": "pvc://out/prompts/x"})

    def slo() -> float | None:
        job = operator.runtime.call(lambda: operator.runtime.core.state.jobs.get("default/ninety-minutes"), 5)
        return job.slo if job is not None else None

    assert wait_for("the job admitted", slo) == 5400


@pytest.mark.parametrize("deadline", ["0s", "10 minutes", "1m1h"])
def test_a_bad_deadline_fails_the_job_with_invalid_spec_naming_the_field(
    operator: OperatorSite, deadline: str
) -> None:
    operator.pool("tiny")
    body = operator.job("bad", submit=False)  # stored with a good deadline: the emulator checks the schema
    body["spec"]["deadline"] = deadline  # what an apiserver without the schema would hand kopf
    operator.runtime.submit_job(body)

    failed = wait_for("the job failed", lambda: operator.condition("bad", "Failed"))
    assert (failed["status"], failed["reason"]) == ("True", Reason.INVALID_SPEC), failed
    assert "spec.deadline" in failed["message"] and repr(deadline) in failed["message"], failed
    accepted = operator.condition("bad", "Accepted")
    assert accepted is not None and (accepted["status"], accepted["reason"]) == ("False", Reason.INVALID_SPEC)
    assert "default/bad" not in operator.runtime.call(lambda: dict(operator.runtime.core.jobs), 5)
