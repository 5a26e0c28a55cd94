"""One worker pod: the job agent (main thread), the serving engine over the model the agent loaded, the
control plane's adapter placement, and the HTTP server (the Knative contract and /v1 on the serving port,
/metrics on the metrics port: two listeners in one event loop on a background thread). ``server/app.py``
builds it from the command line."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from elastune_common.bus import Bus
from elastune_contract.openai_api.limits import RequestLimits
from elastune_contract.protocol import ServingState, WorkerState, adapter_id
from elastune_worker.coserve.calls import CoServeCalls
from elastune_worker.engine.api.app import create_app
from elastune_worker.engine.api.listeners import ServingServer, listen, metrics_server
from elastune_worker.engine.api.metrics import ServingMetrics
from elastune_worker.engine.core.config import EngineConfig
from elastune_worker.engine.frontend.messages import EngineOp
from elastune_worker.engine.frontend.serving_client import EngineServingClient
from elastune_worker.engine.server import load_lora_modules, start_engine
from elastune_worker.server.agent import Agent, AgentConfig
from elastune_worker.server.control_auth import guard_control
from elastune_worker.server.control_routes import control_router
from elastune_worker.server.coserved import EngineCall
from elastune_worker.server.drain import DEFAULT_DRAIN_SECONDS, Drain, DrainMiddleware, drain_then
from elastune_worker.server.metrics import WorkerMetrics
from elastune_worker.server.models import LoadedModel
from elastune_worker.server.placement import AdapterSync
from elastune_worker.server.request_auth import guard_inference

log = logging.getLogger("elastune.worker")
HTTP_STOP_S = 3.0
TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV = "ELASTUNE_WORKER_TLS_CERT_FILE", "ELASTUNE_WORKER_TLS_KEY_FILE"
"""The serving certificate and key (PEM; the chart's gateway.workerTLS): set, the serving port speaks
HTTPS only and the worker registers an https:// URL, which a gateway with the worker CA requires."""
"""How long the HTTP server may take to close after the drain (connections left open by clients)."""


@dataclass
class EngineSettings:
    """How the pod runs its serving engine (the engine flags of the command line)."""

    config: EngineConfig
    in_thread: bool
    threads: int | None
    cpus: str
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    """Adapters loaded at start-up: (served name, path)."""


class WorkerPod:
    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        pool: str,
        model: str,
        served_name: str,
        engine: EngineSettings | None,
        limits: RequestLimits,
        max_queued_requests: int | None = None,
        drain_seconds: float = DEFAULT_DRAIN_SECONDS,
    ) -> None:
        """``engine`` None: tune only, /v1 answers 503; ``max_queued_requests``: past it, 503 too;
        ``drain_seconds``: how long a SIGTERM waits for requests in flight (server/drain.py)."""
        self.bus, self.worker_id, self.served_name = bus, worker_id, served_name
        self.drain, self.drain_seconds = Drain(), drain_seconds
        self.engine_settings = engine
        self.metrics = WorkerMetrics()
        self.serving_metrics = ServingMetrics(self.metrics.registry, served_name)
        self.engine: EngineServingClient | None = None
        """The serving engine's client once it started (after the model loaded); None before, and for
        good when tuning only or when the engine cannot run the model."""
        self.placement = AdapterSync(bus, worker_id, lambda: self.engine)
        self.agent = Agent(
            AgentConfig(
                worker_id=worker_id,
                pool=pool,
                model=model,
                on_loaded=self.start_engine if engine is not None else None,
                serving_state=self.serving_state,
                on_heartbeat=self.placement.sync_in_background,  # loads never hold up the heartbeat
                engine_call=self.engine_call,
                draining=lambda: self.drain.draining,
            ),
            bus,
            self.metrics,
        )
        self.app = create_app(
            lambda: self.engine,
            metrics=self.serving_metrics,
            control=control_router(self.agent),
            limits=limits,
            max_queued_requests=max_queued_requests,
        )
        guard_control(self.app)  # adapter load/unload, /status: only with the control token
        refused = self.metrics.credential_refused
        guard_inference(self.app, lambda reason: refused.labels(reason).inc())  # /v1 only for the gateway
        self.app.add_middleware(DrainMiddleware, drain=self.drain)  # outermost: counts every stream
        self._http: uvicorn.Server | None = None
        self._http_thread: threading.Thread | None = None

    # -- start, serve, shut down --------------------------------------------------------------------
    def start_http(self, host: str, port: int, advertise: str | None, metrics_port: int = 0) -> str:
        """Serve the pod's app from a background thread (the agent owns the main thread), /metrics on
        ``metrics_port`` beside it, and register the URLs other pods reach them at; port 0 picks a free
        one. Returns the serving URL."""
        self._http, self._http_thread, bound, scraped = _serve_in_thread(
            self.app, self.metrics, host, port, metrics_port
        )
        reached = advertised_host(host, advertise)
        scheme = "https" if self._http.config.ssl_certfile else "http"
        self.agent.record.url = f"{scheme}://{reached}:{bound}"
        self.agent.record.metrics_url = f"http://{reached}:{scraped}/metrics"
        return self.agent.record.url

    def serve(self) -> None:
        """Load the model, start the engine, then run assignments until ``stop``."""
        self.agent.run_forever()

    def stop(self) -> None:
        """Stop after the current assignment."""
        self.agent.stop()

    def begin_drain(self) -> None:
        """SIGTERM: drain on a thread of its own (not ready, out of the registry, requests in flight
        finished within ``drain_seconds``), then stop."""
        threading.Thread(
            target=drain_then,
            args=(self.drain, self.drain_seconds, self._leave_registry, self.stop),
            name="drain",
            daemon=True,
        ).start()

    def _leave_registry(self) -> None:
        if self.agent.record.state is not WorkerState.FAILED:
            self.bus.leave(self.worker_id)  # a pool's Redis user may DEL its keys, not SREM the id set

    def shutdown(self) -> None:
        """Stop the HTTP server once its responses are sent, and leave the registry (a FAILED worker
        stays listed with its reason)."""
        if self._http is not None:
            self._http.should_exit = True
            thread = self._http_thread
            if thread is not None:
                thread.join(timeout=HTTP_STOP_S)
        if self.engine is not None:  # the engine process ignores signals: the pod ends it
            self.engine.close()
        self._leave_registry()
        self.bus.close()

    # -- the serving engine ---------------------------------------------------------------------------
    def start_engine(self, loaded: LoadedModel) -> None:
        """The serving engine over the loaded model directory, started before the worker reports READY.
        A model the engine cannot run leaves the worker tuning only; /v1 then answers 503 with the
        reason."""
        settings = self.engine_settings
        assert settings is not None
        try:
            engine = start_engine(
                loaded.path,
                settings.config,
                settings.in_thread,
                tokenizer=loaded.tokenizer,
                threads=settings.threads,
                cpus=settings.cpus,
                calls=CoServeCalls(),  # the agent's co-served assignments (the engine never imports them)
            )
        except Exception as exc:
            log.error("serving is unavailable on this worker: %s", exc)
            return
        client = EngineServingClient(engine, self.served_name)
        try:
            load_lora_modules(client, settings.lora_modules)
        except Exception as exc:  # a bad start-up adapter is the operator's error: say it, serve the rest
            log.error("a --lora-modules adapter did not load: %s", exc)
        self.serving_metrics.watch_engine(self.metrics.registry, client.stats, client.lora_info)
        self.engine = client
        log.info("serving %s (context %d tokens) on /v1", self.served_name, client.max_model_len)

    def serving_state(self) -> ServingState | None:
        """What the pod serves, with the placement's errors and load times (each heartbeat)."""
        client = self.engine
        if client is None:
            return None
        state = client.serving_state()
        state.placement_errors = dict(self.placement.errors)
        state.placement_reasons = dict(self.placement.reasons)
        for adapter in state.adapters:
            key = adapter_id(adapter.namespace, adapter.name)
            adapter.load_seconds = self.placement.load_seconds.get(key)
        return state

    def engine_call(self) -> EngineCall | None:
        """A blocking call into the engine for the agent's co-served assignments; None without one."""
        client = self.engine
        if client is None:
            return None

        def call(op: EngineOp, arg: Any) -> Any:
            return asyncio.run(client.engine.call(op, arg))

        return call


