"""The routing simulator: its endpoints (the engine's scheduler and block manager: chunked prefill,
prefix hits, preemption, adapter slots), conservation (every request finishes exactly once, no faster
than its service time, every block given back), the
workload loaders and the CLI — and one behaviour check: on a prefix-sharing workload at 8 endpoints
Preble's E2 beats round-robin on mean latency (fixed seed; not a timing assertion)."""

import json
from collections import Counter

import pytest

from elastune_bench.sim.routing.__main__ import main
from elastune_bench.sim.routing.engine import EngineSpec
from elastune_bench.sim.routing.experiments import Experiment, run_experiment
from elastune_bench.sim.routing.metrics import percentile, summarize
from elastune_bench.sim.routing.simulator import Simulator
from elastune_bench.sim.routing.workloads import (
    LoraWorkload,
    MultiTurnWorkload,
    PrefixWorkload,
    SimRequest,
    adapter_ranks,
    azure_trace,
    load_sharegpt,
    lora_workload,
    multiturn_workload,
    poisson_arrivals,
    prefix_workload,
)
from elastune_gateway.routing.cost import CostModel
from elastune_gateway.routing.factory import make_router
from elastune_gateway.routing.policy import ROUTING_POLICY_NAMES

PLAIN = CostModel(iteration_base=0.01, decode_per_seq=0.0, decode_per_kv_token=0.0, prefill_per_token=0.001)
"""An iteration costs 10 ms plus 1 ms per prefill token; decodes add nothing beyond the 10 ms."""


def req(rid, n_tokens, out, at=0.0, first=1, **fields):
    return SimRequest(rid, at, (tuple(range(first, first + n_tokens)),), out, **fields)


# -- the engine --------------------------------------------------------------------------------------------
def sim(n=1, policy="roundRobin", check=True, ranks=None, **spec):
    spec.setdefault("cost", PLAIN)
    return Simulator(make_router(policy), [EngineSpec(**spec)] * n, ranks, check=check)


def test_chunked_prefill_in_512_token_chunks_then_decode():
    r = req("a", 1200, 3)
    sim().run([r])
    # 512 + 512 + 176 prompt tokens in three iterations, then two decode iterations.
    assert r.first_token == pytest.approx(2 * (0.01 + 0.512) + 0.01 + 0.176)
    assert r.finished == pytest.approx(r.first_token + 2 * 0.01)
    assert r.tpot == pytest.approx(0.01)
    assert r.latency >= r.service_floor and r.service_floor == pytest.approx(r.latency)


def test_a_repeated_prompt_hits_the_prefix_cache():
    a, b = req("a", 100, 2), req("b", 100, 2, at=5.0)
    sim().run([a, b])
    assert (a.cached_tokens, b.cached_tokens) == (0, 96)  # six full 16-token blocks
    assert b.ttft < a.ttft


def test_kv_pressure_preempts_by_recompute_as_the_engine_does():
    # 16 blocks of 16 tokens: four 60-token prompts fill them (4 blocks each); their decodes need more.
    reqs = [req(f"r{i}", 60, 40, first=1000 * i + 1) for i in range(4)]
    s = sim(kv_cache_tokens=256)
    s.run(reqs)
    e = s.endpoints[0]
    assert e.scheduler.num_preemptions > 0
    assert all(r.finished is not None and r.latency >= r.service_floor - 1e-9 for r in reqs)
    assert e.scheduler.blocks.usage() == 0


@pytest.mark.parametrize("queue", ["fcfs", "priority"])
def test_the_priority_queue_admits_a_cached_prompt_before_an_earlier_uncached_one(queue):
    warm = req("warm", 160, 1)  # leaves its 10 prompt blocks cached
    busy = req("busy", 100, 20, at=10.0, first=5000)  # runs alone (max_running 1) while the two queue
    cold = req("cold", 176, 1, at=10.001, first=9000)
    hit = SimRequest("hit", 10.002, (tuple(range(1, 161)), tuple(range(7000, 7016))), 1)
    sim(queue=queue, max_running=1).run([warm, busy, cold, hit])
    assert hit.cached_tokens == 160 and cold.cached_tokens == 0
    if queue == "priority":  # Preble's groups: 160/176 cached goes first
        assert hit.admitted < cold.admitted
    else:
        assert cold.admitted < hit.admitted


