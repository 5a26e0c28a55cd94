"""The worker process: the Knative container contract on $PORT plus the job agent.

    python -m elastune_worker serve --pool tiny-gpt2 --model elastune/tiny-gpt2 --redis-url redis://...

- ``GET /healthz`` 200 while the process serves (liveness).
- ``GET /readyz`` 200 only once the runtime and weights are loaded — that is what "warm" means; 503
  with the reason before that, or for good when the model cannot load.
- ``GET /metrics`` Prometheus text (WorkerMetrics).
- ``GET /status`` the worker's record as JSON.
- ``/v1/...`` the OpenAI-compatible serving API (serving/api), ``/openapi.json`` its document.
Tuning jobs arrive by pull (the agent pops its Redis queue), not over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from elastune_contract.openai_api.limits import limits_from
from elastune_contract.protocol import Bus, BusUnreachable, ServingState, WorkerState
from elastune_worker.server.agent import Agent, AgentConfig, default_worker_id
from elastune_worker.server.control_auth import guard_control
from elastune_worker.server.metrics import WorkerMetrics
from elastune_worker.server.models import LoadedModel
from elastune_worker.server.placement import AdapterSync
from elastune_worker.serving.api.app import create_app
from elastune_worker.serving.api.metrics import ServingMetrics
from elastune_worker.serving.config import EngineConfig
from elastune_worker.serving.frontend.client import EngineServingClient
from elastune_worker.serving.frontend.messages import EngineOp
from elastune_worker.serving.server import (
    add_engine_args,
    engine_config,
    load_lora_modules,
    lora_modules,
    start_engine,
)

log = logging.getLogger("elastune.worker")


def control_router(agent: Agent, metrics: WorkerMetrics) -> APIRouter:
    """The Knative container contract: liveness, readiness (= warm), metrics, the worker's record."""
    router = APIRouter(tags=["worker"])

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz", responses={503: {"description": "not warm yet, or the model cannot load"}})
    def readyz() -> JSONResponse:
        rec = agent.snapshot()
        if agent.ready:
            return JSONResponse({"status": "ready", "state": rec["state"]})
        body = {"status": "not ready", **{k: rec[k] for k in ("state", "reason", "message")}}
        return JSONResponse(body, status_code=503)

    @router.get("/health", responses={503: {"description": "not warm yet"}})
    def health() -> Response:
        """vLLM's health route, which peer routers (vllm-router, SGLang's smg) probe: 200 once warm."""
        return Response(status_code=200 if agent.ready else 503)

    @router.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/status")
    def status() -> dict[str, object]:
        return agent.snapshot()

    return router


