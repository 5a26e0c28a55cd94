"""FlexLLM's hybrid token scheduler, pure: exact finetuning shares per iteration under a latency target,
forward windows then backward layer by layer, the online latency fit, and inference never cut."""

from __future__ import annotations

import pytest

from elastune_worker.coserve.planner import (
    CoServeConfig,
    CoServePlanner,
    FinetuneState,
    IterationPlan,
    LatencyModel,
)


def planner(slo_ms: float = 10.0, **kw: float) -> CoServePlanner:
    # 1 ms base + 10 us per token: a 9 ms target (headroom 0.9) holds 800 tokens
    return CoServePlanner(CoServeConfig(tpot_slo_s=slo_ms / 1000, **kw), LatencyModel(0.001, 1e-5))  # type: ignore[arg-type]


def test_forward_windows_fill_the_leftover_of_the_target_and_never_cut_inference():
    p = planner(max_window=512)
    job = FinetuneState(sequence_tokens=1000, num_layers=4)
    assert p.spare_tokens(100) == 700
    first = p.plan(100, job)
    assert (first.finetune_forward_tokens, first.finetune_backward_layers) == (512, ())  # window cap
    assert first.predicted_s <= first.target_s
    p.advance(job, first)
    second = p.plan(500, job)
    assert second.finetune_forward_tokens == 300  # 800 - 500
    p.advance(job, second)
    busy = p.plan(900, job)  # inference alone is over the target: finetuning waits, inference runs
    assert busy.finetune_forward_tokens == 0 and busy.inference_tokens == 900
    third = p.plan(0, job)
    assert third.finetune_forward_tokens == 188  # the rest of the sequence
    p.advance(job, third)
    assert not job.in_forward and not job.done


def test_backward_runs_whole_layers_last_first_over_the_following_iterations():
    p = planner(backward_factor=2.0)
    job = FinetuneState(sequence_tokens=400, num_layers=4, forward_done=400)
    # one layer's backward = 2 x 400 / 4 = 200 token-equivalents
    plans = []
    for inference in (500, 700, 0, 350):
        plan = p.plan(inference, job)
        p.advance(job, plan)
        plans.append(plan.finetune_backward_layers)
    assert plans == [(3,), (), (2, 1, 0), ()]
    assert job.done


def test_a_layer_too_big_for_any_target_still_progresses_in_idle_iterations():
    p = planner(slo_ms=2.0)  # target 1.8 ms: 80 tokens; one layer costs 2 x 1000 / 2 = 1000
    job = FinetuneState(sequence_tokens=1000, num_layers=2, forward_done=1000)
    assert p.plan(10, job).finetune_backward_layers == ()
    idle = p.plan(0, job)
    assert idle.finetune_backward_layers == (1,)


def test_the_latency_model_is_refitted_online():
    m = LatencyModel(base=0.0, per_token=1e-3)
    for tokens in (100, 200, 300, 400):
        m.observe(tokens, 0.002 + 2e-5 * tokens)
    assert m.per_token == pytest.approx(2e-5) and m.base == pytest.approx(0.002)
    assert m.max_tokens_within(0.004) == 100
    assert m.max_tokens_within(0.001) == 0
    with pytest.raises(ValueError):
        LatencyModel(base=0.0, per_token=0.0)
    with pytest.raises(ValueError):
        CoServeConfig(tpot_slo_s=0.01, headroom=1.5)


def test_plans_report_their_finetuning_cost_in_token_equivalents():
    p = planner(backward_factor=2.0)
    forward = p.plan(100, FinetuneState(sequence_tokens=50, num_layers=4))
    assert (forward.finetune_forward_tokens, forward.finetune_cost_tokens) == (50, 50)
    backward = p.plan(0, FinetuneState(sequence_tokens=400, num_layers=4, forward_done=400))
    assert backward.finetune_backward_layers == (3, 2, 1, 0) and backward.finetune_cost_tokens == 800
    assert p.plan(100, None).finetune_cost_tokens == 0


