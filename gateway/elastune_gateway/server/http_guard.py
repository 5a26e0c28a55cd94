"""Bounds on what a client can make the gateway's HTTP server hold before the app (and authentication)
runs: the size of a request's head and the time to send its head and then its body.

uvicorn enforces neither under its default httptools protocol (``uvicorn/protocols/http/
httptools_impl.py``): its only timer is the keep-alive one, armed after a response and cancelled by the
next byte (``_unset_keepalive_if_required`` in ``data_received``), so a client that trickles a header
byte every few seconds holds its connection for ever (slowloris), and llhttp buffers a header of any
length (a 64 MB header was accepted). h11's ``h11_max_incomplete_event_size`` caps the head only under
``--http h11`` and sets no time either. This subclass of uvicorn's protocol adds both, below the ASGI
app: a head over ``max_head_bytes`` gets 431, a head not whole within ``head_timeout_s`` of the
connection (or of the request's first byte on a kept-alive one) gets 408, a body not whole within
``body_timeout_s`` of its head has its connection closed; each then closes the connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class GuardedHttpTools(HttpToolsProtocol):
    max_head_bytes = 32 << 10
    head_timeout_s = 10.0
    body_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._in_head, self._head_bytes = True, 0
        self._guard: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm(self.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:  # counted before parsing: llhttp holds an unfinished header whole
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes:
            self._refuse(_431)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._guard is None:  # the next request on a kept-alive connection: its head's clock starts
            self._arm(self.head_timeout_s)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes = True, 0  # what comes next is the next request's head
        super().on_message_complete()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._guard = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None

    def _expired(self) -> None:
        self._guard = None
        # A head not whole: nothing was answered yet, say why. A body not whole: the app may be
        # answering already; closing is all that is safe.
        self._refuse(_408 if self._in_head else b"")

    def _refuse(self, answer: bytes) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        if answer:
            self.transport.write(answer)
        self.transport.close()


def guarded_protocol(max_head_bytes: int, head_timeout_s: float, body_timeout_s: float) -> type[Any]:
    """uvicorn's ``http=``: its httptools protocol with these bounds."""
    bounds = {
        "max_head_bytes": max_head_bytes,
        "head_timeout_s": head_timeout_s,
        "body_timeout_s": body_timeout_s,
    }
    return type("GuardedHttpTools", (GuardedHttpTools,), bounds)
