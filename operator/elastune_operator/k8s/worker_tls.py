"""TLS in the worker pods (issue 39 item 6): the Redis CA and the serving certificate.

- Redis CA: with ``$ELASTUNE_REDIS_CA_FILE`` set (the chart's redis.tls.caSecret, mounted into the
  operator), the operator writes that CA bundle into every WarmPool namespace as the Secret
  ``elastune-redis-ca`` (a pod mounts only Secrets of its own namespace; a CA certificate is public) and
  the worker pods mount it and point ``ELASTUNE_REDIS_CA_FILE`` at it, so ``rediss://`` is verified
  against the private CA there too.
- Serving certificate: with ``$ELASTUNE_WORKER_TLS_SECRET`` set (the chart's gateway.workerTLS), the
  worker pods mount that ``kubernetes.io/tls`` Secret of their namespace (cert-manager writes it from a
  Certificate: docs/operations/tls.md) and serve HTTPS on their serving port; the kubelet's probes on that
  port switch to HTTPS (it does not verify certificates). Not optional: a pod without its certificate
  would serve in the clear, which the gateway refuses, so it waits for the Secret instead.
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from elastune_common.tls import REDIS_CA_FILE_ENV

log = logging.getLogger("elastune.workload")

REDIS_CA_SECRET = "elastune-redis-ca"
"""The copy of the Redis CA in each WarmPool namespace (key ``ca.crt``)."""
REDIS_CA_DIR = "/var/run/elastune/redis-ca"
WORKER_TLS_SECRET_ENV = "ELASTUNE_WORKER_TLS_SECRET"
"""The operator's setting: the name of the workers' serving-certificate Secret in each pool namespace."""
WORKER_TLS_DIR = "/var/run/elastune/tls"
CERT_FILE_ENV, KEY_FILE_ENV = "ELASTUNE_WORKER_TLS_CERT_FILE", "ELASTUNE_WORKER_TLS_KEY_FILE"
"""What the worker reads (worker/server/pod.py)."""


def redis_ca() -> bytes | None:
    """The operator's own Redis CA bundle, or None when Redis TLS uses no private CA."""
    path = os.environ.get(REDIS_CA_FILE_ENV)
    return Path(path).read_bytes() if path else None


def write_redis_ca(core: client.CoreV1Api, ns: str, ca: bytes) -> None:
    """Create the CA Secret of ``ns``, or patch the one there (a renewed CA reaches the namespace when the
    operator restarts, as its own mount did)."""
    data = {"ca.crt": base64.b64encode(ca).decode()}
    body: Any = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": REDIS_CA_SECRET,
            "namespace": ns,
            "labels": {"app.kubernetes.io/managed-by": "elastune-operator"},
        },
        "type": "Opaque",
        "data": data,
    }
    try:
        core.create_namespaced_secret(ns, body)
        log.info("wrote the Redis CA Secret %s into namespace %s", REDIS_CA_SECRET, ns)
    except ApiException as exc:
        if exc.status != 409:
            raise
        core.patch_namespaced_secret(REDIS_CA_SECRET, ns, {"data": data})


def add_to_worker(pod_spec: dict[str, Any], serving_port: int, redis_url: str) -> None:
    """Mount the Redis CA copy (a ``rediss://`` URL and $ELASTUNE_REDIS_CA_FILE set) and the serving
    certificate ($ELASTUNE_WORKER_TLS_SECRET) into the worker container, with the variables that name
    their files."""
    worker = pod_spec["containers"][0]
    if redis_url.startswith("rediss://") and os.environ.get(REDIS_CA_FILE_ENV):
        _mount(pod_spec, "redis-ca", {"secretName": REDIS_CA_SECRET}, REDIS_CA_DIR)
        worker.setdefault("env", []).append({"name": REDIS_CA_FILE_ENV, "value": f"{REDIS_CA_DIR}/ca.crt"})
    secret = os.environ.get(WORKER_TLS_SECRET_ENV)
    if not secret:
        return
    _mount(pod_spec, "serving-tls", {"secretName": secret}, WORKER_TLS_DIR)
    worker.setdefault("env", []).extend(
        [
            {"name": CERT_FILE_ENV, "value": f"{WORKER_TLS_DIR}/tls.crt"},
            {"name": KEY_FILE_ENV, "value": f"{WORKER_TLS_DIR}/tls.key"},
        ]
    )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = worker.get(probe, {}).get("httpGet")
        if get is not None and get.get("port") == serving_port:
            get["scheme"] = "HTTPS"


def _mount(pod_spec: dict[str, Any], name: str, secret: dict[str, Any], path: str) -> None:
    pod_spec.setdefault("volumes", []).append({"name": name, "secret": secret})
    worker = pod_spec["containers"][0]
    worker.setdefault("volumeMounts", []).append({"name": name, "mountPath": path, "readOnly": True})
