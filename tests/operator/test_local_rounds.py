"""`elastune serve` and `elastune run` keep going while Redis is away: a control round that cannot reach
it is skipped (said once), and the rounds carry on once a Redis answers at the same address again. Before,
the first such round raised out of the loop and `elastune serve` exited with its gateway and workers
(`elastune bench chaos`, experiment redis-down)."""

from __future__ import annotations

import io
import subprocess
import time
from pathlib import Path

from test_control_core import MODEL, Clock, FakeBackend

from elastune_common.bus import Bus
from elastune_operator.control.core import ControlCore
from elastune_operator.control.records import CoreSettings, PoolConfig
from elastune_operator.local.rounds import Rounds
from real_servers import start_redis, stop


def test_rounds_skip_while_redis_is_away_and_go_on_when_it_is_back(tmp_path: Path) -> None:
    server = start_redis(tmp_path / "r1")
    bus = Bus(server.url, namespace="rounds")
    settings = CoreSettings(cold_capacity=2, channel_url=server.url, work_dir=tmp_path)
    pool = PoolConfig("pool", MODEL, max_warm=2, idle_window_seconds=30, cold_start_seconds=5)
    core = ControlCore(FakeBackend(), bus, settings, [pool], clock=Clock())
    err = io.StringIO()
    rounds = Rounds(core, err)
    assert rounds.tick()
    stop(server.proc)
    assert not rounds.tick() and not rounds.tick()  # skipped, not raised
    assert err.getvalue().count("Redis unreachable") == 1
    again = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(server.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not rounds.tick():  # the first round that reaches the new Redis goes through
            assert time.monotonic() < deadline, err.getvalue()
            time.sleep(0.1)
        assert "Redis is back" in err.getvalue()
        assert bus.redis.keys("rounds:*"), "the core wrote nothing to the Redis that came back empty"
    finally:
        stop(again)
