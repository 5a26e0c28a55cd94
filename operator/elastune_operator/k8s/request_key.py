"""Each pool namespace's request key (issue 39 item 3; ``elastune_contract.request_credential``).

The operator holds the gateway's secret (``$ELASTUNE_REQUEST_KEY``, the chart's operator-keys Secret,
``request-key``) and writes into every WarmPool namespace a Secret with that namespace's derived key
only, which the pool's worker pods mount: a pod of one namespace can check credentials for its own
workers and sign for no other namespace's. Like the worker control token it is created once and never
read back (create is the only verb the chart grants on Secrets of any name); rotating the secret means
deleting these Secrets and the pods, which the operator then writes and starts again.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from elastune_contract.request_credential import (
    KEY_FILE_ENV,
    REQUEST_KEY_DIR,
    REQUEST_KEY_KEY,
    REQUEST_KEY_SECRET,
    namespace_key,
)

log = logging.getLogger("elastune.workload")

VOLUME = "request-key"


def secret_body(ns: str, secret: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": REQUEST_KEY_SECRET,
            "namespace": ns,
            "labels": {"app.kubernetes.io/managed-by": "elastune-operator"},
        },
        "type": "Opaque",
        "data": {REQUEST_KEY_KEY: base64.b64encode(namespace_key(secret, ns)).decode()},
    }


def write_secret(core: client.CoreV1Api, ns: str, secret: bytes) -> None:
    """Create the Secret of ``ns`` (a 409 leaves the one there)."""
    try:
        body: Any = secret_body(ns, secret)  # the client takes a dict as it takes a V1Secret
        core.create_namespaced_secret(ns, body)
        log.info("wrote the worker request key Secret %s into namespace %s", REQUEST_KEY_SECRET, ns)
    except ApiException as exc:
        if exc.status != 409:
            raise


def add_to_pod(pod_spec: dict[str, Any]) -> None:
    """Mount the Secret into the worker container and name the file to it. Not optional: a worker
    without its key would serve anyone (request_auth.py), so the pod waits for the Secret instead."""
    items = [{"key": REQUEST_KEY_KEY, "path": REQUEST_KEY_KEY}]
    pod_spec.setdefault("volumes", []).append(
        {"name": VOLUME, "secret": {"secretName": REQUEST_KEY_SECRET, "items": items}}
    )
    worker = pod_spec["containers"][0]
    worker.setdefault("volumeMounts", []).append(
        {"name": VOLUME, "mountPath": REQUEST_KEY_DIR, "readOnly": True}
    )
    worker.setdefault("env", []).append(
        {"name": KEY_FILE_ENV, "value": f"{REQUEST_KEY_DIR}/{REQUEST_KEY_KEY}"}
    )
