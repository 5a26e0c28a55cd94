"""Adapter placement on a worker: hold what the control plane placed here (issue 15).

The operator writes, per worker, the adapters it should hold (``Bus.set_placement``: adapter id, i.e.
``namespace/name``, -> artifact URL and tier); the worker pulls it with every heartbeat and applies it with
the engine's own vLLM-style load/unload — the same calls a user's ``POST /v1/load_lora_adapter`` makes —
naming the adapter's namespace, so two namespaces' adapters of one name are two adapters here (the
gateway's requests say which one: ``NAMESPACE_HEADER``). Only adapters the placement
loaded are ever unloaded here (one a user loaded by hand stays), and an adapter that running requests
use is unloaded on a later heartbeat, when they are done (the engine refuses it until then).

A failed load is kept with its message (``errors``, published in ``ServingState.placement_errors``) and
not retried until the placement names another URL for it — except a storage failure (s3://: a Secret
or object missing, an endpoint down), retried every STORAGE_RETRY_SECONDS: the operator turns it into
the LoRAAdapter's ``Ready=False`` reason (``placement_reasons``: StorageAccessDenied and the like). An
s3:// artifact is downloaded here, with the Secret the placement names, before the engine loads it.

Loads and unloads run on their own thread (``sync_in_background``, what the heartbeat calls): a slow
download or load never delays the heartbeat, so it cannot expire the worker's registration. One pass
runs at a time; a heartbeat that comes while a pass runs asks for one more pass after it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from elastune_common.bus import Bus
from elastune_contract.protocol import PlacedAdapter, adapter_id, split_adapter_id
from elastune_worker.storage import s3

log = logging.getLogger("elastune.worker")
STORAGE_RETRY_SECONDS = 30.0
STATS_GRACE_SECONDS = 3.0
"""How old a load must be before the engine's adapter list (its last stats) may say it is gone."""


class AdapterSync:
    def __init__(self, bus: Bus, worker_id: str, client: Callable[[], Any]) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.client = client
        """The serving client (EngineServingClient) or None while the engine is not up."""
        self.managed: dict[str, str] = {}
        """Adapters this sync loaded: adapter id (namespace/name) -> the URL it loaded them from. Every
        other map here is keyed by the adapter id too."""
        self.errors: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        """The reason of an error when it has one (StorageError's): ServingState.placement_reasons."""
        self.retry_at: dict[str, float] = {}
        """Storage failures are retried (a Secret or object created, an endpoint back); others are not."""
        self.failed_urls: dict[str, str] = {}
        self.load_seconds: dict[str, float] = {}
        self.loaded_at: dict[str, float] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.passes = 0
        """Passes finished by the background thread (tests, diagnostics)."""

    def sync_in_background(self) -> None:
        """Ask for a pass on the sync thread (started on first use) and return at once."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="adapter-sync", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                self.sync()
            except Exception as exc:  # Redis down or the engine gone: the next heartbeat asks again
                log.warning("adapter placement pass failed: %s", exc)
            self.passes += 1

    def sync(self) -> None:
        """One pass: load what is placed here and missing, unload what is no longer placed."""
        client = self.client()
        if client is None:
            return
        desired = self.bus.placement(self.worker_id)
        self._forget_unloaded_elsewhere(client)
        for name in sorted(set(self.managed) - set(desired)):
            self._unload(client, name)
        for name, placed in desired.items():
            if self.managed.get(name) == placed.url:
                continue
            failed = self.failed_urls.get(name) == placed.url
            if failed and time.monotonic() < self.retry_at.get(name, math.inf):
                continue
            if name in self.managed:  # the artifact moved: load the new one in its place
                self._unload(client, name)
                if name in self.managed:
                    continue  # still in use: next heartbeat
            self._load(client, name, placed)
        for name in set(self.errors) - set(desired):
            self.errors.pop(name, None)
            self.reasons.pop(name, None)
            self.retry_at.pop(name, None)
            self.failed_urls.pop(name, None)

    def _forget_unloaded_elsewhere(self, client: Any) -> None:
        """Level-triggered against the engine, not only against what this sync did: an adapter it loaded
        that the engine no longer has (unloaded through /v1/unload_lora_adapter) is loaded again while
        it stays placed here. The engine's list is a snapshot of its last stats, so a load younger than
        STATS_GRACE_SECONDS is not judged by it."""
        try:
            present = {_loaded_id(a) for a in client.adapters()}
        except Exception:  # the engine restarting: judge next pass
            return
        now = time.monotonic()
        for name in [n for n in self.managed if n not in present]:
            if now - self.loaded_at.get(name, now) >= STATS_GRACE_SECONDS:
                log.warning(
                    "placed adapter %s was unloaded behind the placement's back: loading it again", name
                )
                self.managed.pop(name, None)

    def _load(self, client: Any, name: str, placed: PlacedAdapter) -> None:
        t0 = time.perf_counter()
        namespace, served = split_adapter_id(name)
        try:
            path = placed.url
            if s3.is_s3(path):  # downloaded here, with the Secret the placement names, into the cache
                path = str(s3.download(path, placed.secret))
            if namespace:
                asyncio.run(client.load_lora(served, path, namespace))
            else:
                asyncio.run(client.load_lora(served, path))
        except Exception as exc:  # AdapterError and the like: the operator reports it on the resource
            self.errors[name] = str(exc)
            if isinstance(exc, s3.StorageError):
                self.reasons[name] = exc.reason
                self.retry_at[name] = time.monotonic() + STORAGE_RETRY_SECONDS
            self.failed_urls[name] = placed.url
            log.warning("placed adapter %s did not load from %s: %s", name, placed.url, exc)
            return
        self.load_seconds[name] = time.perf_counter() - t0
        self.managed[name] = placed.url
        self.loaded_at[name] = time.monotonic()
        self.errors.pop(name, None)
        self.reasons.pop(name, None)
        self.retry_at.pop(name, None)
        self.failed_urls.pop(name, None)
        log.info("placed adapter %s loaded from %s in %.2f s", name, placed.url, self.load_seconds[name])

    def _unload(self, client: Any, name: str) -> None:
        namespace, served = split_adapter_id(name)
        try:
            if namespace:
                asyncio.run(client.unload_lora(served, namespace))
            else:
                asyncio.run(client.unload_lora(served))
        except KeyError:
            pass  # already gone (unloaded through the API)
        except Exception as exc:  # in use: the engine refuses until its requests finish
            log.info("adapter %s stays until its requests finish: %s", name, exc)
            return
        self.managed.pop(name, None)
        self.load_seconds.pop(name, None)


def _loaded_id(adapter: Any) -> str:
    """The adapter id of an adapter the engine reports (its reference's namespace and name)."""
    ref = getattr(adapter, "ref", None)
    return adapter_id(getattr(ref, "namespace", ""), adapter.name)
