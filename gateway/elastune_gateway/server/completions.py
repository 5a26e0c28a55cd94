"""POST /v1/completions and /v1/chat/completions as raw ASGI, ahead of FastAPI.

Why: profiled under `elastune bench gateway` (py-spy), FastAPI/Starlette's layers were the largest part
of the gateway's CPU per request left after the upstream client: about ten nested middleware and routing
calls per request, a dependency solver, an exit stack, and for a stream Starlette's StreamingResponse
(an anyio task group with a disconnect listener per stream, and every chunk through four ``send``
wrappers). Here a request costs one pass over its headers, one pydantic validation of its body (the
bounds of protocol.py and limits.py, as before), and each streamed chunk one ``send``. FastAPI still
serves everything else (models, health, metrics, the OpenAPI document, which describes these routes).

Behaviour is the FastAPI routes' one: 413 for a body over the limit (the contract's BodySizeLimit for
bodies without a declared length), 401 / 403 / 429 with their headers, 400 naming the field, OpenAI-shaped
errors, a 500 logged with its traceback; answers and refusals counted per model and key; a client that
goes away mid-stream closes the worker's connection (so the worker drops the request).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

from pydantic import ValidationError

from elastune_contract.openai_api.errors import APIError, error_body
from elastune_contract.openai_api.limits import BodySizeLimit, RequestLimits
from elastune_contract.openai_api.protocol import ChatCompletionRequest, CompletionRequest, _Request

from .call import Answer, Call, Stream, Whole
from .service import PRIORITY_HEADER, SLO_HEADERS, Gateway

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("elastune.gateway")

_TTFT_HEADER = SLO_HEADERS["ttft"].encode()
_TPOT_HEADER = SLO_HEADERS["tpot"].encode()
_PRIORITY_IGNORED = (PRIORITY_HEADER.encode(), b"ignored")
_JSON = b"application/json"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class CompletionRoutes:
    """The ASGI handler of the two completion paths (``paths``); anything else is not its business."""

    def __init__(self, gateway: Gateway, limits: RequestLimits) -> None:
        self.gateway, self.limits = gateway, limits
        self.metrics = gateway.metrics
        self.paths: dict[str, type[_Request]] = {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
        }
        self._unbounded = BodySizeLimit(self._serve, max_bytes=limits.max_request_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await self._send_error(send, None, APIError(405, "Method Not Allowed"), {"allow": "POST"})
            return
        declared: int | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                break
        if declared is None or declared > self.limits.max_request_bytes:
            # A body without a declared length (read bounded) or too long (413): the contract's middleware,
            # its answer counted as ours are.
            await self._unbounded(scope, receive, self._counting(scope, send))
            return
        await self._serve(scope, receive, send)

    def _counting(self, scope: Scope, send: Send) -> Send:
        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 413:
                self._count(None, int(message["status"]))
            await send(message)

        return counted

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = Call(b"")
        authorization = content_type = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-type":
                content_type = value
            elif name == b"x-request-id":
                call.request_id = value.decode("latin-1")
            elif name == _TTFT_HEADER:
                call.slo_ttft_ms = value.decode("latin-1")
            elif name == _TPOT_HEADER:
                call.slo_tpot_ms = value.decode("latin-1")
        quota: dict[str, str] = {}
        try:
            call.raw = await _read_body(receive)
            g = self.gateway
            keys = g.keys
            if keys is not None:
                call.principal = keys.authenticate(authorization)
            body = self._parse(scope["path"], call.raw, content_type)
            if keys is not None and call.principal is not None and g.limiter is not None:
                keys.authorize(call.principal, body.model)
                admitted, call.reservation = await g.limiter.admit(
                    call.principal, reserved_tokens(body, len(call.raw), g.settings.default_max_tokens)
                )
                quota = admitted.headers
            answer: Answer = await (
                g.chat(body, call) if isinstance(body, ChatCompletionRequest)
                else g.completions(cast(CompletionRequest, body), call)
            )  # fmt: skip
        except APIError as exc:
            g.give_back(call)  # it ran nowhere: its reservation is returned
            await self._send_error(send, call, exc)
            return
        except Exception as exc:
            log.exception("unhandled error")
            await self._send_error(send, call, APIError(500, f"internal error: {type(exc).__name__}"))
            return
        headers = [(k.encode(), v.encode()) for k, v in quota.items()]
        if call.principal is None or call.principal.record.debug:
            # The worker's id names a pod of the pool's namespace (maybe another tenant's, lending its
            # GPUs): only without authentication (one tenant) or for a key whose Secret says debug.
            headers.append((b"x-elastune-endpoint", answer.endpoint.encode()))
        if call.priority_ignored:
            headers.append(_PRIORITY_IGNORED)
        if isinstance(answer, Whole):
            if answer.status == 404:
                answer = _not_found(answer, call.model or body.model)
            self._count(call, answer.status)
            headers += [(b"content-type", answer.content_type), (b"content-length", b"%d" % len(answer.body))]
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            await send({"type": "http.response.body", "body": answer.body})
        else:
            self._count(call, 200)
            await _stream(answer, _SSE_HEADERS + headers, receive, send)

    def _parse(self, path: str, raw: bytes, content_type: bytes | None) -> _Request:
        """The validated body, or a 400 naming what is wrong (FastAPI's checks, in OpenAI's shape)."""
        try:
            if not _is_json(content_type):
                raise APIError(400, "the body must be JSON (Content-Type: application/json)")
            if not raw:
                raise APIError(400, "the request has no body; send the parameters as a JSON object")
            body = self.paths[path].model_validate_json(raw)
            self.limits.check(body)  # sizes, before any routing work (the workers check them again)
        except ValidationError as exc:
            self.metrics.rejected_of("invalid").inc()
            raise _invalid(exc) from None
        except APIError:
            self.metrics.rejected_of("invalid").inc()
            raise
        return body

    def _count(self, call: Call | None, status: int) -> None:
        code = str(status)
        if call is not None and call.model:
            self.metrics.requests_of(call.namespace, call.model, code).inc()
        else:
            self.metrics.requests_of("", "-", code).inc()
        if call is not None and call.principal is not None:
            self.metrics.key_requests_of(call.principal.name, code).inc()

    async def _send_error(
        self, send: Send, call: Call | None, exc: APIError, extra: dict[str, str] | None = None
    ) -> None:
        self._count(call, exc.status)
        body = json.dumps(error_body(exc.status, exc.message, exc.param)).encode()
        headers = [(b"content-type", _JSON), (b"content-length", b"%d" % len(body))]
        headers += [(k.lower().encode(), v.encode()) for k, v in {**exc.headers, **(extra or {})}.items()]
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _not_found(answer: Whole, model: str) -> Whole:
    """A worker's 404 in the gateway's words: the worker's lists every model and adapter loaded on the
    pod, other namespaces' included. The gateway resolved the name, so the worker lacks it for now."""
    message = f"The model `{model}` is not available on the endpoint chosen right now; retry shortly"
    body = json.dumps(error_body(404, message, "model")).encode()
    return Whole(404, _JSON, body, answer.endpoint)