def test_adapter_slots_and_load_times():
    cost = CostModel(
        iteration_base=0.01, decode_per_seq=0.0, decode_per_kv_token=0.0, prefill_per_token=0.001
    )
    a = req("a", 10, 5, adapter="x", rank=8)
    b = req("b", 10, 5, first=50, adapter="y", rank=8)
    s = sim(max_adapters=1, cost=cost, ranks={"x": 8, "y": 8})
    s.run([a, b])
    load = cost.adapter_load_seconds(8, "storage")
    assert a.admitted == pytest.approx(load)  # waits for its adapter, loaded from storage
    assert b.admitted >= a.finished  # the one slot is x's while a runs
    assert s.endpoints[0].adapter_loads == 2


def conservation_requests():
    prefix = prefix_workload(
        PrefixWorkload(requests=120, documents=6, document_tokens=(100, 400), seed=1),
        poisson_arrivals(120, 30.0, seed=2),
    )
    lora = lora_workload(
        LoraWorkload(requests=80, adapters=12, prompt_tokens=(8, 200), output_tokens=(1, 40), seed=3),
        poisson_arrivals(80, 30.0, seed=4),
    )
    pairs = [(30, 20), (50, 10), (5, 40)]
    turns = multiturn_workload(
        MultiTurnWorkload(conversations=10, think_time=0.5, seed=5), pairs, poisson_arrivals(10, 5.0, seed=6)
    )
    return prefix + lora + turns


@pytest.mark.parametrize("policy", ROUTING_POLICY_NAMES)
def test_conservation_every_request_finishes_once_no_faster_than_its_service_time(policy):
    requests = conservation_requests()
    router = make_router(policy)
    finished = Counter()
    on_finished = router.on_finished

    def count(request, endpoint, output_tokens, now, output_token_ids=()):
        finished[request.id] += 1
        on_finished(request, endpoint, output_tokens, now, output_token_ids)

    router.on_finished = count  # type: ignore[method-assign]
    spec = EngineSpec(cost=PLAIN, kv_cache_tokens=4096, max_adapters=2, max_batched_tokens=512)
    s = Simulator(router, [spec] * 4, adapter_ranks(requests), check=True)
    result = s.run(requests)
    assert len(result.requests) == len({r.id for r in result.requests}) > len(requests)  # later turns
    assert set(finished.values()) == {1} and len(finished) == len(result.requests)
    for r in result.requests:
        assert r.arrival <= r.admitted <= r.first_token <= r.finished
        assert r.latency >= r.service_floor - 1e-9
        assert 0 <= r.cached_tokens < r.prompt_len
    for e in s.endpoints:
        assert not e.running and not e.num_waiting
        assert e.scheduler.blocks.usage() == 0 and not e.scheduler.requests  # every block given back
    assert result.summary.requests == len(result.requests)
    assert result.summary.slo_attainment is not None


def test_multi_turn_prompts_grow_by_the_previous_answer_and_arrive_after_a_think_time():
    [first] = multiturn_workload(MultiTurnWorkload(conversations=1, min_turns=2, seed=2), [(30, 20)], [1.0])
    turns = [first]
    while turns[-1].next_turn is not None:
        turns.append(turns[-1].next_turn)
    assert len(turns) >= 2
    t0, t1 = turns[0], turns[1]
    assert t1.tokens[: t0.prompt_len + t0.output_tokens] == t0.tokens + t0.output_ids
    sim(policy="preble").run([first])
    assert t1.arrival == pytest.approx(t0.finished + t0.think_time)
    assert t1.cached_tokens >= 48  # the previous turn's prompt and answer were cached


