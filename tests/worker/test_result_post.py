"""A worker's result survives a Redis blip (issue 24 item 2): the result event of an attempt is posted
again with backoff while Redis refuses it, against a real Redis; a progress event is not held for. The
worker posts an assignment's events through its JobReporter (server/job_events.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

pytest.importorskip("torch")

from elastune_common.bus import Bus
from elastune_contract.protocol import Assignment, Event
from elastune_worker.server import job_events
from elastune_worker.server.job_events import JobReporter


class BlippingBus(Bus):
    """Refuses the first ``refuse`` posts as a Redis that is down (or whose ACL refuses the worker)."""

    def __init__(self, url: str, ns: str, refuse: int) -> None:
        super().__init__(url, ns)
        self.refuse = refuse
        self.tries = 0

    def post(self, event: Event) -> None:
        self.tries += 1
        if self.tries <= self.refuse:
            raise redis.ConnectionError("Connection refused")
        super().post(event)


def reporter(bus: Bus) -> JobReporter:
    a = Assignment(
        job="ns/j", attempt=1, rank=0, world=1, model="m", spec={}, dataset="/d.jsonl", comm_job="c",
        checkpoint_dir="/ckpt", artifact_dir="/out/j",
    )  # fmt: skip
    return JobReporter(bus, "w1", a, threading.Event())


def test_a_result_posted_during_a_redis_blip_arrives(redis_server: Any) -> None:
    bus = BlippingBus(redis_server.url, f"post{time.time_ns()}", refuse=3)
    t0 = time.monotonic()
    reporter(bus).report("succeeded", iterations=50, artifact="/out/j")
    assert time.monotonic() - t0 < 30  # backoff from 0.2 s, not the whole give-up time
    results = [e for _, e in bus.events("ns/j") if e.type == "succeeded"]
    assert len(results) == 1 and results[0].artifact == "/out/j" and bus.tries == 4


def test_a_progress_event_is_not_held_for(redis_server: Any) -> None:
    bus = BlippingBus(redis_server.url, f"post{time.time_ns()}", refuse=1)
    reporter(bus).report("progress", iterations=10)
    assert bus.tries == 1 and bus.events("ns/j") == []


def test_a_result_post_gives_up_after_its_deadline(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_events, "RESULT_POST_SECONDS", 0.5)
    bus = BlippingBus(redis_server.url, f"post{time.time_ns()}", refuse=10**6)
    t0 = time.monotonic()
    reporter(bus).report("failed", reason="WorkerError", message="x")
    assert time.monotonic() - t0 < 2.0 and bus.tries >= 2
