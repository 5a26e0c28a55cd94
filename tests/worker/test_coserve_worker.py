"""A co-served assignment on a real serving worker process (issue 13): the tuning job runs inside the
engine's iterations while the worker answers completions with the real `openai` client; the job ends
with its artifact and a checkpoint, and the same job resumed from that checkpoint on a fresh worker
does no steps twice. Cancelling a co-served job detaches it and the worker keeps serving."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.protocol import Assignment, Event, ServingState  # noqa: E402
from elastune_demo import build as tiny_build  # noqa: E402
from elastune_demo import tasks as tiny_tasks  # noqa: E402
from tiny_test_model import TASK, TEST_SPEC  # noqa: E402 - the small model and task of the tuning tests


class Worker:
    def __init__(self, model: Path, redis_url: str, tmp: Path, wid: str) -> None:
        self.ns = f"co{time.time_ns()}"
        self.wid = wid
        self.bus = Bus(redis_url, self.ns)
        self.log = tmp / f"{wid}.log"
        cmd = [sys.executable, "-m", "elastune_worker", "serve", "--pool", "p", "--model", str(model)]
        cmd += ["--redis-url", redis_url, "--namespace", self.ns, "--worker-id", wid, "--port", "0"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            rec = self.bus.workers().get(wid)
            if rec is not None and rec.serving is not None and rec.url:
                self.url = rec.url
                return
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker never served"
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.bus.close()

    def events(self, job: str) -> list[Event]:
        return [e for _, e in self.bus.events(job)]

    def wait(self, job: str, kinds: set[str], timeout: float = 180) -> Event:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [e for e in self.events(job) if e.type in kinds]
            if done:
                return done[-1]
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"no {kinds} event for {job}: {self.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_build.ensure_tiny_model(spec=TEST_SPEC)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    task = tiny_tasks.make_task(TASK, n_train=40, n_eval=8, seed=1)
    return tiny_tasks.write_jsonl(
        list(task.train) + list(task.eval), tmp_path_factory.mktemp("data") / "d.jsonl"
    )


def assignment(model: Path, dataset: Path, tmp: Path, job: str, iterations: int) -> Assignment:
    spec = {
        "model": str(model),
        "dataset": str(dataset),
        "initialPrompt": tiny_tasks.family_instructions(TASK.family)[0],
        "termination": {"maxIterations": iterations},
        "deadline": "10m",
        "hyperparameters": {"batchSize": 4, "virtualTokens": 4},
        "promptBank": "never",
    }
    return Assignment(
        job=job, attempt=1, rank=0, world=1, model=str(model), spec=spec, dataset=str(dataset),
        comm_job=job, checkpoint_dir=str(tmp / "ckpt" / job), artifact_dir=str(tmp / "artifact" / job),
        checkpoint_every=4, progress_every=2, coserve=True, tpot_slo_s=0.05,
    )  # fmt: skip


@pytest.fixture
def worker(model: Path, redis_server: Any, tmp_path: Path) -> Iterator[Worker]:
    w = Worker(model, redis_server.url, tmp_path, "w-co")
    try:
        yield w
    finally:
        w.close()


def test_a_co_served_job_finishes_beside_inference_and_resumes_from_its_checkpoint(
    worker: Worker, model: Path, dataset: Path, tmp_path: Path, redis_server: Any
) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    served = client.models.list().data[0].id
    answers: list[str] = []
    stop = threading.Event()

    def ask() -> None:  # inference the whole time the job runs
        while not stop.is_set():
            out = client.completions.create(model=served, prompt="year: 1959;", max_tokens=8, temperature=0)
            answers.append(out.choices[0].text)

    before = client.completions.create(model=served, prompt="year: 1959;", max_tokens=8, temperature=0)
    traffic = threading.Thread(target=ask)
    traffic.start()
    try:
        worker.bus.assign(worker.wid, assignment(model, dataset, tmp_path, "ns/co", 8))
        # The heartbeat reports the inference share of the engine's time (the spare budget is the rest).
        deadline = time.monotonic() + 30
        while (
            worker.bus.workers()[worker.wid].serving or ServingState(model="", max_model_len=1)
        ).utilization <= 0:
            assert time.monotonic() < deadline, "no inference utilisation reported"
            time.sleep(0.2)
        done = worker.wait("ns/co", {"succeeded", "failed"})
    finally:
        stop.set()
        traffic.join(60)
    assert done.type == "succeeded", done
    started = next(e for e in worker.events("ns/co") if e.type == "started")
    assert started.coserved is True
    assert done.iterations == 8 and done.prompt and done.metrics and "loss" in done.metrics
    assert Path(done.artifact or "", "adapter_config.json").is_file()
    progress = [e for e in worker.events("ns/co") if e.type == "progress" and e.iterations]
    assert progress and all(e.loss is not None for e in progress[1:])
    # Inference ran beside it, and greedy outputs are the same as without the job.
    assert answers and set(answers) == {before.choices[0].text}
    ckpts = sorted((tmp_path / "ckpt" / "ns" / "co").glob("ckpt-*.pt"))
    assert ckpts and ckpts[-1].name == "ckpt-00000008.pt"

    # The same job with a higher limit on a fresh worker resumes from iteration 8, not from 0.
    other = Worker(model, redis_server.url, tmp_path, "w-co2")
    try:
        a = assignment(model, dataset, tmp_path, "ns/co", 12).model_copy(update={"attempt": 2})
        other.bus.assign(other.wid, a)
        resumed = other.wait("ns/co", {"succeeded", "failed"})
        assert resumed.type == "succeeded" and resumed.iterations == 12, resumed
        first = next(e for e in other.events("ns/co") if e.type == "progress" and e.attempt == 2)
        assert first.resumed_from == 8
    finally:
        other.close()


def test_cancelling_a_co_served_job_leaves_the_worker_serving(
    worker: Worker, model: Path, dataset: Path, tmp_path: Path
) -> None:
    worker.bus.assign(worker.wid, assignment(model, dataset, tmp_path, "ns/long", 100000))
    worker.wait("ns/long", {"progress"})
    worker.bus.cancel("ns/long", 1)
    assert worker.wait("ns/long", {"cancelled", "failed", "succeeded"}).type == "cancelled"
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    served = client.models.list().data[0].id
    assert client.completions.create(model=served, prompt="x", max_tokens=4).choices[0].text is not None
    # The engine is idle again: nothing co-served keeps it stepping.
    deadline = time.monotonic() + 10
    while worker.bus.workers()[worker.wid].state.value != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_data_parallel_job_co_served_on_two_serving_workers_all_reduces_and_finishes(
    worker: Worker, model: Path, dataset: Path, tmp_path: Path, redis_server: Any
) -> None:
    """Two serving pods, one job (world 2): each co-serves its shard inside its engine and the gradients
    meet in the storage channel; rank 0 reports progress and the artifact, rank 1 only detaches."""
    other = Worker(model, redis_server.url, tmp_path, "w-co-peer")
    try:
        base = assignment(model, dataset, tmp_path, "ns/dp", 6)
        ranks = [
            base.model_copy(
                update={"rank": r, "world": 2, "channel_url": redis_server.url, "comm_job": "ns.dp.a1"}
            )
            for r in range(2)
        ]
        worker.bus.assign(worker.wid, ranks[0])
        other.bus.assign(other.wid, ranks[1])
        done = worker.wait("ns/dp", {"succeeded", "failed"})
        assert done.type == "succeeded" and done.iterations == 6, done
        assert Path(done.artifact or "", "adapter_config.json").is_file()
        for w in (worker, other):
            started = next(e for e in w.events("ns/dp") if e.type == "started")
            assert started.coserved is True
        # Rank 1 posts no outcome of its own and goes back to ready.
        deadline = time.monotonic() + 30
        while other.bus.workers()[other.wid].state.value != "ready":
            assert time.monotonic() < deadline, other.log.read_text()[-3000:]
            time.sleep(0.2)
        assert {e.type for e in other.events("ns/dp")} == {"started"}
        ckpts = sorted((tmp_path / "ckpt" / "ns" / "dp").glob("ckpt-*.pt"))
        assert ckpts and ckpts[-1].name == "ckpt-00000006.pt"
    finally:
        other.close()


def test_an_assignment_the_engine_refuses_to_co_serve_is_tuned_dedicated_and_says_why(
    model: Path, dataset: Path, tmp_path: Path, redis_server: Any
) -> None:
    """Defence in depth behind the control plane's check: the engine refuses (here: it already co-serves
    another job), the worker tunes the assignment dedicated and its started event says why."""
    from elastune_worker.coserve.calls import CoServeCalls
    from elastune_worker.coserve.task import CoServeRefused, CoServeRequest
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.frontend.engine_loop import engine_call
    from elastune_worker.engine.frontend.messages import EngineOp
    from elastune_worker.engine.llm_engine import LLMEngine
    from elastune_worker.server.agent import Agent, AgentConfig
    from elastune_worker.tuning.trainer import TuningConfig

    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=1024))
    records = tiny_tasks.make_task(TASK, n_train=8, n_eval=2, seed=1)
    long_job = TuningConfig(max_iterations=1000, virtual_tokens=4, max_length=48)
    busy = CoServeRequest("other", long_job, list(records.train), [], str(tmp_path / "o"))
    calls = CoServeCalls()  # what the worker starts its engine with
    engine_call(engine, EngineOp.COSERVE_START, busy, calls)
    with pytest.raises(CoServeRefused, match="already co-serves"):
        engine_call(engine, EngineOp.COSERVE_START, busy, calls)

    bus = Bus(redis_server.url, f"refuse{time.time_ns()}")
    call = lambda op, arg: engine_call(engine, op, arg, calls)  # noqa: E731 - the engine runs in this process
    cfg = AgentConfig("w-in", "p", str(model), engine_call=lambda: call)
    agent = Agent(cfg, bus)
    assert agent.load()
    assert agent.run_assignment(assignment(model, dataset, tmp_path, "ns/refused", 4)) == "succeeded"
    events = [e for _, e in bus.events("ns/refused")]
    started = next(e for e in events if e.type == "started")
    assert started.coserved is False and "already co-serves a job" in (started.message or "")
    assert events[-1].type == "succeeded" and events[-1].iterations == 4
    assert calls.task is not None and calls.task.req.job == "other"  # left alone
    bus.close()
