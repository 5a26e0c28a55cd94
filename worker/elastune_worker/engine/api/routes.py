"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both with SSE streaming) and
/v1/models, in front of an ``EngineClient``.

Every request is checked before it reaches the engine: unknown model → 404; unsupported options,
prompts over the context, ``max_tokens`` past it, token ids outside the vocabulary → 400. A client that
disconnects (mid-stream or while waiting for a whole completion) aborts its request, which frees its
KV blocks at once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from elastune_contract.api_keys import TENANT_HEADER
from elastune_contract.openai_api.errors import APIError, sse_error
from elastune_contract.openai_api.limits import RequestLimits
from elastune_contract.openai_api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
    _Request,
)
from elastune_contract.protocol import NAMESPACE_HEADER
from elastune_worker.engine.api.admission import QueueBound, QueueTicket
from elastune_worker.engine.api.metrics import ServingMetrics
from elastune_worker.engine.client import EngineBusy, EngineClient
from elastune_worker.engine.core.adapter_ref import DEFAULT_NAMESPACE, AdapterRef, adapter_key
from elastune_worker.engine.core.outputs import RequestOutput
from elastune_worker.engine.core.sampling import SamplingParams

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": why}
    for code, why in (
        (400, "Invalid request: unsupported option, prompt or max_tokens over the context"),
        (404, "Unknown model"),
        (503, "The engine is not ready yet, or the worker's queue is full (Retry-After)"),
    )
}


