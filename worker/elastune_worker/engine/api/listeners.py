"""The metrics port: /metrics on a listener of its own, beside the serving port in the same event loop.

A worker's series name every adapter loaded on it, whichever namespace it belongs to, so Prometheus
scrapes them on a port the NetworkPolicy opens to Prometheus only, and the serving port (the gateway's
and the operator's) answers 404 for /metrics (docs/security.md, issue 39 item 5)."""

from __future__ import annotations

import socket

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from elastune_common.side_server import SideServer, serve_beside

DEFAULT_METRICS_PORT = 9091
"""What a worker pod's metrics port is (the operator's container port ``metrics``; the image's
$ELASTUNE_METRICS_PORT): beside the gateway's, where kube-prometheus-style setups expect an exporter."""


def metrics_app(registry: CollectorRegistry) -> Starlette:
    """GET /metrics and nothing else (404), no API document."""

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


def listen(host: str, port: int) -> socket.socket:
    """A listening socket bound here, so a taken port fails the process at start and port 0's pick is
    known at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections wait in the backlog until the server accepts them
    return sock


class MetricsServer(SideServer):
    """The metrics listener on its bound socket: leaves signals to the serving server, which stops it."""

    def __init__(self, config: uvicorn.Config, sock: socket.socket) -> None:
        super().__init__(config)
        self.sock = sock


class ServingServer(uvicorn.Server):
    """The serving listener; with ``metrics``, it runs that one in its event loop while it serves."""

    def __init__(self, config: uvicorn.Config, metrics: MetricsServer | None = None) -> None:
        super().__init__(config)
        self.metrics = metrics

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if self.metrics is None:
            await super().serve(sockets)
            return
        await serve_beside(
            super().serve(sockets), self.metrics, self.metrics.serve(sockets=[self.metrics.sock])
        )


def metrics_server(registry: CollectorRegistry, sock: socket.socket) -> MetricsServer:
    config = uvicorn.Config(metrics_app(registry), lifespan="off", log_level="warning", access_log=False)
    return MetricsServer(config, sock)
