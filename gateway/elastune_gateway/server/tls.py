"""The gateway's TLS contexts (issue 39 item 6): toward Redis (``rediss://`` with the private CA the
chart mounts, the same variables as every other Redis client: ``elastune_common.tls``) and toward the
workers (HTTPS with the worker CA). Built once at start-up, so a missing or unreadable file stops the
gateway with its name rather than failing each request.

Worker names: the gateway dials the pod IP the operator vouched for, and a certificate cannot name a pod
IP ahead of time (cert-manager issues per Secret, before the pod has an address; its csi-driver cannot
either: cert-manager/csi-driver#17), so every worker certificate carries one DNS name,
``worker_tls_server_name``, which the gateway checks instead of the IP. Which pod answers is the vouched
address's job; TLS proves the peer holds a key the worker CA signed for that name, and keeps prompts and
completions off the wire in the clear."""

from __future__ import annotations

import ssl

from elastune_common.tls import client_context, redis_context

from .settings import GatewaySettings

__all__ = ["redis_context", "worker_context"]


def worker_context(settings: GatewaySettings) -> ssl.SSLContext | None:
    """HTTPS toward the workers, trusting ``worker_ca_file`` only; None: plain HTTP (TLS off)."""
    if not settings.worker_ca_file:
        return None
    return client_context(settings.worker_ca_file, what="worker TLS")