async def _read_body(receive: Receive) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    while message.get("more_body", False):
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
    return b"".join(parts)


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    mime = content_type.partition(b";")[0].strip().lower()
    return mime == _JSON or (mime.startswith(b"application/") and mime.endswith(b"+json"))


def _invalid(exc: ValidationError) -> APIError:
    """FastAPI's validation answer as the OpenAI-shaped 400 the error handlers give: the first few
    problems, the first one's field as ``param``."""
    errors = exc.errors(include_url=False)
    if not errors:
        return APIError(400, str(exc))
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    lines = [f"{_location(e['loc'])}: {e['msg']}" for e in errors[:5]]
    return APIError(400, "; ".join(lines), _location(first["loc"]))


def _location(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "body"


async def _stream(answer: Stream, headers: list[tuple[bytes, bytes]], receive: Receive, send: Send) -> None:
    """The chunks as they come, one ``send`` each. The client going away (its ``http.disconnect``) cancels
    this task wherever it waits, so the worker's connection is closed at once, not at the next chunk."""
    task = asyncio.current_task()
    assert task is not None
    streaming = True

    def gone(f: asyncio.Future[Message]) -> None:
        if streaming and not f.cancelled() and f.exception() is None:
            task.cancel()

    watcher = asyncio.ensure_future(receive())
    watcher.add_done_callback(gone)
    try:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk, last in answer.chunks:
            # The last chunk ends the answer in the same write (uvicorn writes each message at once).
            streaming = not last
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                break
        if streaming:
            streaming = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not (watcher.done() and not watcher.cancelled()):
            raise  # cancelled from outside (shutdown), not by the client leaving
        task.uncancel()
    finally:
        streaming = False
        watcher.cancel()
        await answer.chunks.aclose()
        answer.close()


def reserved_tokens(body: _Request, body_bytes: int, default_max: int) -> int:
    """What a request reserves against its key's tokens/min at admission: its prompt (estimated from the
    body's size, about 4 bytes a token: generous for the JSON around it) and the completion it may
    produce (its max_tokens, else the gateway's default), times its ``n`` choices."""
    limit = body.token_limit() if isinstance(body, ChatCompletionRequest) else body.max_tokens
    return body_bytes // 4 + (limit or default_max) * body.n
