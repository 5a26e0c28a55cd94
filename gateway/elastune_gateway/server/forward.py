"""One request to one worker over HTTP, and how its failures are told apart.

Before the worker answers, a refused connection, a dropped one or a 502/503/504 means the request did not
run there: it may go to another endpoint (``EndpointUnavailable``). A timeout waiting for the answer is
not retried (the worker may still be computing it); it ends the request with a 504.
"""

from __future__ import annotations

import httpx

from .directory import Endpoint

_RETRYABLE_STATUS = (502, 503, 504)


class EndpointUnavailable(Exception):
    """The endpoint could not take the request; ``kind`` is connect or unavailable."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class EndpointTimeout(Exception):
    """The endpoint took the request but sent no answer within the read timeout."""


async def open_response(
    client: httpx.AsyncClient, endpoint: Endpoint, path: str, payload: bytes, headers: dict[str, str]
) -> httpx.Response:
    """The worker's response with its status and headers read and its body not yet (the caller streams
    or reads it, then closes it)."""
    request = client.build_request(
        "POST", endpoint.url + path, content=payload, headers={"content-type": "application/json", **headers}
    )
    try:
        response = await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
        raise EndpointUnavailable("connect", f"{type(exc).__name__}: {exc}") from exc
    except httpx.TimeoutException as exc:
        raise EndpointTimeout(f"no answer from {endpoint.id} within the read timeout") from exc
    except httpx.TransportError as exc:
        raise EndpointUnavailable("connect", f"{type(exc).__name__}: {exc}") from exc
    if response.status_code in _RETRYABLE_STATUS:
        detail = (await response.aread())[:300].decode("utf-8", "replace")
        await response.aclose()
        raise EndpointUnavailable("unavailable", f"HTTP {response.status_code}: {detail}")
    return response
