"""A second uvicorn listener in another server's event loop (the gateway's and the workers' metrics ports):
it leaves signal handling to the main server, which stops it when it stops."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any

import uvicorn


class SideServer(uvicorn.Server):
    """A listener that installs no signal handlers: the main server's SIGTERM ends both."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_beside(
    main: Coroutine[Any, Any, None], side: uvicorn.Server, side_run: Coroutine[Any, Any, None]
) -> None:
    """Run ``side_run`` (``side``'s serve) while ``main`` serves; stop ``side`` when ``main`` ends."""
    task = asyncio.create_task(side_run)
    try:
        await main
    finally:
        side.should_exit = True
        await task
