"""One request to one worker over HTTP, and how its failures are told apart.

Before the worker answers, a refused connection, a dropped one or a 502/503/504 means the request did not
run there: it may go to another endpoint (``EndpointUnavailable``). A timeout waiting for the answer is
not retried (the worker may still be computing it); it ends the request with a 504.
"""

from __future__ import annotations

from .directory import Endpoint
from .upstream import ConnectFailed, ConnectionLost, ReadTimeout, UpstreamPool, UpstreamResponse

_RETRYABLE_STATUS = (502, 503, 504)


class EndpointUnavailable(Exception):
    """The endpoint could not take the request; ``kind`` is connect or unavailable."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class EndpointTimeout(Exception):
    """The endpoint took the request but sent no answer within the read timeout."""


async def open_response(
    pool: UpstreamPool, endpoint: Endpoint, path: str, payload: bytes, headers: dict[str, str] | None
) -> UpstreamResponse:
    """The worker's response with its status and headers read and its body not yet (the caller streams
    or reads it, then releases it)."""
    try:
        response = await pool.post(endpoint.url, path, payload, headers)
    except (ConnectFailed, ConnectionLost) as exc:
        raise EndpointUnavailable("connect", f"{type(exc).__name__}: {exc}") from exc
    except ReadTimeout as exc:
        raise EndpointTimeout(f"no answer from {endpoint.id} within the read timeout") from exc
    if response.status_code in _RETRYABLE_STATUS:
        try:
            detail = (await response.read())[:300].decode("utf-8", "replace")
        except (ConnectionLost, ReadTimeout) as exc:
            detail = f"(body unread: {type(exc).__name__})"
        finally:
            response.release()
        raise EndpointUnavailable("unavailable", f"HTTP {response.status_code}: {detail}")
    return response