def start_http(app: FastAPI, host: str, port: int) -> tuple[uvicorn.Server, int]:
    """Serve ``app`` from a background thread (the job agent owns the main thread); returns the bound
    port (``port`` 0 picks a free one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections wait in the backlog until the server thread accepts them
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # main thread's job
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True).start()
    return server, sock.getsockname()[1]


def _start_serving(
    holder: dict[str, EngineServingClient],
    config: EngineConfig,
    name: str,
    metrics: ServingMetrics,
    registry: CollectorRegistry,
    in_thread: bool,
    threads: int | None,
    cpus: str,
    loaded: LoadedModel,
    *,
    modules: list[tuple[str, str]],
) -> None:
    """The serving engine over the same model directory, started before the worker reports READY. A
    model the engine cannot run leaves the worker tuning only; /v1 then answers 503 with the reason."""
    try:
        engine = start_engine(
            loaded.path, config, in_thread, tokenizer=loaded.tokenizer, threads=threads, cpus=cpus
        )
    except Exception as exc:
        log.error("serving is unavailable on this worker: %s", exc)
        return
    client = EngineServingClient(engine, name)
    try:
        load_lora_modules(client, modules)
    except Exception as exc:  # a bad start-up adapter is the operator's error: say it, serve the rest
        log.error("a --lora-modules adapter did not load: %s", exc)
    metrics.watch_engine(registry, client.stats, client.lora_info)
    holder["client"] = client
    log.info("serving %s (context %d tokens) on /v1", name, client.max_model_len)


def advertised_host(bind: str, advertise: str | None) -> str:
    """What the worker registers: on a cluster its pod IP (127.0.0.1 there is the caller's own pod);
    bound to one address, that one; bound to all of them on one machine, loopback."""
    if advertise:
        return f"[{advertise}]" if ":" in advertise else advertise
    return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune worker", description="Run one Elastune worker (one GPU).")
    p.add_argument("--pool", default=os.environ.get("ELASTUNE_POOL"), help="WarmPool name [$ELASTUNE_POOL]")
    p.add_argument("--model", default=os.environ.get("ELASTUNE_MODEL"), help="LLM to load [$ELASTUNE_MODEL]")
    p.add_argument(
        "--redis-url",
        default=os.environ.get("ELASTUNE_REDIS_URL"),
        help="control Redis [$ELASTUNE_REDIS_URL]",
    )
    p.add_argument(
        "--namespace", default=os.environ.get("ELASTUNE_NAMESPACE", "elastune"), help="Redis key prefix"
    )
    p.add_argument(
        "--worker-id",
        default=os.environ.get("ELASTUNE_WORKER_ID"),
        help="default: $POD_NAME or pool-host-pid",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument(
        "--advertise-host",
        default=os.environ.get("POD_IP"),
        help="address other pods reach this worker at, registered for the gateway [$POD_IP, the pod's "
        "IP from the downward API]; default: --host, or 127.0.0.1 when --host is 0.0.0.0 (one machine)",
    )
    p.add_argument(
        "--port", type=int, default=int(os.environ.get("PORT", "8080")), help="[$PORT, Knative sets it]"
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU workers sharing a machine)")
    p.add_argument("--no-serve", action="store_true", help="tune only: no serving engine on /v1")
    # No CPU binding by default: every worker on a host would take the same CPUs (several local workers,
    # a test stack), and its own tuning shares the process. A pod with exclusive CPUs (Kubernetes'
    # static CPU manager) can ask for --engine-cpus auto.
    add_engine_args(p, engine_cpus="none")
    args = p.parse_args(argv)
    missing = [
        flag
        for flag, v in (("--pool", args.pool), ("--model", args.model), ("--redis-url", args.redis_url))
        if not v
    ]
    if missing:
        p.error(f"missing {', '.join(missing)} (or the matching ELASTUNE_* environment variables)")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    bus = Bus(args.redis_url, args.namespace)
    try:
        bus.ping()
    except BusUnreachable as exc:
        print(f"elastune worker: {exc}", file=sys.stderr)
        return 2
    worker_id = args.worker_id or default_worker_id(args.pool)
    metrics = WorkerMetrics()
    serving: dict[str, EngineServingClient] = {}
    name = args.served_model_name or args.model
    serving_metrics = ServingMetrics(metrics.registry, name)
    on_loaded = None
    if not args.no_serve:
        config = engine_config(args)
        on_loaded = functools.partial(
            _start_serving,
            serving,
            config,
            name,
            serving_metrics,
            metrics.registry,
            args.engine_in_thread,
            args.engine_threads,
            args.engine_cpus,
            modules=lora_modules(args),
        )

    placement = AdapterSync(bus, worker_id, lambda: serving.get("client"))

    def serving_state() -> ServingState | None:
        client = serving.get("client")
        if client is None:
            return None
        state = client.serving_state()
        state.placement_errors = dict(placement.errors)
        state.placement_reasons = dict(placement.reasons)
        for adapter in state.adapters:
            adapter.load_seconds = placement.load_seconds.get(adapter.name)
        return state

    def engine_call() -> Callable[[EngineOp, Any], Any] | None:
        client = serving.get("client")
        if client is None:
            return None
        return lambda op, arg: asyncio.run(client.engine.call(op, arg))

    agent = Agent(
        AgentConfig(
            worker_id=worker_id,
            pool=args.pool,
            model=args.model,
            on_loaded=on_loaded,
            serving_state=serving_state,
            on_heartbeat=placement.sync_in_background,  # loads never hold up the heartbeat
            engine_call=engine_call,
        ),
        bus,
        metrics,
    )
    app = create_app(
        lambda: serving.get("client"),
        metrics=serving_metrics,
        control=control_router(agent, metrics),
        limits=limits_from(args),
    )
    guard_control(app)  # adapter load/unload, /status: only with the control token
    server, port = start_http(app, args.host, args.port)
    host = advertised_host(args.host, args.advertise_host)
    agent.record.url = f"http://{host}:{port}"
    log.info("worker %s of pool %s serving on %s", worker_id, args.pool, agent.record.url)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping after the current job", signum)
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run_forever()
    finally:
        server.should_exit = True
        if agent.record.state is not WorkerState.FAILED:
            bus.forget_worker(worker_id)
        bus.close()
    return 0
