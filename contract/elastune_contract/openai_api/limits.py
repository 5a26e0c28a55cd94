"""Size limits on what a request may carry, checked by the worker's API and the gateway alike before
any real work: the body's size (413), the prompt's characters before it is tokenized, each stop
string's length and the number of stop token ids (400 naming the field).

The numeric fields' ranges live in the request models (protocol.py); these limits are settings
(``--max-request-bytes``, ``--max-prompt-chars``, ``--max-stop-chars``, ``--max-stop-token-ids`` on
the worker and the gateway), with defaults that no ordinary request comes near.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from .errors import APIError, error_body
from .protocol import ChatCompletionRequest, CompletionRequest, _Request

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""4 MiB: a 128K-token prompt is about 0.5 MB of text; JSON escapes can double it."""
DEFAULT_MAX_PROMPT_CHARS = 1024 * 1024
"""Characters of prompt text (a completion's prompt, or all messages' contents): checked before the
tokenizer runs, so an oversized prompt costs no tokenizing. The token count is then checked against the
model's context before any engine work."""
DEFAULT_MAX_STOP_CHARS = 256
"""Characters of one stop string (each is matched against every generated token's text)."""
DEFAULT_MAX_STOP_TOKEN_IDS = 64
DRAIN_FACTOR = 16
"""A refused body is read and dropped up to this many times the limit; past that the connection closes."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompt_chars", "max_stop_chars", "max_stop_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def check(self, body: _Request) -> None:
        """APIError(400, naming the field) for a request over a limit; cheap (no tokenizing)."""
        if isinstance(body, CompletionRequest):
            prompt = body.prompt
            texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
            chars, param = sum(len(t) for t in texts), "prompt"
        elif isinstance(body, ChatCompletionRequest):
            chars, param = sum(len(m.text()) for m in body.messages), "messages"
        else:
            chars, param = 0, "prompt"
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {chars} characters; at most {self.max_prompt_chars} are accepted here. "
                "Shorten the prompt.",
                param,
            )
        for stop in body.stop or ():
            if len(stop) > self.max_stop_chars:
                raise APIError(
                    400,
                    f"a stop string has {len(stop)} characters; each may have at most {self.max_stop_chars}",
                    "stop",
                )
        ids = body.stop_token_ids or ()
        if len(ids) > self.max_stop_token_ids:
            raise APIError(
                400,
                f"{len(ids)} stop_token_ids; at most {self.max_stop_token_ids} are accepted",
                "stop_token_ids",
            )


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 in OpenAI's error shape, before the
    application parses any of it. A declared Content-Length over the limit is refused without reading
    the body; a chunked body is read up to the limit and refused once it passes it."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                break
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(send, receive, declared)
                return
            await self.app(scope, receive, send)
            return
        # No length declared (chunked): read it here, bounded, then hand it on.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await self._refuse(send, receive, None)
                else:
                    await self._refuse(send, None, None)
                return
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed() -> Message:
            nxt = next(replay, None)
            return nxt if nxt is not None else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Send, receive: Receive | None, declared: int | None) -> None:
        """Answer 413. The rest of the body is read and dropped first (up to DRAIN_FACTOR times the
        limit), so that a client still sending it reads the answer instead of a reset connection."""
        drained = receive is None
        budget = self.max_bytes * DRAIN_FACTOR
        while not drained and budget > 0:
            message = await receive()  # type: ignore[misc]
            if message["type"] != "http.request":
                break
            budget -= len(message.get("body", b""))
            drained = not message.get("more_body", False)
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_bytes} bytes"
        message = f"the request body has {size}; at most {self.max_bytes} are accepted here"
        body = json.dumps(error_body(413, message)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *([] if drained else [(b"connection", b"close")]),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def add_limit_args(parser: Any, defaults: RequestLimits | None = None) -> None:
    """The limits' command-line flags (an argparse parser or group)."""
    d = defaults or RequestLimits()
    parser.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                        help="largest request body accepted (bigger: 413)")  # fmt: skip
    parser.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                        help="prompt characters accepted, checked before tokenizing (400)")  # fmt: skip
    parser.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                        help="characters of one stop string (400)")  # fmt: skip
    parser.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                        help="stop_token_ids one request may name (400)")  # fmt: skip


def limits_from(args: Any) -> RequestLimits:
    return RequestLimits(
        max_request_bytes=args.max_request_bytes,
        max_prompt_chars=args.max_prompt_chars,
        max_stop_chars=args.max_stop_chars,
        max_stop_token_ids=args.max_stop_token_ids,
    )
