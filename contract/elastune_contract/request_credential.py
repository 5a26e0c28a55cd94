"""The gateway's per-request credential to a worker (issue 39 item 3; docs/security.md).

A worker serves an inference request only when it carries ``x-elastune-credential``: what the gateway
decided for this request (the worker's namespace, the adapter id or base model it must serve, the API
key's id, an expiry), signed with HMAC-SHA256. No other header of the request is trusted: the namespace
an adapter is resolved in and the tenant the engine shares service across come from the credential.

Keys: one secret the gateway and the operator hold (the chart's operator-keys Secret, ``request-key``);
each namespace's workers get only ``namespace_key(secret, namespace)`` (a Secret the operator writes into
the pool's namespace). HMAC is one-way, so a worker of one namespace cannot sign for another's workers,
and the gateway derives every namespace's key from the one it holds (no per-namespace Secret to mount
across namespaces, which Kubernetes does not allow). Same construction as the attempts' proofs
(``protocol.attempt_proof``): HMAC-SHA256 over a newline-joined message, compared in constant time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

CREDENTIAL_HEADER = "x-elastune-credential"
VERSION = "v1"
DEFAULT_TTL_S = 30.0
"""A credential's lifetime from signing: above the gateway's wait for a worker's status line is not
needed (the worker checks it once, on arrival), only above gateway-to-worker transit and retries."""
DEFAULT_SKEW_S = 5.0
"""Clock difference between gateway and worker nodes tolerated on both ends of the lifetime."""
KEY_ENV = "ELASTUNE_REQUEST_KEY"
KEY_FILE_ENV = "ELASTUNE_REQUEST_KEY_FILE"
REQUEST_KEY_SECRET = "elastune-worker-request-key"
"""The Secret (key ``key``) the operator writes into each WarmPool namespace: that namespace's key."""
REQUEST_KEY_KEY = "key"
REQUEST_KEY_DIR = "/var/run/elastune/request-key"
"""Where worker pods mount it (read-only); ``$ELASTUNE_REQUEST_KEY_FILE`` points at the file."""


class CredentialError(Exception):
    """Why a credential is refused: ``status`` 401 (missing, malformed, bad signature, expired) or 403
    (valid, but for another namespace or another model); ``reason`` is the metric's label."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Credential:
    namespace: str
    """The namespace of the worker it is for (its pool's: the key's namespace)."""
    model: str
    """What the worker may serve for it: an adapter id (``namespace/name``, ``protocol.adapter_id``) or
    the base model's name."""
    adapter: bool
    key_id: str
    """The API key's id (its Secret's ``namespace/name``), never the key: the engine's tenant."""
    expires: float


def namespace_key(secret: bytes, namespace: str) -> bytes:
    """The key of one namespace's workers, derived from the gateway's secret (HMAC as a PRF); hex, so
    it is stored in a Secret, a file or an environment variable as it is."""
    message = f"elastune-request-key\n{namespace}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest().encode()


def _mac(key: bytes, payload: bytes) -> str:
    return hmac.new(key, f"{VERSION}\n".encode() + payload, hashlib.sha256).hexdigest()


def sign(
    secret: bytes,
    namespace: str,
    model: str,
    *,
    adapter: bool,
    key_id: str,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
) -> str:
    """The header value for one request to a worker of ``namespace`` (the gateway: it holds ``secret``)."""
    expires = (time.time() if now is None else now) + ttl_s
    cred = Credential(namespace, model, adapter, key_id, expires)
    return seal(namespace_key(secret, namespace), cred)


def seal(key: bytes, cred: Credential) -> str:
    """``cred`` signed with a namespace's own key (``namespace_key``)."""
    body = {"ns": cred.namespace, "model": cred.model, "adapter": cred.adapter, "key": cred.key_id,
            "exp": round(cred.expires, 3)}  # fmt: skip
    payload = base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode())
    return f"{VERSION}.{payload.decode()}.{_mac(key, payload)}"


def verify(
    value: str | None,
    key: bytes,
    namespace: str,
    *,
    max_ttl_s: float = DEFAULT_TTL_S,
    skew_s: float = DEFAULT_SKEW_S,
    now: float | None = None,
) -> Credential:
    """The credential of ``value`` checked under this worker's ``key`` (``namespace_key``) and for its
    ``namespace``; CredentialError otherwise. An expiry further ahead than ``max_ttl_s`` (+ skew) is
    refused too: a leaked credential is good for at most that long whatever it says."""
    if not value:
        raise CredentialError(401, "missing", f"this worker serves only the gateway ({CREDENTIAL_HEADER})")
    version, _, rest = value.partition(".")
    payload, _, mac = rest.partition(".")
    if version != VERSION or not payload or not mac:
        raise CredentialError(401, "malformed", "the request credential is malformed")
    if not hmac.compare_digest(mac, _mac(key, payload.encode())):
        raise CredentialError(401, "signature", "the request credential's signature does not verify")
    try:
        body = json.loads(base64.urlsafe_b64decode(payload))
        cred = Credential(
            str(body["ns"]), str(body["model"]), bool(body["adapter"]), str(body["key"]), float(body["exp"])
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CredentialError(401, "malformed", "the request credential is malformed") from exc
    t = time.time() if now is None else now
    if cred.expires + skew_s < t or cred.expires > t + max_ttl_s + skew_s:
        raise CredentialError(401, "expired", "the request credential has expired")
    if cred.namespace != namespace:
        raise CredentialError(403, "namespace", "the request credential is for another namespace")
    return cred


def load_key(environ: dict[str, str]) -> bytes | None:
    """The key from ``$ELASTUNE_REQUEST_KEY_FILE`` (a mounted Secret, or `elastune serve`'s 0600 file) or
    ``$ELASTUNE_REQUEST_KEY``; None when neither is set. An empty file is an error: a key must not be
    guessable."""
    path = environ.get(KEY_FILE_ENV)
    if path:
        with open(path, "rb") as f:
            raw = f.read().strip()
        if not raw:
            raise ValueError(f"the request key file {path} (${KEY_FILE_ENV}) is empty")
        return raw
    value = environ.get(KEY_ENV, "").strip()
    return value.encode() if value else None