def advertised_host(bind: str, advertise: str | None) -> str:
    """What the worker registers: on a cluster its pod IP (127.0.0.1 there is the caller's own pod);
    bound to one address, that one; bound to all of them on one machine, loopback."""
    if advertise:
        return f"[{advertise}]" if ":" in advertise else advertise
    return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind


def _serve_in_thread(
    app: Any, metrics: WorkerMetrics, host: str, port: int, metrics_port: int
) -> tuple[uvicorn.Server, threading.Thread, int, int]:
    """uvicorn on a daemon thread over sockets bound here (a taken port fails the start; the bound ports
    are known at once): the serving port, and the metrics port's server in the same event loop."""
    sock, scraped = listen(host, port), listen(host, metrics_port)
    # Once told to exit, uvicorn waits for open responses; by then the drain has let them finish, so the
    # bound is for a stuck connection only.
    cert, key = os.environ.get(TLS_CERT_FILE_ENV) or None, os.environ.get(TLS_KEY_FILE_ENV) or None
    if (cert is None) != (key is None):
        raise SystemExit(f"worker TLS needs both ${TLS_CERT_FILE_ENV} and ${TLS_KEY_FILE_ENV}")
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=HTTP_STOP_S,
        ssl_certfile=cert, ssl_keyfile=key,  # /metrics stays plain HTTP on its own port (scraped in-cluster)
    )  # fmt: skip
    if cert:
        config.load()  # here, so that an unreadable certificate fails the start, not the server thread
    server = ServingServer(config, metrics_server(metrics.registry, scraped))
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # main thread's job (older uvicorn)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
    thread.start()
    return server, thread, sock.getsockname()[1], scraped.getsockname()[1]