# -- the behaviour check ----------------------------------------------------------------------------------
def test_preble_beats_round_robin_on_a_prefix_sharing_workload_at_8_endpoints():
    exp = Experiment(workload="prefix", endpoints=8, requests=1500, rate=24.0, seed=0)
    rr = run_experiment(exp, "roundRobin").summary
    e2 = run_experiment(exp, "preble").summary
    assert e2.cache_hit > rr.cache_hit + 0.2
    assert e2.mean_latency < rr.mean_latency


# -- workloads, metrics, CLI ------------------------------------------------------------------------------
def test_azure_trace_and_sharegpt_loaders(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.2224670,879,55\n"
    )
    rows = azure_trace(trace)
    assert [r.context_tokens for r in rows] == [374, 396, 879]
    assert rows[0].arrival == 0.0 and rows[1].arrival == pytest.approx(4.314579)
    assert azure_trace(trace, limit=2, time_scale=0.5)[1].arrival == pytest.approx(4.314579 / 2)
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps({"entries": [{"prompt_length": 12, "response_length": 30, "prompt": "hi"}]}))
    assert load_sharegpt(data) == [(12, 30)]


def test_workload_generators_are_seeded():
    times = poisson_arrivals(50, 10.0, seed=1)
    assert times == poisson_arrivals(50, 10.0, seed=1) and times == sorted(times)
    a = prefix_workload(PrefixWorkload(requests=50, seed=4), times)
    b = prefix_workload(PrefixWorkload(requests=50, seed=4), times)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert len({r.parts[1] for r in a}) > 1 and len({r.parts[0] for r in a}) == 1  # one system prompt
    lw = lora_workload(LoraWorkload(requests=200, adapters=20, seed=1), poisson_arrivals(200, 10.0))
    assert {r.rank for r in lw} == {8, 16, 32, 64}
    top = Counter(r.adapter for r in lw).most_common(1)[0][1]
    assert top > 200 / 20 * 2  # skewed popularity


def test_percentile():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 99) == 99.0


def test_cli_prints_a_table(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{10 + i // 10:02d}.{i % 10}000000,{100 + i},{5 + i % 7}" for i in range(60)]
    trace.write_text("\n".join(lines) + "\n")
    out_json = tmp_path / "out.json"
    args = ["--workload", "prefix", "--endpoints", "2", "--requests", "60", "--policy", "roundRobin,preble"]
    assert main([*args, "--arrivals", "azure", "--trace", str(trace), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "roundRobin" in out and "preble" in out and "mean s" in out
    assert [row["policy"] for row in json.loads(out_json.read_text())["rows"]] == ["roundRobin", "preble"]
    assert main(["--workload", "lora", "--endpoints", "3", "--requests", "40", "--adapters", "10"]) == 0
    assert "rankAware" in capsys.readouterr().out
    share = tmp_path / "s.json"
    share.write_text(json.dumps({"entries": [{"prompt_length": 20, "response_length": 10}] * 5}))
    assert (
        main(["--workload", "multiturn", "--requests", "4", "--sharegpt", str(share), "--policy", "preble"])
        == 0
    )


def test_statistics_leave_out_the_warm_up_fraction():
    rs = [req(f"r{i}", 10, 2, at=float(i)) for i in range(4)]
    for i, r in enumerate(rs):
        r.admitted, r.first_token, r.finished = r.arrival, r.arrival + 1, r.arrival + (10 if i == 0 else 2)
    assert summarize("p", 1, rs).mean_latency == pytest.approx((10 + 2 + 2 + 2) / 4)
    assert summarize("p", 1, rs, warmup=0.25).mean_latency == pytest.approx(2.0)
    assert summarize("p", 1, rs, warmup=0.25).requests == 3
