"""`elastune bench ssjf`'s replay on the real engine: forced output lengths, JCTs, the order it ran."""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from elastune_bench.serving import ssjf as bench  # noqa: E402
from elastune_demo import build as B  # noqa: E402


@pytest.mark.parametrize("order", ["fcfs", "sjf_predicted", "sjf_oracle"])
def test_replay_forces_lengths_and_orders_the_queue(order: str):
    torch.set_num_threads(1)
    model = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    args = bench.parser().parse_args(["--max-num-seqs", "1", "--kv-tokens", "4096"])
    assert isinstance(args, argparse.Namespace)
    engine = bench.make_engine(model, "none", "fcfs" if order == "fcfs" else "sjf", args, None)
    # all arrive together; the predictor gets long and mid the wrong way round
    reqs = [
        bench.BenchRequest("long", [5, 6, 7], 12, predicted=2, at=0.0),
        bench.BenchRequest("mid", [8, 9], 6, predicted=3, at=0.0),
        bench.BenchRequest("short", [10, 11, 12, 13], 2, predicted=1, at=0.0),
    ]
    finished: list[str] = []
    step = engine.step

    def recording_step() -> list:
        outs = step()
        finished.extend(o.request_id for o in outs if o.finished)
        return outs

    engine.step = recording_step
    res = bench.replay(engine, reqs, speedup=1.0, order=order)
    assert res["requests"] == 3 and res["output_tokens"] == 20
    assert (
        finished
        == {
            "fcfs": ["long", "mid", "short"],
            "sjf_predicted": ["short", "long", "mid"],
            "sjf_oracle": ["short", "mid", "long"],
        }[order]
    )
    assert 0 < res["jct_s_p50"] <= res["jct_s_p99"] and res["jct_s_mean"] > 0
