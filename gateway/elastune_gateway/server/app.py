"""The gateway's HTTP application: the two completion routes as raw ASGI (``completions.py``, the hot
path) in front of FastAPI, which serves the rest (models, health) and the OpenAPI document at
/openapi.json describing all of them (the request and response shapes are the contract's, the same as a
worker's).

What a caller of one tenant can learn here names nothing of another (issue 39 item 5): /readyz says
whether and how much, never which models; the OpenAPI document names models as examples only without
authentication (one tenant); /metrics (every key's and model's series) is served by ``metrics_app`` on
its own port (``settings.metrics_port``), and on this one only when authentication is off."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.routing import Route

from elastune_common.asgi import Receive, ResponseStatusHook, Scope, Send
from elastune_contract.openai_api.handlers import install_error_handlers
from elastune_contract.openai_api.limits import BodySizeLimit
from elastune_contract.openai_api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)

from .auth import Principal
from .completions import CompletionRoutes
from .service import Gateway
from .settings import GatewaySettings

log = logging.getLogger("elastune.gateway")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": why}
    for code, why in (
        (400, "Invalid request: malformed body, unsupported option, prompt over the context"),
        (401, "No API key, or one that is not (or no longer) valid (authentication required)"),
        (403, "The API key may not use this model"),
        (404, "Unknown model"),
        (
            429,
            "The API key's requests/min or tokens/min used up (Retry-After, x-ratelimit-*), or too many "
            "requests waiting for warm endpoints (Retry-After)",
        ),
        (502, "The endpoint serving the request failed"),
        (503, "No warm endpoint within the pool's hold timeout (Retry-After)"),
        (504, "The endpoint did not answer within the read timeout"),
    )
}
_STREAM: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "The answer, or SSE chunks when stream"}
}


async def _principal(request: Request) -> Principal | None:
    """401 without a valid key when authentication is required (before the body is validated)."""
    keys = request.app.state.keys
    if keys is None:
        return None
    p: Principal = keys.authenticate(request.headers.get("authorization"))
    request.state.principal = p
    return p


Caller = Annotated[Principal | None, Depends(_principal)]
"""The request's API key (None with authentication off)."""


class GatewayApp(FastAPI):
    """FastAPI with the completion routes taken out ahead of its middleware and routing."""

    completion_routes: CompletionRoutes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.completion_routes.paths:
            await self.completion_routes(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _documented_routes() -> APIRouter:
    """The completion routes as the OpenAPI document describes them (served by ``CompletionRoutes``,
    never by these functions: the router is only read to build the document)."""
    router = APIRouter(tags=["openai"])

    @router.post("/v1/completions", response_model=CompletionResponse, responses={**_STREAM, **_ERRORS})
    async def completions(body: CompletionRequest, p: Caller) -> None:
        """A completion of the prompt by the model (SSE chunks when ``stream``)."""

    @router.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_STREAM, **_ERRORS}
    )
    async def chat(body: ChatCompletionRequest, p: Caller) -> None:
        """The next message of the conversation (SSE chunks when ``stream``)."""

    return router


