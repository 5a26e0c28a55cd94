"""The operator's side of API keys (issue 25 item 2): labelled Secrets in, the hashed key map out.

The operator reads API key Secrets (``elastune.dev/api-key: "true"``) in the namespaces it watches and
publishes to Redis only each key's SHA-256 with its scope and limits (``elastune_contract.api_keys``);
the gateway never reads Secrets. The map is rewritten on every Secret event (created, changed, deleted,
label removed) and re-asserted every ``period_s`` (a Redis restarted empty, a FLUSHALL, a model added to
a namespace whose keys reach all its models), so a revoked key stops working within seconds.

A key's scope is resolved here: the models it names (``models``), or all of its namespace's (its
WarmPools' models, its LoRAAdapters and published prompts), never another namespace's. After a start the
map is first written once ``grace_s`` has passed, so the Secrets kopf lists at startup are all known
before it is replaced (a restart does not revoke keys for a moment).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from elastune_contract.api.warmpool import ALL_NAMESPACES
from elastune_contract.api_keys import (
    InvalidApiKeySecret,
    KeySecret,
    is_api_key_secret,
    key_map,
    publish,
    read_secret,
)

log = logging.getLogger("elastune.operator")

NamespaceModels = Callable[[], Mapping[str, Iterable[str]]]


class ApiKeyPublisher:
    def __init__(
        self,
        redis: Any,
        ns: str,
        namespace_models: NamespaceModels,
        *,
        period_s: float = 5.0,
        grace_s: float = 3.0,
    ) -> None:
        self.redis, self.ns = redis, ns
        self.namespace_models = namespace_models
        self.period_s, self.grace_s = period_s, grace_s
        self._secrets: dict[str, KeySecret] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0
        """Writes of the map so far."""
        self.last_error: str | None = None

    # -- Secret events ------------------------------------------------------------------------------
    def seen(self, doc: Mapping[str, Any]) -> None:
        """A Secret was listed, created or changed: a key if labelled and valid, else none."""
        meta = doc.get("metadata") or {}
        sid = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        if not is_api_key_secret(doc):
            self.deleted(sid)
            return
        try:
            secret: KeySecret | None = read_secret(doc)
        except InvalidApiKeySecret as exc:
            log.warning("ignoring API key %s (no key from it works): %s", sid, exc)
            secret = None
        with self._lock:
            changed = self._secrets.get(sid) != secret
            if secret is None:
                self._secrets.pop(sid, None)
            else:
                self._secrets[sid] = secret
        if changed:
            self._wake.set()

    def deleted(self, sid: str) -> None:
        with self._lock:
            gone = self._secrets.pop(sid, None) is not None
        if gone:
            log.info("API key %s removed: it stops working with the next read of the map", sid)
            self._wake.set()

    # -- publishing ---------------------------------------------------------------------------------
    def publish_now(self) -> int:
        """Write the whole map (digests, scopes, limits); the number of keys in it."""
        with self._lock:
            secrets = list(self._secrets.values())
        records = key_map(secrets, self.namespace_models())
        publish(self.redis, self.ns, records)
        self.published += 1
        return len(records)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="api-keys", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        self._stop.wait(self.grace_s)
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.publish_now()
                if self.last_error is not None:
                    log.info("API key map published again")
                self.last_error = None
            except Exception as exc:  # Redis away: try again next period
                if self.last_error is None:
                    log.warning("cannot publish the API key map: %s", exc)
                self.last_error = str(exc)
            self._wake.wait(self.period_s)
            time.sleep(0.05)  # a burst of events: one write


class ScopedModels(dict[str, set[str]]):
    """namespace → served names, where a namespace not listed (and every listed one) also reaches the
    models of the WarmPools that admit every namespace (``allowedNamespaces: ["*"]``)."""

    def __init__(self, everyone: set[str]) -> None:
        super().__init__()
        self.everyone = everyone

    def get(self, namespace: str, default: Any = None) -> set[str]:
        return super().get(namespace, set()) | self.everyone


def namespace_models(pools: Iterable[Any], adapters: Iterable[Any]) -> dict[str, set[str]]:
    """namespace → the served names its keys may reach by default: the models of its WarmPools and of
    the WarmPools that admit it (spec.allowedNamespaces; ``*``: every namespace), and its LoRAAdapters
    (and published prompts) — the names the gateway resolves for a caller of that namespace."""
    everyone = {p.spec.model for p in pools if ALL_NAMESPACES in (p.spec.allowed_namespaces or ())}
    out = ScopedModels(everyone)
    for p in pools:
        out.setdefault(p.metadata.namespace or "default", set()).add(p.spec.model)
        for ns in p.spec.allowed_namespaces or ():
            if ns != ALL_NAMESPACES:
                out.setdefault(ns, set()).add(p.spec.model)
    for a in adapters:
        out.setdefault(a.namespace, set()).add(a.name)
    return out
