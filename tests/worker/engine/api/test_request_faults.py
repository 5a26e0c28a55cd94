"""One request's fault stays its own, and inputs are bounded (issue 24 item 5, issue 25 item 5), against a
real worker process serving the tiny Llama over HTTP, with the real ``openai`` client:

- a seed past what torch takes is a 400 naming ``seed`` (it was a 500 that ended every other stream);
- a request that fails inside an engine step (the product's ``sampler-raise`` failpoint, armed with
  ``ELASTUNE_FAILPOINT``: sampling a request whose seed is ``FAILPOINT_SEED`` raises) fails alone while
  8 other streams complete;
- an adapter whose weights are not finite is refused at load;
- an oversized body 413, an over-long prompt, a long stop string, too many or out-of-vocabulary
  stop_token_ids 400, all in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from worker_process import served_worker  # noqa: E402

from elastune_contract.openai_api.limits import (  # noqa: E402
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_STOP_CHARS,
    DEFAULT_MAX_STOP_TOKEN_IDS,
)
from elastune_demo import adapters as A  # noqa: E402
from elastune_worker.engine.model_runner.sampler import FAILPOINT_SEED  # noqa: E402

MODEL = "tiny-llama"
PROMPT = "Read the record and return one value. book: Dune →"
CONTROL_TOKEN = "faults-control-token"


@pytest.fixture(scope="module")
def worker(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"ELASTUNE_FAILPOINT": "sampler-raise", "ELASTUNE_CONTROL_TOKEN": CONTROL_TOKEN}  # control: loads
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    with served_worker(
        redis_server.url, f"faults{time.time_ns()}", "w-faults", log_path, MODEL, ("--enable-lora",), env
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(worker: str) -> Any:
    return openai.OpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=60)


def _error(exc: Any, status: int, param: str | None) -> dict[str, Any]:
    """The OpenAI error shape of an APIStatusError: status, type, param (the field, or an entry of it:
    ``logit_bias.12``), a message."""
    assert exc.status_code == status, exc
    err = exc.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["message"], err
    assert err["param"] == param or (param and str(err["param"]).startswith(param + ".")), err
    return err


async def _streams(url: str, n: int, spoiler: Callable[[], Awaitable[Any]]) -> tuple[list[Any], Any]:
    """``n`` concurrent streams of 24 tokens each and, once they are under way, what ``spoiler`` sends."""
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    started = asyncio.Event()

    async def one(i: int) -> tuple[str, str | None]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=24, temperature=0.8, seed=i, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                started.set()
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await started.wait()
    spoiled = await spoiler()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await aclient.close()
    return results, spoiled


def test_a_seed_past_torchs_range_is_a_400_and_eight_streams_complete(worker: str, client: Any) -> None:
    """The case from issue 24: ``"seed": 18446744073709551616`` answered 500 and ended all 8 other
    streams with "engine step failed"."""

    async def bad_seed() -> Any:
        aclient = openai.AsyncOpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await aclient.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=8, seed=2**64, temperature=1.0
            )
        except Exception as exc:  # what the test looks at
            return exc
        finally:
            await aclient.close()

    results, spoiled = asyncio.run(_streams(worker, 8, bad_seed))
    assert isinstance(spoiled, openai.BadRequestError), spoiled
    err = _error(spoiled, 400, "seed")
    assert "18446744073709551615" in err["message"]
    for r in results:
        assert not isinstance(r, BaseException), r
        assert r[1] == "length" and r[0], r
    # the edges of torch's range are taken
    for seed in (2**64 - 1, -(2**63)):
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, seed=seed, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_k", 2**31),
        ("n", 129),
        ("max_tokens", 2**31),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("logprobs", 21),
        ("priority", 2**63),
        ("seed", -(2**63) - 1),
        ("logit_bias", {"12": 101}),
        ("logit_bias", {"-1": 1}),
        ("stop_token_ids", [-1]),
    ],
)
def test_every_numeric_field_is_bounded_with_a_400_naming_it(client: Any, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={field: value})
    err = _error(info.value, 400, field)
    assert field in err["message"]


def test_a_request_that_fails_inside_a_step_fails_alone(worker: str) -> None:
    """Sampling raises for one request (the failpoint): its stream ends with an error event, the 8
    streams batched with it in the same steps complete, and the worker serves on."""

    async def doomed() -> list[str]:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.8,
                "seed": FAILPOINT_SEED, "stream": True}  # fmt: skip
        events = []
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", worker + "/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    results, events = asyncio.run(_streams(worker, 8, doomed))
    for r in results:
        assert not isinstance(r, BaseException), r
        assert r[1] == "length" and r[0], r
    last = json.loads(events[-1])
    assert last["error"]["code"] == 500 and "failpoint sampler-raise" in last["error"]["message"], events
    # not streamed: the same failure is a 500 in OpenAI's shape; the worker still serves
    client = openai.OpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.8, seed=FAILPOINT_SEED
        )
    assert "sampling failed" in _error(info.value, 500, None)["message"]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.8, seed=1, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"


def test_an_adapter_with_weights_that_are_not_finite_is_refused_at_load(worker: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    good = A.ensure_tiny_adapter(8)
    http = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {CONTROL_TOKEN}"})
    ok = http.post(worker + "/v1/load_lora_adapter", json={"lora_name": "fine", "lora_path": str(good)})
    assert ok.status_code == 200, ok.text
    for poison in (float("nan"), float("inf")):
        bad = tmp_path / f"bad-{poison}"
        shutil.copytree(good, bad)
        tensors = load_file(str(bad / "adapter_model.safetensors"))
        key = sorted(k for k in tensors if "lora_B" in k)[0]
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = poison
        save_file(tensors, str(bad / "adapter_model.safetensors"))
        r = http.post(worker + "/v1/load_lora_adapter", json={"lora_name": "poisoned", "lora_path": str(bad)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "lora_path" and "not finite" in err["message"], err
    models = [m["id"] for m in http.get(worker + "/v1/models").json()["data"]]
    assert "poisoned" not in models and "fine" in models


def test_an_oversized_body_is_a_413(worker: str) -> None:
    body = {"model": MODEL, "prompt": "x" * (DEFAULT_MAX_REQUEST_BYTES + 1024), "max_tokens": 1}
    r = httpx.post(worker + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert (
        err["code"] == 413
        and err["type"] == "RequestTooLargeError"
        and str(DEFAULT_MAX_REQUEST_BYTES) in err["message"]
    )
    # chunked (no Content-Length): refused as well
    raw = json.dumps(body).encode()
    chunks = (raw[i : i + 65536] for i in range(0, len(raw), 65536))
    r = httpx.post(worker + "/v1/completions", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    # ... and with the real client
    client = openai.OpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (DEFAULT_MAX_REQUEST_BYTES + 1), max_tokens=1)
    _error(info.value, 413, None)


def test_an_over_long_prompt_is_a_400_before_tokenizing(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="ab " * (DEFAULT_MAX_PROMPT_CHARS // 3 + 1), max_tokens=1
        )
    assert "characters" in _error(info.value, 400, "prompt")["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "ab " * (DEFAULT_MAX_PROMPT_CHARS // 3 + 1)}]
        )
    _error(info.value, 400, "messages")
    # within the characters but over the context (tokens): 400 before any engine work
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="ab " * 20000, max_tokens=1)
    assert "context length" in _error(info.value, 400, "prompt")["message"]


def test_stop_strings_and_stop_token_ids_are_bounded(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, stop=["y" * (DEFAULT_MAX_STOP_CHARS + 1)]
        )
    _error(info.value, 400, "stop")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            stop="z" * (DEFAULT_MAX_STOP_CHARS + 1),
        )
    _error(info.value, 400, "stop")
    many = list(range(DEFAULT_MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"stop_token_ids": many}
        )
    _error(info.value, 400, "stop_token_ids")
    with pytest.raises(openai.BadRequestError) as info:  # outside the vocabulary
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"stop_token_ids": [10**9]}
        )
    _error(info.value, 400, "stop_token_ids")
    ok = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, stop=["y" * DEFAULT_MAX_STOP_CHARS],
        extra_body={"stop_token_ids": many[:-1]},
    )  # fmt: skip
    assert ok.choices[0].finish_reason in ("length", "stop")


def _raw(body: str) -> str:
    """A JSON body with a lone surrogate escaped in it (json.dumps would refuse to write one)."""
    return body.replace("MODEL", MODEL)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", _raw('{"model": "MODEL", "prompt": "a\\ud800b", "max_tokens": 1}')),
        ("/v1/completions", _raw('{"model": "MODEL", "prompt": ["ok", "\\udc00"], "max_tokens": 1}')),
        (
            "/v1/chat/completions",
            _raw('{"model": "MODEL", "messages": [{"role": "user", "content": "x\\ud800"}]}'),
        ),
        ("/v1/completions", _raw('{"model": "MODEL", "prompt": "ok", "stop": ["\\ud800"], "max_tokens": 1}')),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(worker: str, path: str, body: str) -> None:
    """Issue 38 item 4: JSON may escape a lone surrogate, which no tokenizer takes; it answered 500
    TypeError at the worker (the gateway already refused it). The worker still serves afterwards."""
    r = httpx.post(worker + path, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert "not valid Unicode" in r.json()["error"]["message"]
    ok = httpx.post(worker + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200, ok.text[:300]
