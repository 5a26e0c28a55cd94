"""The credential the gateway puts on every request it forwards to a worker
(``elastune_contract.request_credential``): the worker's namespace, what it may serve (the adapter id, or
the base model), the caller's key id and an expiry, signed with that namespace's key."""

from __future__ import annotations

import os
import time

from elastune_contract.protocol import split_worker_id
from elastune_contract.request_credential import CREDENTIAL_HEADER, Credential, load_key, namespace_key, seal

from .call import Call
from .directory import Endpoint, KnownModel


class RequestSigner:
    def __init__(self, secret: bytes, ttl_s: float) -> None:
        self.secret = secret
        self.ttl_s = ttl_s
        self._keys: dict[
            str, bytes
        ] = {}  # namespace -> its derived key: one HMAC per namespace, not per request

    def headers(self, call: Call, model: KnownModel, endpoint: Endpoint) -> dict[str, str]:
        """The header for ``call`` sent to ``endpoint`` (its namespace from its worker id, which the
        directory vouches for from the pod list)."""
        namespace, _ = split_worker_id(endpoint.id)
        served = model.adapter or model.name  # the adapter's id, resolved once (directory.py)
        key_id = call.principal.name if call.principal is not None else ""
        key = self._keys.get(namespace)
        if key is None:
            key = self._keys[namespace] = namespace_key(self.secret, namespace)
        cred = Credential(namespace, served, model.adapter is not None, key_id, time.time() + self.ttl_s)
        return {CREDENTIAL_HEADER: seal(key, cred)}


def signer_from_env(ttl_s: float, environ: dict[str, str] | None = None) -> RequestSigner | None:
    """The signer of the key in ``$ELASTUNE_REQUEST_KEY_FILE`` / ``$ELASTUNE_REQUEST_KEY``; None without
    one (workers that verify then refuse every request: the gateway logs it at start)."""
    secret = load_key(dict(os.environ) if environ is None else environ)
    return None if secret is None else RequestSigner(secret, ttl_s)
