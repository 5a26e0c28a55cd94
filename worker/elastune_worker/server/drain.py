"""Graceful drain: what a worker does between SIGTERM and its exit, so nothing in flight is cut.

Kubernetes sends SIGTERM at every scale-down, rollout and node drain, then SIGKILL after the pod's
``terminationGracePeriodSeconds``. A worker that exits at once cuts every stream it serves. Draining:

1. readiness turns false and the worker leaves the registry, so the gateway (which re-reads the
   registry every 0.25 s) and the control plane stop sending it work;
2. a request that still arrives gets 503 with ``Retry-After`` (``x-elastune-draining: 1``): it did not
   start here, and the gateway retries 502/503/504 on another endpoint;
3. requests already running (streams included) go on until they finish or the drain deadline passes
   (set a few seconds below the grace period, so the process exits before the SIGKILL);
4. then the worker stops: the HTTP server, the job agent and the engine.

The count of requests in flight is kept here, at the HTTP layer, for the inference routes: a stream is
in flight until its last byte is sent, whatever the engine's queues say.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("elastune.worker")

INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")
DRAINING_HEADER = "x-elastune-draining"
DEFAULT_DRAIN_SECONDS = 25.0
"""Five seconds under Kubernetes' default terminationGracePeriodSeconds (30): the operator sets both
from the WarmPool (``--drain-seconds`` = grace period - 5)."""


class Drain:
    """The drain's state, shared by the signal handler, the HTTP middleware and the agent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self.started_at: float | None = None

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def begin(self) -> bool:
        """Start draining; False when it had started already (a second SIGTERM)."""
        with self._lock:
            if self.started_at is not None:
                return False
            self.started_at = time.monotonic()
            return True

    def enter(self) -> bool:
        """Count a new inference request in; False while draining (it must go elsewhere)."""
        with self._lock:
            if self.started_at is not None:
                return False
            self._in_flight += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> int:
        """Block until no request is in flight or ``timeout`` passed; the requests still in flight."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            return self._in_flight


class DrainMiddleware:
    """ASGI: counts inference requests in flight (a streamed response until its last chunk) and refuses
    new ones with 503 while draining. Plain ASGI, not BaseHTTPMiddleware, so streams pass untouched."""

    def __init__(self, app: ASGIApp, drain: Drain, retry_after_s: int = 1) -> None:
        self.app, self.drain, self.retry_after_s = app, drain, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in INFERENCE_PATHS:
            await self.app(scope, receive, send)
            return
        if not self.drain.enter():
            await self._refuse(send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": "This worker is shutting down (draining); the request did not start here, "
                    "retry on another endpoint",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            }
        ).encode()
        start: Message = {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(self.retry_after_s).encode()),
                (DRAINING_HEADER.encode(), b"1"),
            ],
        }
        await send(start)
        await send({"type": "http.response.body", "body": body})


def drain_then(drain: Drain, seconds: float, leave: Callable[[], None], stop: Callable[[], None]) -> None:
    """The drain itself (run on a thread of its own: a signal handler must return at once): leave the
    registry, wait for the requests in flight up to ``seconds``, then ``stop``."""
    if not drain.begin():
        log.info("drain already under way")
        return
    log.info("draining: readiness false, leaving the registry; up to %.0f s for requests in flight", seconds)
    try:
        leave()
    except Exception as exc:  # Redis down: the record expires with its TTL; drain all the same
        log.warning("could not leave the registry: %s", exc)
    left = drain.wait_idle(seconds)
    if left:
        log.warning("drain deadline (%g s) passed with %d request(s) in flight: stopping", seconds, left)
    else:
        log.info("drained: no request in flight after %.1f s", time.monotonic() - (drain.started_at or 0))
    stop()
