"""What the request path takes of one client request and what it gives back, free of any web framework:
the completion routes are served as raw ASGI (``completions.py``), so the path neither builds nor
returns Starlette objects."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from .auth import Principal, Reservation
from .fair_line import Ticket


@dataclass(slots=True)
class Call:
    """One client request: its body as it came and the headers the path reads."""

    raw: bytes
    principal: Principal | None = None
    request_id: str | None = None
    slo_ttft_ms: str | None = None
    """The ``x-slo-ttft-ms`` header as sent (validated by the path)."""
    slo_tpot_ms: str | None = None
    model: str | None = None
    """The resolved model's name once known (the metrics label; unknown names get none)."""
    namespace: str = ""
    """The resolved model's namespace (an adapter's; a base model's WarmPool's): the metrics label
    ``model_namespace`` next to ``model``."""
    ticket: Ticket | None = None
    """Its place in the fair line (``fair_share``): released when its answer is over."""
    priority_ignored: bool = False
    """It set ``priority`` and its key may not (the answer says so in a header)."""
    reservation: Reservation | None = None
    """The tokens it reserved against its key's tokens/min at admission: settled once, when its answer
    ends (or given back when it ends before reaching a worker)."""


@dataclass(slots=True)
class Whole:
    """An answer read whole from the worker (or an error the worker gave)."""

    status: int
    content_type: bytes
    body: bytes
    endpoint: str


@dataclass(slots=True)
class Stream:
    """A streamed answer: iterate ``chunks`` (each ready to send as it is, with whether it is the last),
    then call ``close`` whether or not they were all sent (a client gone early: the worker's connection
    is closed)."""

    endpoint: str
    chunks: AsyncGenerator[tuple[bytes, bool], None]
    close: Callable[[], None]


Answer = Whole | Stream
