"""Inference only for the gateway (issue 39 item 3; docs/security.md): the per-request credential.

A worker that holds its namespace's request key (``$ELASTUNE_REQUEST_KEY_FILE``: the Secret the operator
writes into the pool's namespace; `elastune serve` passes one file to the gateway and every worker)
serves ``/v1/completions`` and ``/v1/chat/completions`` only with a valid ``x-elastune-credential``
(``elastune_contract.request_credential``), checked before the body is read: missing, malformed, forged
or expired → 401, for another namespace → 403. Then only what it names is served: the body's ``model``
must be the signed base model or the signed adapter's name → else 403. The request reaches the routes
with the signed adapter id on its state (``routes.SERVED_ADAPTER``; None for the base model), which the
routes look the adapter up by (issue 40: the gateway resolved the name once; no name rule here), the
gateway's ``x-elastune-namespace`` dropped and ``x-elastune-tenant`` replaced by the API key's id, so the
engine is shared by the signed key. Every refusal is counted
(``elastune_worker_request_credential_refused_total{reason}``).

A worker with no key (run by hand, the engine's own tests) is open as before and says so at start. The
routes themselves are untouched: this is middleware, so the engine package keeps no dependency on it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from elastune_common.asgi import App, Receive, Scope, Send
from elastune_contract.api_keys import TENANT_HEADER
from elastune_contract.openai_api.errors import error_body
from elastune_contract.protocol import NAMESPACE_HEADER, split_adapter_id
from elastune_contract.request_credential import (
    CREDENTIAL_HEADER,
    DEFAULT_SKEW_S,
    DEFAULT_TTL_S,
    Credential,
    CredentialError,
    load_key,
)
from elastune_contract.request_credential import verify as verify_credential
from elastune_worker.engine.api.routes import SERVED_ADAPTER

log = logging.getLogger("elastune.worker")

GUARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_HEADER = CREDENTIAL_HEADER.encode()
_NAMESPACE = NAMESPACE_HEADER.encode()
_TENANT = TENANT_HEADER.encode()


class RequestAuth:
    """Pure ASGI middleware (no per-chunk cost on streams): the guarded paths need a valid credential
    naming the body's model."""

    def __init__(
        self,
        app: App,
        key: bytes | None,
        namespace: str,
        refused: Callable[[str], None] = lambda reason: None,
        max_ttl_s: float = DEFAULT_TTL_S,
        skew_s: float = DEFAULT_SKEW_S,
    ) -> None:
        self.app = app
        self.key = key
        self.namespace = namespace
        self.refused = refused
        self.max_ttl_s = max_ttl_s
        self.skew_s = skew_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope.get("path") not in GUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        value = next((v.decode("latin-1") for n, v in scope.get("headers", ()) if n == _HEADER), None)
        try:
            cred = verify_credential(
                value, self.key, self.namespace, max_ttl_s=self.max_ttl_s, skew_s=self.skew_s
            )
        except CredentialError as exc:
            self.refused(exc.reason)
            await _refuse(send, exc.status, str(exc))
            return
        # Signed by the gateway, so its body was bounded there: read it whole to check its model.
        messages, body = await _read_body(receive)
        if _model_of(body) != (split_adapter_id(cred.model)[1] if cred.adapter else cred.model):
            self.refused("model")
            await _refuse(send, 403, "this request's credential does not name the model it asks for", "model")
            return
        replay = iter(messages)

        async def again() -> Any:
            return next(replay, None) or await receive()

        await self.app(_signed_scope(scope, cred), again, send)


def _signed_scope(scope: Scope, cred: Credential) -> Scope:
    """``scope`` with what the credential says in place of the gateway's headers: the signed adapter id
    (None: the base model, so no adapter of that name answers in its stead) and the key's id."""
    drop = {_HEADER, _NAMESPACE, _TENANT}
    headers = [(n, v) for n, v in scope.get("headers", ()) if n not in drop]
    headers.append((_TENANT, cred.key_id.encode()))
    state = {**(scope.get("state") or {}), SERVED_ADAPTER: cred.model if cred.adapter else None}
    return {**scope, "headers": headers, "state": state}


async def _read_body(receive: Receive) -> tuple[list[Any], bytes]:
    messages: list[Any] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, b""
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return messages, b"".join(chunks)


def _model_of(body: bytes) -> object:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed.get("model") if isinstance(parsed, dict) else None


async def _refuse(send: Send, status: int, message: str, param: str | None = None) -> None:
    raw = json.dumps(error_body(status, message, param)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if status == 401:
        head.append((b"www-authenticate", b'Bearer realm="elastune-gateway"'))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})


def guard_inference(
    app: FastAPI,
    refused: Callable[[str], None] = lambda reason: None,
    environ: dict[str, str] | None = None,
) -> bool:
    """Put the inference routes of ``app`` behind the request credential when a key is configured;
    whether one is. The worker's namespace is ``$POD_NAMESPACE`` ("" for a local worker)."""
    env = dict(os.environ) if environ is None else environ
    key = load_key(env)
    if key is None:
        log.warning("no request key ($ELASTUNE_REQUEST_KEY_FILE): inference is open to whoever reaches it")
    app.add_middleware(RequestAuth, key=key, namespace=env.get("POD_NAMESPACE", ""), refused=refused)
    return key is not None
