"""The worker's HTTP application: the OpenAI-compatible serving routes beside the Knative container
contract (/healthz, /readyz, /status), on FastAPI with its OpenAPI document at /openapi.json. The worker
pod serves /metrics on a port of its own (listeners.py); the standalone server on this app's port unless
given --metrics-port (engine/server.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi

from elastune_common.asgi import ResponseStatusHook, Scope
from elastune_contract.openai_api.limits import BodySizeLimit, RequestLimits
from elastune_worker.engine.api import errors
from elastune_worker.engine.api.admission import QueueBound
from elastune_worker.engine.api.metrics import ServingMetrics
from elastune_worker.engine.api.routes import openai_router
from elastune_worker.engine.client import EngineClient


def create_app(
    get_engine: Callable[[], EngineClient | None],
    *,
    metrics: ServingMetrics | None = None,
    control: APIRouter | None = None,
    limits: RequestLimits | None = None,
    max_queued_requests: int | None = None,
) -> FastAPI:
    """``get_engine`` returns None until the weights are loaded (requests then get 503 + Retry-After);
    ``limits``: request size limits (bodies 413, prompts and stops 400; defaults: RequestLimits());
    ``max_queued_requests``: requests accepted and not yet started at most (past it: 503 + Retry-After;
    None: unbounded)."""
    app = FastAPI(
        title="Elastune worker",
        version="0.1.0",
        description="OpenAI-compatible serving on a warm Elastune worker, and its health endpoints.",
    )
    errors.install(app)
    limits = limits or RequestLimits()
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    if metrics is not None:  # added after (outside) the size limit: a 413 is counted too
        counted = metrics

        def count_errors(scope: Scope, status: int) -> None:
            if status >= 400 and str(scope.get("path", "")).startswith("/v1/"):
                counted.errors.labels(counted.model, str(status)).inc()

        app.add_middleware(ResponseStatusHook, on_response=count_errors)

    queue = QueueBound(max_queued_requests) if max_queued_requests is not None else None
    app.state.queue = queue  # how many wait now (tests; None: unbounded)
    app.include_router(openai_router(get_engine, metrics, limits, queue))
    if control is not None:
        app.include_router(control)

    def openapi() -> dict[str, Any]:
        """The document names the served model as the example of every ``model`` field (what Swagger
        UI pre-fills and what fuzzers start from)."""
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
        engine = get_engine()
        if engine is not None:
            for schema in app.openapi_schema.get("components", {}).get("schemas", {}).values():
                model = schema.get("properties", {}).get("model")
                if model is not None:
                    model["examples"] = [engine.model_name]
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
