"""One request to one worker over HTTP, and how its failures are told apart.

Before the worker answers, a refused connection, a dropped one, a 502/503/504 (a draining worker answers
503) or the worker going silent (its registry record expired) means the request did not run there: it
may go to another endpoint (``EndpointUnavailable``). A timeout waiting for the answer is
not retried (the worker may still be computing it); it ends the request with a 504.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

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
    pool: UpstreamPool,
    endpoint: Endpoint,
    path: str,
    payload: bytes,
    headers: dict[str, str] | None,
    silent: Callable[[], Awaitable[str]] | None = None,
) -> UpstreamResponse:
    """The worker's response with its status and headers read and its body not yet (the caller streams
    or reads it, then releases it). ``silent``: a watch that returns (with why) when the worker went
    silent before answering; the request then did not start there (``EndpointUnavailable``)."""
    try:
        if silent is None:
            response = await pool.post(endpoint.url, path, payload, headers)
        else:
            response = await _unless_silent(pool.post(endpoint.url, path, payload, headers), silent)
    except WentSilent as exc:
        raise EndpointUnavailable("silent", f"{endpoint.id} went silent before answering: {exc}") from exc
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


class WentSilent(Exception):
    """The worker went silent (no heartbeat) before its status line came."""


async def _unless_silent(
    post: Awaitable[UpstreamResponse], silent: Callable[[], Awaitable[str]]
) -> UpstreamResponse:
    answer = asyncio.ensure_future(post)
    watch = asyncio.ensure_future(silent())
    try:
        done, _ = await asyncio.wait((answer, watch), return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            return answer.result()
        answer.cancel()  # closes the connection: a worker that resumes finds its client gone
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await answer
        raise WentSilent(watch.result())
    finally:
        watch.cancel()
        if not answer.done():
            answer.cancel()
