"""The gateway bounds its input before any routing work (issue 25 item 5, issue 24 item 5): a real
gateway process over a real Redis registry with no worker behind it, driven with the real ``openai``
client. Every answer here comes from the gateway itself (with no worker, anything it forwarded would be a
404 for the unknown model or a 503), in OpenAI's error shape: an oversized body 413, an over-long prompt,
a long stop string, too many stop_token_ids and out-of-range numbers 400 naming the field."""

from __future__ import annotations

import contextlib
import json
import socket
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
HEAD_TIMEOUT_S = 1.0  # --request-head-timeout and --request-body-timeout (defaults 10 s and 30 s)
MODEL = "no-such-model"


@pytest.fixture(scope="module")
def gateway(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    g = start_gateway(
        redis_server.url, f"gwlim{time.time_ns()}", tmp_path_factory.mktemp("gateway"),
        "--max-prompt-chars", str(MAX_PROMPT_CHARS),
        "--request-head-timeout", str(HEAD_TIMEOUT_S), "--request-body-timeout", str(HEAD_TIMEOUT_S),
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


# -- before authentication (issue 39 item 6): what a client holds with a head or body it never finishes --


def _connect(gateway: ServiceProcess) -> socket.socket:
    host, port = gateway.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _answer_then_eof(sock: socket.socket, within: float) -> bytes:
    """What the gateway sends until it closes the connection; fails if it keeps it open past ``within``."""
    sock.settimeout(within)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {within} s; got {got[:80]!r}")
    return got


def test_a_huge_request_head_is_a_431_before_authentication(gateway: ServiceProcess) -> None:
    with _connect(gateway) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nx-pad: ")
        with contextlib.suppress(ConnectionError):  # the gateway may hang up before it has it all
            for _ in range(1024):  # 1 MB of one header
                sock.sendall(b"a" * 1024)
            sock.sendall(b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        answer = _answer_then_eof(sock, 5)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def test_slowloris_connections_are_cut_at_the_head_timeout_and_others_are_served(
    gateway: ServiceProcess,
) -> None:
    """40 clients that send a request line and then a header byte every 0.2 s (never finishing), and a
    client that connects and sends nothing: each gets 408 and its connection closed at the head
    timeout, while a normal client is served all along."""
    socks = [_connect(gateway) for _ in range(41)]
    try:
        for sock in socks[1:]:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nx-slow: ")
            sock.setblocking(False)
        socks[0].setblocking(False)
        start, open_ = time.monotonic(), set(range(len(socks)))
        answers = {i: b"" for i in open_}
        while open_ and time.monotonic() - start < HEAD_TIMEOUT_S + 4:
            assert httpx.get(gateway.url + "/healthz", timeout=2).status_code == 200
            for i in list(open_):
                with contextlib.suppress(BlockingIOError, ConnectionError):
                    if i:
                        socks[i].send(b"a")
                try:
                    chunk = socks[i].recv(4096)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    chunk = b""
                answers[i] += chunk
                if not chunk:
                    open_.discard(i)
            time.sleep(0.2)
        elapsed = time.monotonic() - start
    finally:
        for sock in socks:
            sock.close()
    assert not open_, f"{len(open_)} slow connections still open after {elapsed:.1f} s"
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers.values()), set(answers.values())


def test_a_body_never_finished_is_cut_at_the_body_timeout(gateway: ServiceProcess) -> None:
    with _connect(gateway) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model":'
        )
        start = time.monotonic()
        _answer_then_eof(sock, HEAD_TIMEOUT_S + 4)
    assert time.monotonic() - start >= HEAD_TIMEOUT_S * 0.9
