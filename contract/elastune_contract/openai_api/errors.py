"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status.

Bad input is always a 4xx with a message that says what to change; a 500 means a bug of ours.
"""

from __future__ import annotations

import json

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class APIError(Exception):
    """Raised by a route: answered as an OpenAI-shaped error with ``status`` (and ``headers``)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def sse_error(status: int, message: str) -> str:
    """An error inside an SSE stream that already started (the status line was sent)."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"
