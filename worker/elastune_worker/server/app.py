"""The worker process: the Knative container contract on $PORT plus the job agent.

    python -m elastune_worker serve --pool tiny-gpt2 --model elastune/tiny-gpt2 --redis-url redis://...

- ``GET /healthz`` 200 while the process serves (liveness).
- ``GET /readyz`` 200 only once the runtime and weights are loaded — that is what "warm" means; 503
  with the reason before that, or for good when the model cannot load.
- ``GET /metrics`` Prometheus text (WorkerMetrics).
- ``GET /status`` the worker's record as JSON.
Jobs arrive by pull (the agent pops its Redis queue), so nothing here accepts work over HTTP.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from elastune_contract.protocol import Bus, BusUnreachable, WorkerState
from elastune_worker.server.agent import Agent, AgentConfig, default_worker_id
from elastune_worker.server.metrics import WorkerMetrics

log = logging.getLogger("elastune.worker")


def make_handler(agent: Agent, metrics: WorkerMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "elastune-worker"

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: object) -> None:
            self._send(code, (json.dumps(obj) + "\n").encode())

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._json(200, {"status": "ok"})
            elif path == "/readyz":
                rec = agent.snapshot()
                if agent.ready:
                    self._json(200, {"status": "ready", "state": rec["state"]})
                else:
                    self._json(
                        503, {"status": "not ready", **{k: rec[k] for k in ("state", "reason", "message")}}
                    )
            elif path == "/metrics":
                self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/status":
                self._json(200, agent.snapshot())
            else:
                self._json(
                    404, {"error": f"no such endpoint {path!r}; try /healthz, /readyz, /metrics, /status"}
                )

        def do_POST(self) -> None:
            self._json(405, {"error": "workers take jobs from their Redis queue, not over HTTP"})

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler


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
        "--port", type=int, default=int(os.environ.get("PORT", "8080")), help="[$PORT, Knative sets it]"
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU workers sharing a machine)")
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
    agent = Agent(AgentConfig(worker_id=worker_id, pool=args.pool, model=args.model), bus, metrics)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(agent, metrics))
    host = "127.0.0.1" if args.host == "0.0.0.0" else args.host
    agent.record.url = f"http://{host}:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("worker %s of pool %s serving on %s", worker_id, args.pool, agent.record.url)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping after the current job", signum)
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run_forever()
    finally:
        server.shutdown()
        if agent.record.state is not WorkerState.FAILED:
            bus.forget_worker(worker_id)
        bus.close()
    return 0
