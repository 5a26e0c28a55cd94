"""The worker's OpenAI-compatible API with the real ``openai`` client, against a real worker process
serving the tiny Llama over HTTP: completions and chat, streaming and not, errors, a client that
disconnects mid-stream, concurrent requests."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from worker_process import served_worker  # noqa: E402

from elastune_common.bus import Bus  # noqa: E402

MODEL = "tiny-llama"
NAMESPACE: dict[str, str] = {}


@pytest.fixture(scope="module")
def worker(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ns = NAMESPACE["ns"] = f"api{time.time_ns()}"
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    with served_worker(redis_server.url, ns, "w-api", log_path, MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def scraped(worker: str, redis_server: Any) -> str:
    """The worker's /metrics: on its metrics port, as its registry record names it (not on ``worker``)."""
    bus = Bus(redis_server.url, NAMESPACE["ns"])
    try:
        return bus.workers()["w-api"].metrics_url
    finally:
        bus.close()


@pytest.fixture(scope="module")
def client(worker: str) -> Any:
    return openai.OpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric(url: str, name: str) -> float:
    text = httpx.get(url).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_streamed_and_not_agree_and_count_tokens(client):
    kw = {"model": MODEL, "prompt": "Read the record and return one value. book: Dune →", "max_tokens": 12}
    whole = client.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 5 and whole.choices[0].text
    chunks = list(
        client.completions.create(
            **kw,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_uses_the_chat_template_streamed_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 km →"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and whole.usage.prompt_tokens > 5
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == msg.content


def test_bad_input_gets_openai_shaped_4xx(client, worker, scraped):
    text = httpx.get(scraped).text
    before = {code: _errors(text, code) for code in ("400", "404")}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[5] * 2048, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=10**9)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2, n=2)
    r = httpx.post(
        worker + "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.post(worker + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    # The worker is still up and counted each error by its status (6 x 400, 1 x 404 above).
    text = httpx.get(scraped).text
    assert _errors(text, "400") - before["400"] == 6 and _errors(text, "404") - before["404"] == 1


def _errors(text: str, code: str) -> float:
    m = re.search(rf'^elastune_serving_errors_total\{{[^}}]*code="{code}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_client_that_disconnects_mid_stream_is_aborted_and_frees_its_blocks(client, worker, scraped):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", worker + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    deadline = time.time() + 20
    while time.time() < deadline:
        if (
            metric(scraped, "vllm:num_requests_running") == 0
            and metric(scraped, "vllm:kv_cache_usage_perc") == 0
        ):
            break
        time.sleep(0.2)
    else:
        pytest.fail("the abandoned request kept running")
    ok = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(worker, client, scraped):
    prompts = ["12 km →", "hello", "Count the words →", "book: Dune →"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts
    ]

    async def together() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0)
        calls = [
            aclient.completions.create(
                model=MODEL, prompt=p, max_tokens=8, temperature=0, extra_body={"priority": i}
            )
            for i, p in enumerate(prompts)
        ]
        rs = await asyncio.gather(*calls)
        await aclient.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(together()) == alone
    assert metric(scraped, "vllm:e2e_request_latency_seconds_count") >= 8
    assert metric(scraped, "elastune_prefix_cache_queried_tokens_total") > 0
    # the engine was busy in steps; none of it went to co-served finetuning (no job is co-served)
    assert metric(scraped, "elastune_engine_busy_seconds_total") > 0
    assert metric(scraped, "elastune_coserve_finetune_seconds_total") == 0


def test_openapi_document_names_the_routes(worker):
    doc = httpx.get(worker + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/readyz"} <= set(doc["paths"])


def test_the_worker_publishes_its_serving_state_and_cost_model(worker, redis_server):
    """What the gateway routes on: load, prefix-cache state and the profiled cost functions."""
    bus = Bus(redis_server.url, NAMESPACE["ns"])
    try:
        deadline = time.time() + 10
        while time.time() < deadline:
            rec = bus.workers()["w-api"]
            # a heartbeat may still carry a request of the previous tests as running: wait it out
            if (
                rec.serving is not None
                and rec.serving.prefix_cache_queried_tokens > 0
                and rec.serving.running == 0
            ):
                break
            time.sleep(0.3)
        serving = rec.serving
        assert serving is not None and serving.model == MODEL and serving.max_model_len == 2048
        assert serving.cost is not None and serving.cost.prefill_s_per_token > 0
        assert serving.cost.decode_step_base_s > 0 and serving.running == 0
    finally:
        bus.close()
