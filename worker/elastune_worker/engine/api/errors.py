"""The worker's error handlers: the shared OpenAI-shaped ones, and 503 + Retry-After while the engine
is not ready."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from elastune_contract.openai_api.handlers import error_response, install_error_handlers
from elastune_worker.engine.client import EngineBusy

log = logging.getLogger("elastune.serving")


def install(app: FastAPI) -> None:
    install_error_handlers(app, log)

    @app.exception_handler(EngineBusy)
    async def _busy(_: Request, exc: EngineBusy) -> JSONResponse:
        return error_response(503, str(exc) or "the engine is not ready", headers={"Retry-After": "1"})
