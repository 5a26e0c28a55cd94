"""The pod world's Service proxy (testing/elastune_testing/podworld/controllers.py), on loopback: no
namespaces, so it runs unprivileged. The pod world itself is tested as root in tests/cluster."""

from __future__ import annotations

import gc
import socket
import sys
import threading
from types import SimpleNamespace
from typing import Any

from kubernetes import client

from elastune_testing.podworld.controllers import Services


def _echo_server() -> tuple[socket.socket, int]:
    """A 'pod' on 127.0.0.1 that echoes each connection until its peer closes."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _proxy_to(pod_port: int) -> Services:
    pod = SimpleNamespace(
        namespace="ns", ready=True, ip="127.0.0.1", stopping=False,
        obj={"metadata": {"labels": {"app": "echo"}}, "spec": {"containers": [{"name": "c"}]}},
    )  # fmt: skip
    kubelet: Any = SimpleNamespace(pods={"ns/echo-0": pod})
    services = Services(client.ApiClient(), kubelet, network=Any, on_change=lambda: None)  # type: ignore[arg-type]
    key = ("ns", "echo")
    services.addresses[key] = "127.0.0.1"
    services._specs[key] = {"spec": {"selector": {"app": "echo"}}}
    with socket.socket() as probe:  # a free port for the Service
        probe.bind(("127.0.0.1", 0))
        svc_port = probe.getsockname()[1]
    services._listen(key, {"port": svc_port, "targetPort": pod_port})
    services.svc_port = svc_port  # type: ignore[attr-defined]
    return services


def test_stopping_with_connections_open_closes_them_and_leaves_nothing_behind() -> None:
    """A world torn down while a client still holds a proxied connection: stop() ends the forwarding
    tasks on the proxy's own loop and closes the loop. Before, the tasks were left pending on a loop
    that was stopped but never closed, and when both were collected later each task's cleanup ran on
    the closed loop: 'Event loop is closed' reported in whatever test was running then."""
    pod, pod_port = _echo_server()
    services = _proxy_to(pod_port)
    conn = socket.create_connection(("127.0.0.1", services.svc_port), timeout=5)  # type: ignore[attr-defined]
    conn.sendall(b"ping")
    assert conn.recv(4) == b"ping"  # forwarded both ways

    unraisable: list[Any] = []
    old_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        services.stop()
        loop = services.loop
        del services
        gc.collect()
        assert loop.is_closed()
        assert conn.recv(1) == b""  # the proxy closed the client's side
    finally:
        sys.unraisablehook = old_hook
        conn.close()
        pod.close()
    assert [str(u.exc_value) for u in unraisable] == []