def create_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = GatewayApp(
        title="Elastune gateway",
        version="0.1.0",
        description="OpenAI-compatible gateway in front of Elastune's warm worker pods: resolves the model, "
        "routes with the pool's policy (Preble E2, rank-aware, …), holds requests while a pool scales up.",
        lifespan=lifespan,
    )
    install_error_handlers(app, log)
    limits = gateway.settings.request_limits()
    app.completion_routes = CompletionRoutes(gateway, limits)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)  # 413 before parsing
    metrics = gateway.metrics
    created = int(time.time())

    def count(
        scope: Scope, status: int
    ) -> None:  # the FastAPI routes' answers (CompletionRoutes counts its own)
        if str(scope.get("path", "")).startswith("/v1/"):
            state = scope.get("state", {})
            model = state.get("model", "-")  # a known model only: no label per typo
            metrics.requests.labels(state.get("namespace", ""), model, str(status)).inc()
            key = scope.get("state", {}).get("principal")
            if key is not None:
                metrics.key_requests.labels(key.name, str(status)).inc()

    app.add_middleware(ResponseStatusHook, on_response=count)

    app.state.keys = gateway.keys

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz", tags=["health"],
        responses={503: {"description": "Cannot serve: the registry (or, with authentication, the API key "
                                        "map) was never read, or its last view is stale and names no "
                                        "endpoint"}},
    )  # fmt: skip
    async def readyz() -> JSONResponse:
        """Whether this replica can serve (not whether Redis answered just now): from its last view of
        the registry while it knows an endpoint, or while that view is fresh (settings.registry_stale_s)."""
        d = gateway.directory
        why = d.readiness(gateway.settings.registry_stale_s)
        if why is None and gateway.keys is not None and gateway.keys.confirmed_age() is None:
            # Authentication on and no key map confirmed yet (just started): every key would get 503.
            why = "the API key map was never read (no map published yet, or Redis unreachable)"
        if why is not None:
            return JSONResponse({"status": "not ready", "reason": why}, status_code=503)
        age = d.age()
        return JSONResponse(
            {"status": "ready", "endpoints": len(d.all_endpoints()),
             "length_predictor": gateway.settings.length_predictor_url is not None,
             "registry_age_s": round(age, 3) if age is not None else None,
             "registry_error": d.last_error}
        )  # fmt: skip

    if metrics_on_client_port(gateway.settings):

        @app.get("/metrics", tags=["health"])
        async def metrics_text() -> Response:
            return metrics_response(gateway)

    @app.get("/v1/models", response_model=ModelList, tags=["openai"], responses={401: _ERRORS[401]})
    async def models(p: Caller) -> dict[str, Any]:
        """The models known now; with authentication, those the key may use, as its namespace resolves
        them (its own adapters, the base models of the pools that admit it)."""
        allowed = None if p is None else set(p.record.models)
        data = [
            {"id": m.name, "object": "model", "created": created, "owned_by": "elastune", "root": m.name,
             "parent": m.parent, "max_model_len": m.max_model_len}
            for m in gateway.directory.models(None if p is None else p.namespace).values()
            if allowed is None or m.name in allowed
        ]  # fmt: skip
        return {"object": "list", "data": data}

    def openapi() -> dict[str, Any]:
        """The document names the models known now as examples of every ``model`` field (what Swagger
        UI pre-fills and what fuzzers start from)."""
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=[*app.routes, *_documented_routes().routes],
            )  # fmt: skip
        # Without authentication only: with it the document is served to anyone, before any key, and
        # every tenant's model names would be in it.
        known = list(gateway.directory.models()) if gateway.keys is None else []
        if known:
            for schema in app.openapi_schema.get("components", {}).get("schemas", {}).values():
                model = schema.get("properties", {}).get("model")
                if model is not None:
                    model["examples"] = known
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def metrics_on_client_port(settings: GatewaySettings) -> bool:
    """/metrics on the client port only for one tenant (no authentication) and no metrics port."""
    return settings.metrics_port is None and settings.auth == "off"


def metrics_response(gateway: Gateway) -> Response:
    """The Prometheus text, with the directory's gauges brought up to date first."""
    metrics = gateway.metrics
    age = gateway.directory.age()
    if age is not None:
        metrics.registry_age.set(age)
    metrics.endpoints.clear()
    for ep in gateway.directory.all_endpoints():
        state = "down" if gateway.directory.is_down(ep.id) else "up"
        metrics.endpoints.labels(ep.model, state).inc()
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def metrics_app(gateway: Gateway) -> Starlette:
    """The metrics port's application: GET /metrics and nothing else (404), no OpenAPI document. It runs
    in the gateway's event loop, so the directory is read where it is written."""

    async def metrics_text(_: Request) -> Response:
        return metrics_response(gateway)

    return Starlette(routes=[Route("/metrics", metrics_text, methods=["GET"])])