def test_coservable_refuses_another_model_with_a_reason():
    from elastune_contract.api import TuningJobSpec
    from elastune_contract.coserve import coservable

    def spec(method: str) -> TuningJobSpec:
        return TuningJobSpec.model_validate(
            {"model": "tiny-llama", "dataset": "/d.jsonl", "method": method,
             "termination": {"maxIterations": 5}, "deadline": "10m"}
        )  # fmt: skip

    for method in ("promptTuning", "prefixTuning", "pTuning"):
        assert coservable(spec(method), "tiny-llama") is None
    reason = coservable(spec("promptTuning"), "tiny-gpt2")
    assert reason is not None and "'tiny-llama'" in reason and "'tiny-gpt2'" in reason


def test_separate_finetuning_lines_predict_and_learn_the_share_apart_from_inference():
    # inference: 1 ms + 10 us/token; finetuning forward: 2 ms per call + 20 us/token; backward 0 + 40 us
    p = CoServePlanner(
        CoServeConfig(tpot_slo_s=0.010),
        LatencyModel(0.001, 1e-5),
        forward=LatencyModel(0.002, 2e-5),
        backward=LatencyModel(0.0, 4e-5),
    )
    assert p.spare_tokens(100) == 250  # (9 ms - 2 ms inference - 2 ms per call) / 20 us
    plan = p.plan(100, FinetuneState(sequence_tokens=1000, num_layers=4))
    assert plan.finetune_forward_tokens == 250 and plan.predicted_s == pytest.approx(0.009)
    # a layer = 2 x 100 / 4 = 50 token equivalents = 2 ms backward; 7 ms are left: 3 layers
    back = p.plan(100, FinetuneState(sequence_tokens=100, num_layers=4, forward_done=100))
    assert back.finetune_backward_layers == (3, 2, 1) and back.finetune_cost_tokens == 150
    for tokens in (100, 300):  # the forward line learns from the share's own seconds only
        p.observe(
            IterationPlan(0.009, 50, finetune_forward_tokens=tokens), tokens, 0.0015, 0.004 + tokens * 1e-5
        )
    assert (p.forward.base, p.forward.per_token) == pytest.approx((0.004, 1e-5))  # type: ignore[union-attr]
    assert p.model.base == pytest.approx(0.001) and len(p.backward.samples) == 0  # type: ignore[union-attr]


def test_an_idle_iteration_always_advances_the_forward():
    p = planner(slo_ms=1.0)  # target 0.9 ms is below the 1 ms base: no spare at all
    job = FinetuneState(sequence_tokens=50, num_layers=2)
    assert p.plan(10, job).finetune_forward_tokens == 0
    assert p.plan(0, job).finetune_forward_tokens == 1


def test_no_share_is_planned_cheaper_than_the_cheapest_one_seen():
    """A share with a large fixed cost over a narrow range of window sizes (an eager second model on a
    GPU): least squares gives a slope through the origin (4.4 ms a token, intercept clamped at 0), but
    every share took at least 11 ms. A busy iteration with 8 ms of slack gets no finetuning; an idle
    one still advances (H200, 8B: one-token windows planned into the slack took several times the SLO)."""
    forward = LatencyModel(0.002, 1e-5)
    for tokens, seconds in ((8, 0.030), (4, 0.012), (8, 0.028), (4, 0.011)):
        forward.observe(tokens, seconds)
    assert forward.base == 0.0 and forward.per_token == pytest.approx(0.004375)
    assert forward.floor == pytest.approx(0.011) and forward.predict(1) == pytest.approx(0.011)
    assert forward.max_tokens_within(0.008) == 0 and forward.max_tokens_within(0.012) == 2
    inference, backward = LatencyModel(0.001, 1e-9), LatencyModel(0.0, 4e-5)
    p = CoServePlanner(CoServeConfig(tpot_slo_s=0.010), inference, forward=forward, backward=backward)
    job = FinetuneState(sequence_tokens=64, num_layers=4)
    assert p.plan(10, job).finetune_forward_tokens == 0  # 9 ms target - 1 ms inference: 8 ms of slack
    assert p.plan(0, job).finetune_forward_tokens >= 1
