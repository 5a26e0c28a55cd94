"""The worker process: the container contract on $PORT plus the job agent.

    python -m elastune_worker serve --pool tiny-gpt2 --model elastune/tiny-gpt2 --redis-url redis://...

- ``GET /healthz`` 200 while the process serves (liveness).
- ``GET /readyz`` 200 only once the runtime and weights are loaded — that is what "warm" means; 503
  with the reason before that, or for good when the model cannot load.
- ``GET /metrics`` Prometheus text (WorkerMetrics, the engine's series) on --metrics-port only: the
  series name every namespace's adapters on the pod, so the serving port answers 404 for it.
- ``GET /status`` the worker's record as JSON.
- ``/v1/...`` the OpenAI-compatible serving API (engine/api), ``/openapi.json`` its document.
Tuning jobs arrive by pull (the agent pops its Redis queue), not over HTTP. The pod itself (agent,
engine, HTTP server): server/pod.py. SIGTERM drains (server/drain.py): not ready, out of the registry,
requests in flight finished within --drain-seconds, then exit; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from elastune_common.bus import Bus, BusUnreachable
from elastune_contract.openai_api.limits import limits_from
from elastune_worker.engine.server import add_engine_args, engine_config, lora_modules
from elastune_worker.server.agent import default_worker_id
from elastune_worker.server.drain import DEFAULT_DRAIN_SECONDS
from elastune_worker.server.pod import EngineSettings, WorkerPod

log = logging.getLogger("elastune.worker")


def _parser() -> argparse.ArgumentParser:
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
        help="default: $POD_NAMESPACE/$POD_NAME or pool-host-pid",
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
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("ELASTUNE_METRICS_PORT", "0")),
        help="the only port serving /metrics [$ELASTUNE_METRICS_PORT; worker pods and the image: 9091]; "
        "default: a free one (several workers share a machine), registered as the record's metrics_url",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU workers sharing a machine)")
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=float(os.environ.get("ELASTUNE_DRAIN_SECONDS", DEFAULT_DRAIN_SECONDS)),
        help="after SIGTERM, how long requests in flight may take to finish before the worker exits; keep "
        "it under the pod's terminationGracePeriodSeconds [$ELASTUNE_DRAIN_SECONDS]",
    )
    p.add_argument("--no-serve", action="store_true", help="tune only: no serving engine on /v1")
    # No CPU binding by default: every worker on a host would take the same CPUs (several local workers,
    # a test stack), and its own tuning shares the process. A pod with exclusive CPUs (Kubernetes'
    # static CPU manager) can ask for --engine-cpus auto.
    add_engine_args(p, engine_cpus="none")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
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
    pod = WorkerPod(
        bus,
        worker_id=args.worker_id or default_worker_id(args.pool),
        pool=args.pool,
        model=args.model,
        served_name=args.served_model_name or args.model,
        engine=None if args.no_serve else _engine_settings(args),
        limits=limits_from(args),
        max_queued_requests=args.max_queued_requests,
        drain_seconds=args.drain_seconds,
    )
    url = pod.start_http(args.host, args.port, args.advertise_host, args.metrics_port)
    log.info(
        "worker %s of pool %s serving on %s, /metrics on %s",
        pod.worker_id, args.pool, url, pod.agent.record.metrics_url,
    )  # fmt: skip

    def on_signal(signum: int, _frame: object) -> None:
        if pod.drain.draining:  # a second signal: stop now
            log.info("signal %d while draining: stopping after the current job", signum)
            pod.stop()
            return
        log.info("signal %d: draining", signum)
        pod.begin_drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        pod.serve()
    finally:
        pod.shutdown()
    return 0


def _engine_settings(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(
        config=engine_config(args),
        in_thread=args.engine_in_thread,
        threads=args.engine_threads,
        cpus=args.engine_cpus,
        lora_modules=lora_modules(args),
    )
