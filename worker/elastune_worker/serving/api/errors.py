"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status.

Bad input is always a 4xx with a message that says what to change; a 500 means a bug of ours.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from elastune_worker.serving.api.client import EngineBusy

log = logging.getLogger("elastune.serving")

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}
    }


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def sse_error(status: int, message: str) -> str:
    """An error inside an SSE stream that already started (the status line was sent)."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"


def _location(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(EngineBusy)
    async def _busy(_: Request, exc: EngineBusy) -> JSONResponse:
        resp = error_response(503, str(exc) or "the engine is not ready")
        resp.headers["Retry-After"] = "1"
        return resp

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        lines = [f"{_location(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}" for e in errors[:5]]
        param = _location(tuple(first.get("loc", ()))) if first else None
        return error_response(400, "; ".join(lines), param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")
