"""The gateway bounds its input before any routing work (issue 25 item 5, issue 24 item 5): a real
gateway process over a real Redis registry with no worker behind it, driven with the real ``openai``
client. Every answer here comes from the gateway itself (with no worker, anything it forwarded would be a
404 for the unknown model or a 503), in OpenAI's error shape: an oversized body 413, an over-long prompt,
a long stop string, too many stop_token_ids and out-of-range numbers 400 naming the field."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from elastune_bench.processes import ServiceProcess, start_gateway  # noqa: E402
from elastune_contract.openai_api.limits import (  # noqa: E402
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_STOP_CHARS,
    DEFAULT_MAX_STOP_TOKEN_IDS,
)

MAX_PROMPT_CHARS = 5000  # set by flag: the limits are settings
MODEL = "no-such-model"


@pytest.fixture(scope="module")
def gateway(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    g = start_gateway(
        redis_server.url, f"gwlim{time.time_ns()}", tmp_path_factory.mktemp("gateway"),
        "--max-prompt-chars", str(MAX_PROMPT_CHARS),
    )  # fmt: skip
    try:
        yield g
        assert g.alive(), g.log_tail()
    finally:
        g.stop()


@pytest.fixture(scope="module")
def client(gateway: ServiceProcess) -> Any:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _error(exc: Any, status: int, param: str | None) -> dict[str, Any]:
    assert exc.status_code == status, exc
    err = exc.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert err["param"] == param or (param and str(err["param"]).startswith(param + ".")), err
    return err


def test_an_unknown_model_is_still_a_404(client: Any) -> None:
    """The baseline: a request within every limit reaches the model lookup."""
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    _error(info.value, 404, "model")


def test_an_oversized_body_is_a_413(gateway: ServiceProcess, client: Any) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (DEFAULT_MAX_REQUEST_BYTES + 1), max_tokens=1)
    err = _error(info.value, 413, None)
    assert err["type"] == "RequestTooLargeError" and str(DEFAULT_MAX_REQUEST_BYTES) in err["message"]
    body = json.dumps({"model": MODEL, "prompt": "x" * (DEFAULT_MAX_REQUEST_BYTES + 1)}).encode()
    chunked = (body[i : i + 65536] for i in range(0, len(body), 65536))  # no Content-Length
    r = httpx.post(
        gateway.url + "/v1/completions", content=chunked, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text[:300]


def test_an_over_long_prompt_is_a_400(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="p" * (MAX_PROMPT_CHARS + 1), max_tokens=1)
    assert str(MAX_PROMPT_CHARS) in _error(info.value, 400, "prompt")["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "s" * (MAX_PROMPT_CHARS // 2)},
                {"role": "user", "content": "u" * (MAX_PROMPT_CHARS // 2 + 1)},
            ],
        )
    _error(info.value, 400, "messages")


def test_stop_strings_and_stop_token_ids_are_bounded(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", stop=["y" * (DEFAULT_MAX_STOP_CHARS + 1)])
    _error(info.value, 400, "stop")
    with pytest.raises(openai.BadRequestError) as info:
        ids = list(range(DEFAULT_MAX_STOP_TOKEN_IDS + 1))
        client.completions.create(model=MODEL, prompt="hi", extra_body={"stop_token_ids": ids})
    _error(info.value, 400, "stop_token_ids")


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", 2**64), ("temperature", 3.0), ("top_k", 2**31), ("n", 1000), ("logit_bias", {"x": 1})],
)
def test_numbers_out_of_range_are_a_400_naming_the_field(client: Any, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", extra_body={field: value})
    _error(info.value, 400, field)
