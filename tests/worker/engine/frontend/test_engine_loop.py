"""The engine's front-end boundary without a model: the typed messages pickle (the engine process sends
them over a pipe) and the one engine loop applies them to an engine and emits what happened, in order."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest

from elastune_worker.engine.core.adapter_ref import AdapterRef
from elastune_worker.engine.core.outputs import RequestOutput
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.frontend import messages as M
from elastune_worker.engine.frontend.engine_loop import EngineLoop, engine_call

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, stop=("\n",), stop_token_ids=(7,), seed=5)
ADA = AdapterRef("lora", "", "ada", 1)


@dataclass
class Stats:
    running: int = 0


def out(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [token], f"t{token}", finished, "length" if finished else None, 2, 1, 0)


@dataclass
class FakeEngine:
    """What the loop asks of an ``LLMEngine``; records what it was asked."""

    requests: dict[str, int] = field(default_factory=dict)
    log: list[Any] = field(default_factory=list)
    fail_step: bool = False

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)  # the loop fails these when a step fails

    def has_work(self) -> bool:
        return bool(self.requests)

    def add_request(self, rid: str, prompt: Any, params: SamplingParams, **kw: Any) -> None:
        if prompt == []:
            raise ValueError("the prompt is empty")
        if prompt == "boom":
            raise KeyError("a bug")
        self.log.append(("add", rid, params, kw))
        self.requests[rid] = 0

    def abort(self, rid: str) -> bool:
        self.log.append(("abort", rid))
        return self.requests.pop(rid, None) is not None

    def step(self) -> list[RequestOutput]:
        if self.fail_step:
            raise RuntimeError("kernel exploded")
        outs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            done = self.requests[rid] >= 2
            outs.append(out(rid, self.requests[rid], done))
            if done:
                del self.requests[rid]
        return outs

    def stats(self) -> Stats:
        return Stats(len(self.requests))

    def load_lora(self, name: str, path: str) -> str:
        return f"{name}@{path}"

    def unload_lora(self, name: str) -> None:
        raise KeyError(name)


def run(engine: FakeEngine, script: list[M.EngineInput]) -> list[M.EngineOutput]:
    """Runs the loop over ``script`` (then Shutdown): a pending message is there whenever one is left."""
    pending = [*script, M.Shutdown()]
    emitted: list[M.EngineOutput] = []

    def receive(block: bool) -> M.EngineInput | None:
        if not pending:
            raise AssertionError("the loop waited past its Shutdown")
        if not block and isinstance(pending[0], M.Shutdown) and engine.has_work():
            return None  # the work finishes before the loop is told to stop
        return pending.pop(0)

    EngineLoop(engine, receive, emitted.append).run()  # type: ignore[arg-type]
    return emitted


def test_every_message_pickles_and_names_its_kind():
    stats = Stats(3)
    inputs: list[Any] = [
        M.AddRequest("r1", [1, 2, 3], PARAMS, priority=2, extra_key="k", adapter=ADA),
        M.AddRequest("r2", "a text prompt", PARAMS),
        M.AbortRequest("r1"),
        M.EngineCall("c1", M.EngineOp.LOAD_LORA, ("ada", "/a")),
        M.Shutdown(),
    ]
    outputs: list[Any] = [
        M.StepOutputs([out("r1", 4), out("r2", 5, True)], stats),
        M.StatsUpdate(stats),
        M.RequestRefused("r1", "the prompt is empty"),
        M.RequestErrored("r2", "engine step failed"),
        M.CallReply("c1", None, KeyError("ada"), stats),
        M.EngineReady(64, 100, None, (0, 1), 2),  # type: ignore[arg-type]
        M.EngineStartFailed("no model"),
    ]
    for msg in inputs + outputs:
        back = pickle.loads(pickle.dumps(msg))
        assert type(back) is type(msg)
        if not isinstance(msg, M.CallReply):  # exceptions compare by identity
            assert back == msg
    assert pickle.loads(pickle.dumps(outputs[4])).error.args == ("ada",)
    # One message class per kind of request, and the kinds are exactly these.
    assert {m.type for m in (M.AddRequest, M.AbortRequest, M.EngineCall, M.Shutdown)} == set(
        M.EngineRequestType
    )
    with pytest.raises(AttributeError):  # frozen
        inputs[0].request_id = "other"


def test_the_loop_reports_idle_stats_then_steps_until_the_requests_finish():
    engine = FakeEngine()
    emitted = run(engine, [M.AddRequest("a", [1], PARAMS, priority=1, adapter=ADA, tenant="team-a/k")])
    assert engine.log == [
        ("add", "a", PARAMS, {"priority": 1, "extra_key": None, "adapter": ADA, "tenant": "team-a/k"})
    ]
    assert emitted == [
        M.StatsUpdate(Stats(0)),  # before any request: the placement reads it
        M.StepOutputs([out("a", 1)], Stats(1)),
        M.StepOutputs([out("a", 2, True)], Stats(0)),
        M.StatsUpdate(Stats(0)),  # idle again: the last finish shows in the metrics
    ]


def test_every_pending_message_is_applied_before_the_next_step():
    engine = FakeEngine()
    script: list[M.EngineInput] = [
        M.AddRequest("a", [1], PARAMS),
        M.AddRequest("b", [1], PARAMS),
        M.AbortRequest("a"),
    ]
    emitted = run(engine, script)
    steps = [m for m in emitted if isinstance(m, M.StepOutputs)]
    assert [o.request_id for s in steps for o in s.outputs] == ["b", "b"]  # a left before any step


def test_refusals_errors_and_calls_come_back_typed_and_the_engine_carries_on():
    engine = FakeEngine()
    script: list[M.EngineInput] = [
        M.AddRequest("empty", [], PARAMS),
        M.AddRequest("bug", "boom", PARAMS),
        M.EngineCall("c1", M.EngineOp.LOAD_LORA, ("ada", "/x")),
        M.EngineCall("c2", M.EngineOp.UNLOAD_LORA, "nope"),
        M.EngineCall("c3", M.EngineOp.COSERVE_POLL),
    ]
    emitted = [m for m in run(engine, script) if not isinstance(m, M.StatsUpdate)]  # (one after each)
    assert emitted[0] == M.RequestRefused("empty", "the prompt is empty")  # the caller's 400
    assert emitted[1] == M.RequestErrored("bug", "KeyError: 'a bug'")  # the engine's 500
    c1, c2, c3 = emitted[2:]
    assert isinstance(c1, M.CallReply) and (c1.call_id, c1.result, c1.error) == ("c1", "ada@/x", None)
    assert isinstance(c2, M.CallReply) and isinstance(c2.error, KeyError) and c2.result is None
    assert isinstance(c3, M.CallReply) and "takes no coserve_poll call" in str(c3.error)
    assert engine.requests == {}


def test_a_failed_step_fails_the_requests_in_flight_and_the_loop_goes_on():
    engine = FakeEngine(fail_step=True)
    script: list[M.EngineInput] = [M.AddRequest("a", [1], PARAMS), M.AddRequest("b", [1], PARAMS)]
    emitted = run(engine, script)
    failed = [m for m in emitted if isinstance(m, M.RequestErrored)]
    assert failed == [
        M.RequestErrored(r, "engine step failed: RuntimeError: kernel exploded") for r in ("a", "b")
    ]
    assert engine.requests == {} and emitted[-1] == M.StatsUpdate(Stats(0))


def test_engine_call_takes_only_typed_operations():
    engine = FakeEngine()
    assert engine_call(engine, M.EngineOp.LOAD_LORA, ("x", "/p")) == "x@/p"  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="takes no coserve_stop call"):
        engine_call(engine, M.EngineOp.COSERVE_STOP, None)  # type: ignore[arg-type]


def test_calls_beyond_adapters_go_to_the_handler_the_engine_was_started_with():
    """Co-serving plugs in as a call handler (the engine never imports it): the loop hands it the
    engine, the operation and its argument, between steps, and the reply carries its result."""
    from elastune_worker.coserve.calls import CoServeCalls

    seen: list[tuple[Any, M.EngineOp, Any]] = []

    def handler(engine: Any, op: M.EngineOp, arg: Any) -> str:
        seen.append((engine, op, arg))
        return "polled"

    engine = FakeEngine()
    emitted: list[M.EngineOutput] = []
    inbox: list[M.EngineInput] = [M.EngineCall("c1", M.EngineOp.COSERVE_POLL, 3), M.Shutdown()]
    EngineLoop(engine, lambda block: inbox.pop(0), emitted.append, handler).run()  # type: ignore[arg-type]
    assert seen == [(engine, M.EngineOp.COSERVE_POLL, 3)]
    assert [m for m in emitted if isinstance(m, M.CallReply)] == [M.CallReply("c1", "polled", None, Stats(0))]
    with pytest.raises(RuntimeError, match="no co-served job"):  # the worker's handler, before a start
        engine_call(engine, M.EngineOp.COSERVE_STOP, None, CoServeCalls())  # type: ignore[arg-type]
    assert pickle.loads(pickle.dumps(CoServeCalls())).task is None  # it travels to an engine process


@pytest.mark.parametrize("where", ["thread", "process"])
def test_both_engines_answer_the_same_across_their_boundary(where):
    """The thread and the process run the same loop: a refusal is the caller's ValueError, a call's
    exception comes back as itself, outputs stream until finished, the stats follow."""
    pytest.importorskip("torch")
    import asyncio

    from elastune_demo import build as B
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.frontend.async_engine import AsyncEngine
    from elastune_worker.engine.frontend.engine_process import ProcessEngine
    from elastune_worker.engine.llm_engine import LLMEngine

    path = B.ensure_tiny_model()
    config = EngineConfig(kv_cache_tokens=1024)
    eng = AsyncEngine(LLMEngine(path, config)) if where == "thread" else ProcessEngine(path, config)

    async def collect(rid: str, prompt: list[int], adapter: AdapterRef | None = None) -> list[RequestOutput]:
        return [o async for o in eng.generate(rid, prompt, PARAMS, adapter=adapter)]

    async def main() -> None:
        with pytest.raises(ValueError, match="the prompt is empty"):
            await collect("empty", [])
        with pytest.raises(ValueError, match="adapter 'nope' cannot serve"):
            await collect("no-adapter", [1, 2], AdapterRef("lora", "", "nope", 1))
        with pytest.raises(KeyError, match="nope"):
            await eng.call(M.EngineOp.UNLOAD_LORA, "nope")
        outs = await collect("ok", [1, 2, 3])
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == outs[-1].completion_tokens
        for _ in range(100):
            if eng.stats().steps > 0 and eng.stats().num_requests_running == 0:
                break
            await asyncio.sleep(0.02)
        assert eng.stats().steps > 0 and eng.stats().num_requests_running == 0

    try:
        asyncio.run(main())
    finally:
        eng.close()
