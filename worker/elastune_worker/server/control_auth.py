"""The worker's control credential (docs/design.md §6 Tenancy, issue 25 item 4).

Inference (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``), health (``/healthz``,
``/readyz``, ``/health``), ``/metrics`` and the API document (``/openapi.json``, ``/docs``) are open to
whoever the NetworkPolicy lets reach the pod. Every other route of the worker - adapter load and unload
(vLLM's ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``), ``/status`` and whatever is added
later - answers 401 (OpenAI-shaped, ``WWW-Authenticate: Bearer``) unless the request carries
``Authorization: Bearer <token>`` with the worker's control token. A path no route serves still gets its
404.

The token is what the operator and the worker's own agent hold: on Kubernetes a Secret the operator writes
into the pool's namespace (``WORKER_CONTROL_SECRET``, distinct from any Redis credential) mounted as a file
named by ``$ELASTUNE_CONTROL_TOKEN_FILE``; ``$ELASTUNE_CONTROL_TOKEN`` gives it directly; the local
backend (`elastune serve`) makes one per run. With neither, the worker makes a random one nobody else
knows: its control routes are then closed over HTTP (its agent places adapters in process, not over HTTP).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from pathlib import Path

from fastapi import FastAPI
from starlette.routing import Match

from elastune_common.asgi import App, Receive, Scope, Send
from elastune_contract.openai_api.errors import error_body


def _error(status: int, message: str) -> dict[str, object]:
    inner = error_body(status, message)["error"]
    assert isinstance(inner, dict)
    return inner


log = logging.getLogger("elastune.worker")

TOKEN_ENV = "ELASTUNE_CONTROL_TOKEN"
TOKEN_FILE_ENV = "ELASTUNE_CONTROL_TOKEN_FILE"
WORKER_CONTROL_SECRET = "elastune-worker-control"
"""The Secret the operator writes into every WarmPool namespace (key ``token``)."""
WORKER_CONTROL_KEY = "token"
TOKEN_DIR = "/var/run/elastune/control"
"""Where worker pods mount that Secret (read-only)."""

OPEN_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/healthz",
        "/readyz",
        "/health",
        "/metrics",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
    }
)


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith("/v1/models/")


def control_token(environ: dict[str, str] | None = None) -> tuple[str, str]:
    """(token, where it came from): $ELASTUNE_CONTROL_TOKEN_FILE, $ELASTUNE_CONTROL_TOKEN, or a random
    one made here. An empty or unreadable file is an error: a worker must not start with a guessable
    token."""
    env = os.environ if environ is None else environ
    path = env.get(TOKEN_FILE_ENV)
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"the control token file {path} (${TOKEN_FILE_ENV}) is empty")
        return token, path
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    return secrets.token_urlsafe(32), "random"


class ControlAuth:
    """Pure ASGI middleware (no per-chunk cost on streamed responses): the open paths pass; any other
    path a route serves needs the bearer token."""

    def __init__(self, app: App, token: str, routes: FastAPI) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope.get("path", "")) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if not any(r.matches(scope)[0] is not Match.NONE for r in self.routes.router.routes):
            await self.app(scope, receive, send)  # no such route: its 404
            return
        message = "this worker's control endpoints need its control token (Authorization: Bearer)"
        body = {"error": {**_error(401, message), "type": "AuthenticationError"}}
        await _json(send, 401, body, {b"www-authenticate": b"Bearer"})

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False


async def _json(send: Send, status: int, body: object, headers: dict[bytes, bytes]) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + list(headers.items())})
    await send({"type": "http.response.body", "body": raw})


def guard_control(app: FastAPI, environ: dict[str, str] | None = None) -> None:
    """Put the control routes of ``app`` behind the control token (before the app serves)."""
    token, source = control_token(environ)
    if source == "random":
        log.warning(
            "no control token ($%s or $%s): adapter load/unload and /status are closed over HTTP",
            TOKEN_FILE_ENV,
            TOKEN_ENV,
        )
    app.add_middleware(ControlAuth, token=token, routes=app)
