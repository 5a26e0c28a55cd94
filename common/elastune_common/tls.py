"""TLS toward Redis with a private CA, for every Redis client of the project (issue 39 item 6).

One set of environment variables for every pod (the chart mounts the CA Secret and sets them on the
operator, the gateway and the workers), read by the redis-py clients (``bus.Bus``, the worker's
``RedisChannel``) through ``redis_ssl_kwargs`` and by the gateway's own RESP client through
``client_context``: a ``rediss://`` URL then verifies the server against that CA, not the system's.
"""

from __future__ import annotations

import os
import ssl
from urllib.parse import urlsplit

REDIS_CA_FILE_ENV = "ELASTUNE_REDIS_CA_FILE"
"""PEM bundle of the CA(s) that sign Redis' certificate (the Secret's ca.crt)."""
REDIS_CERT_FILE_ENV = "ELASTUNE_REDIS_CERT_FILE"
"""Optional client certificate (PEM), for a Redis that asks for one (``tls-auth-clients yes``)."""
REDIS_KEY_FILE_ENV = "ELASTUNE_REDIS_KEY_FILE"
"""Its private key (PEM)."""


class TLSSettingsError(ValueError):
    """A TLS file is named but cannot be used (the message names the variable and the file)."""


def client_context(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None, *, what: str = "TLS"
) -> ssl.SSLContext:
    """A client context that verifies the server's chain and name against ``ca_file`` (the system's
    CAs when None) and presents ``cert_file``/``key_file`` when given (mutual TLS). TLS 1.2 at least."""
    if (cert_file is None) != (key_file is None):
        raise TLSSettingsError(f"{what}: a client certificate needs both its cert and key files")
    try:
        context = ssl.create_default_context(cafile=ca_file)
        if cert_file and key_file:
            context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TLSSettingsError(f"{what}: cannot load {ca_file or ''} {cert_file or ''}: {exc}") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def redis_tls_files() -> tuple[str | None, str | None, str | None]:
    """(CA, cert, key) files from the environment; None for each not set."""
    ca, cert, key = (
        os.environ.get(v) or None for v in (REDIS_CA_FILE_ENV, REDIS_CERT_FILE_ENV, REDIS_KEY_FILE_ENV)
    )
    return ca, cert, key


def redis_context(url: str) -> ssl.SSLContext | None:
    """The context a hand-written client opens ``url`` with: None for ``redis://``, else one that trusts
    ``$ELASTUNE_REDIS_CA_FILE`` (the system's CAs when unset)."""
    if urlsplit(url).scheme != "rediss":
        return None
    ca, cert, key = redis_tls_files()
    return client_context(ca, cert, key, what="Redis TLS")


def redis_ssl_kwargs(url: str) -> dict[str, object]:
    """redis-py's keyword arguments for the same trust (``Redis.from_url(url, **redis_ssl_kwargs(url))``):
    empty for ``redis://``; for ``rediss://`` the CA and client files, certificate and hostname required
    (redis-py's own defaults, stated so that no URL query can loosen them)."""
    if urlsplit(url).scheme != "rediss":
        return {}
    ca, cert, key = redis_tls_files()
    if (cert is None) != (key is None):
        raise TLSSettingsError("Redis TLS: a client certificate needs both its cert and key files")
    kwargs: dict[str, object] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    if ca:
        kwargs["ssl_ca_certs"] = ca
    if cert and key:
        kwargs["ssl_certfile"], kwargs["ssl_keyfile"] = cert, key
    return kwargs