def openai_router(
    get_engine: Callable[[], EngineClient | None],
    metrics: ServingMetrics | None,
    limits: RequestLimits | None = None,
    queue: QueueBound | None = None,
) -> APIRouter:
    """``queue``: the bound on requests not yet started (admission.py); None: unbounded."""
    router = APIRouter(prefix="/v1", tags=["openai"])
    bounds = limits or RequestLimits()
    created = int(time.time())

    def engine_for(model: str, request: Request) -> tuple[EngineClient, AdapterRef | None]:
        """The engine, and the adapter (LoRA or soft prompt) the gateway resolved this request to, looked
        up by its id (``served_adapter``): the worker has no name rules of its own. The reference travels
        with the request from here; the engine checks it once at admission."""
        engine = get_engine()
        if engine is None:
            raise EngineBusy("the model is still loading; retry shortly")
        key = served_adapter(model, request, engine.model_name)
        if key is None and model == engine.model_name:
            return engine, None
        adapter = lookup_adapter(engine, key) if key is not None else None
        if adapter is not None:
            return engine, adapter
        available = ", ".join([engine.model_name, *(a.name for a in engine.adapters())])
        raise APIError(404, f"The model `{model}` does not exist. Available: {available}", "model")

    @router.get("/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> dict[str, Any]:
        engine = get_engine()
        data = []
        if engine is not None:
            base = engine.model_name
            data.append(
                {"id": base, "object": "model", "created": created, "owned_by": "elastune", "root": base,
                 "parent": None, "max_model_len": engine.max_model_len}
            )  # fmt: skip
            for a in engine.adapters():
                data.append(
                    {"id": a.name, "object": "model", "created": created, "owned_by": "elastune",
                     "root": a.path, "parent": base, "max_model_len": engine.max_model_len}
                )  # fmt: skip
        return {"object": "list", "data": data}

    @router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        """vLLM's runtime adapter API: read and check a PEFT adapter; it is then served under
        ``lora_name`` (loaded to the device with its first request)."""
        engine = get_engine()
        if engine is None:
            raise EngineBusy("the model is still loading; retry shortly")
        if body.lora_name == engine.model_name:
            raise APIError(400, "lora_name must differ from the base model's name", "lora_name")
        try:
            await engine.load_lora(body.lora_name, body.lora_path)
        except ValueError as exc:
            if metrics is not None:
                metrics.adapter_loads.labels(metrics.model, "failed").inc()
            raise APIError(400, str(exc), "lora_path") from exc
        if metrics is not None:
            metrics.adapter_loads.labels(metrics.model, "ok").inc()
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        engine = get_engine()
        if engine is None:
            raise EngineBusy("the model is still loading; retry shortly")
        # The placement loads an adapter in its LoRAAdapter's namespace; vLLM's request names no namespace,
        # so ``lora_name`` is the served name when one namespace has it here, else ``namespace/name``.
        loaded = [a.ref for a in engine.adapters()]
        ref = next((r for r in loaded if r.key == body.lora_name), None)
        if ref is None:
            same = [r for r in loaded if r.name == body.lora_name]
            if len(same) > 1:
                keys = ", ".join(sorted(r.key for r in same))
                raise APIError(400, f"More than one namespace loaded '{body.lora_name}' here: name one of "
                               f"{keys}", "lora_name")  # fmt: skip
            ref = same[0] if same else None
        try:
            if ref is None:
                raise KeyError(body.lora_name)
            await engine.unload_lora(ref.name, ref.namespace)
        except KeyError as exc:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_name") from exc
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    @router.post("/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        engine, adapter = engine_for(body.model, request)
        _refuse_unsupported(body)
        bounds.check(body)  # before tokenizing
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            ids = engine.encode(prompt)
        else:
            ids = list(prompt)
            vocab = getattr(engine, "vocab_size", None)
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        params = _params(body, body.max_tokens, len(ids), engine.max_model_len, engine)
        run = _Run(engine, f"cmpl-{uuid.uuid4().hex}", ids, params, body.priority, metrics, adapter)
        run.tenant = _tenant(request)
        run.ticket = queue.admit(run) if queue is not None else None  # after every 400: 503 if full
        return await _answer(
            run, body, request, _completion_chunks, "text_completion",
            lambda text, reason: {"index": 0, "text": text, "finish_reason": reason, "logprobs": None},
        )  # fmt: skip

    @router.post("/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        engine, adapter = engine_for(body.model, request)
        _refuse_unsupported(body)
        bounds.check(body)  # before tokenizing
        try:
            ids = engine.chat_prompt([(m.role, m.text()) for m in body.messages])
        except ValueError as exc:  # e.g. a template that refuses this sequence of roles
            raise APIError(400, f"messages: {exc}", "messages") from exc
        params = _params(body, body.token_limit(), len(ids), engine.max_model_len, engine)
        run = _Run(engine, f"chatcmpl-{uuid.uuid4().hex}", ids, params, body.priority, metrics, adapter)
        run.tenant = _tenant(request)
        run.ticket = queue.admit(run) if queue is not None else None  # after every 400: 503 if full
        return await _answer(
            run, body, request, _chat_chunks, "chat.completion",
            lambda text, reason: {
                "index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason
            },
        )  # fmt: skip

    return router


async def _answer(
    run: _Run,
    body: _Request,
    request: Request,
    chunks: Callable[[_Run, str, bool], AsyncIterator[str]],
    kind: str,
    choice: Callable[[str, str | None], dict[str, Any]],
) -> Any:
    """A stream of SSE chunks, or the whole answer once the request finished."""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _sse(chunks(run, body.model, include_usage))
    text, reason = await run.collect(request)
    return {
        "id": run.rid,
        "object": kind,
        "created": int(time.time()),
        "model": body.model,
        "choices": [choice(text, reason)],
        "usage": run.usage(),
    }


SERVED_ADAPTER = "elastune_served_adapter"
"""The request's ``state`` key the worker's credential check (``elastune_worker.server.request_auth``)
sets from the verified credential: the adapter id the gateway resolved and signed (None: the base
model). Set, it is the only thing that says which adapter serves the request."""


def served_adapter(model: str, request: Request, base_model: str) -> str | None:
    """The id (``adapter_key``: namespace/name) of the adapter ``request`` is for; None for the base
    model. Signed: the credential's. Unsigned, the dev path of a worker with no request key (local runs,
    the engine's tests): the gateway's ``NAMESPACE_HEADER`` with ``model``; without the header, ``model``
    is the base model's name or an adapter of no namespace (loaded by hand). No other rule: an adapter
    a placement loaded in a namespace is reached with that namespace only."""
    state = request.scope.get("state") or {}
    if SERVED_ADAPTER in state:
        signed: str | None = state[SERVED_ADAPTER]
        return signed
    namespace = request.headers.get(NAMESPACE_HEADER)
    if namespace is None and model == base_model:
        return None
    return adapter_key(namespace or DEFAULT_NAMESPACE, model)


def lookup_adapter(engine: EngineClient, key: str) -> AdapterRef | None:
    """The loaded adapter whose id is ``key`` (None: none is loaded here)."""
    return next((a.ref for a in engine.adapters() if a.ref.key == key), None)


def _refuse_unsupported(body: _Request) -> None:
    bad = body.unsupported()
    if bad is not None:
        raise APIError(400, bad[1], bad[0])


def _params(
    body: _Request, max_tokens: int | None, prompt_len: int, context: int, engine: EngineClient
) -> SamplingParams:
    """The request's sampling, every value checked here (the numbers' ranges in the request model, the
    token ids against the vocabulary): nothing reaches the engine that could fail a step."""
    vocab = getattr(engine, "vocab_size", None)
    if vocab is not None and any(t >= vocab for t in body.stop_token_ids or ()):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", "prompt")
    if prompt_len >= context:
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room to generate. Shorten the prompt.",
            "prompt",
        )
    room = context - prompt_len
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            f"completion). Reduce the prompt or max_tokens (at most {room} here).",
            "max_tokens",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else room,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
    except ValueError as exc:  # the request model checks these ranges first: this is a backstop
        raise APIError(400, str(exc)) from exc


MAX_TENANT_CHARS = 256
"""A tenant id longer than this is cut (a Secret's ``namespace/name`` is at most 317 characters, but the
first 256 tell keys apart in practice; the cut bounds the engine's counter table's keys)."""


def _tenant(request: Request) -> str:
    """The tenant the gateway named (the caller's API key); "" without one (a request sent to the worker
    directly, or through a gateway without authentication). Only the gateway reaches a worker's
    inference routes in a cluster (NetworkPolicy), and it never forwards a client's own header."""
    return (request.headers.get(TENANT_HEADER) or "")[:MAX_TENANT_CHARS]


class _Run:
    """One request through the engine, timing what the metrics need."""

    def __init__(
        self,
        engine: EngineClient,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        priority: int,
        metrics: ServingMetrics | None,
        adapter: AdapterRef | None = None,
    ) -> None:
        self.engine, self.rid, self.ids, self.params, self.priority = engine, rid, ids, params, priority
        self.metrics, self.adapter = metrics, adapter
        self.tenant = ""
        """Whose request (the gateway's ``TENANT_HEADER``): what the ``fair`` queue policy shares across."""
        self.ticket: QueueTicket | None = None
        """Its place among the worker's queued requests, given back at its first output."""
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = RequestOutput(rid, [], "", False, None, len(ids), 0, 0)

    async def deltas(self) -> AsyncGenerator[RequestOutput, None]:
        it = self.engine.generate(
            self.rid, self.ids, self.params, self.priority, self.adapter, tenant=self.tenant
        )
        try:
            async for d in _refusals_as_400(it):
                if self.ticket is not None:
                    self.ticket.release()
                if self.first is None and d.completion_tokens > 0:
                    self.first = time.perf_counter() - self.start
                self.last = d
                yield d
        finally:
            if self.ticket is not None:
                self.ticket.release()
            await it.aclose()  # aborts the request if it is unfinished
            if self.metrics is not None:
                reason = self.last.finish_reason if self.last.finished else "abort"
                self.metrics.request_done(
                    self.first,
                    time.perf_counter() - self.start,
                    self.last.completion_tokens,
                    len(self.ids),
                    reason or "abort",
                )

    async def collect(self, request: Request) -> tuple[str, str | None]:
        parts: list[str] = []
        gen = self.deltas()
        try:
            async for d in gen:
                parts.append(d.text)
                if not d.finished and await request.is_disconnected():
                    break  # nobody waits for the answer: abort and free the KV blocks
        finally:
            await gen.aclose()
        return "".join(parts), self.last.finish_reason

    def usage(self) -> dict[str, Any]:
        d = self.last
        out: dict[str, Any] = {
            "prompt_tokens": len(self.ids),
            "completion_tokens": d.completion_tokens,
            "total_tokens": len(self.ids) + d.completion_tokens,
        }
        if d.cached_tokens:
            out["prompt_tokens_details"] = {"cached_tokens": d.cached_tokens}
        return out


async def _refusals_as_400(
    it: AsyncGenerator[RequestOutput, None],
) -> AsyncGenerator[RequestOutput, None]:
    """The engine refuses a request with ValueError (input it cannot take): that is the client's 400.
    A failure while it ran (RuntimeError: it failed inside a step, the engine is gone) is a 500 that
    says what failed."""
    try:
        async for d in it:
            yield d
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    except RuntimeError as exc:
        raise APIError(500, f"generation failed: {exc}") from exc


def _stream_error(exc: Exception) -> str:
    """The SSE error event that ends a stream: this request's failure (the others go on)."""
    if isinstance(exc, APIError):
        return sse_error(exc.status, exc.message)
    return sse_error(500, f"generation failed: {type(exc).__name__}: {exc}")


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _completion_chunks(run: _Run, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(text: str, reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {
            "id": run.rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
        }

    # The common chunk (some text, not finished) is a fixed frame around the JSON-escaped text:
    # building it costs one json.dumps of a string instead of a nested dict per token.
    frame = _data(chunk("\x00", None)).split('"\\u0000"')
    gen = run.deltas()
    try:
        async for d in gen:
            if d.finished:
                yield _data(chunk(d.text, d.finish_reason))
            elif d.text:
                yield frame[0] + json.dumps(d.text) + frame[1]
        if include_usage:
            yield _data({**chunk("", None), "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the status line is sent: report in the stream, then end it
        yield _stream_error(exc)
    finally:
        await gen.aclose()


async def _chat_chunks(run: _Run, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict[str, str], reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        return {
            "id": run.rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }

    frame = _data(chunk({"content": "\x00"}, None)).split('"\\u0000"')
    gen = run.deltas()
    try:
        yield _data(chunk({"role": "assistant", "content": ""}, None))
        async for d in gen:
            if d.finished:
                yield _data(chunk({"content": d.text} if d.text else {}, d.finish_reason))
            elif d.text:
                yield frame[0] + json.dumps(d.text) + frame[1]
        if include_usage:
            yield _data({**chunk({}, None), "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"
    except Exception as exc:
        yield _stream_error(exc)
    finally:
        await gen.aclose()
