"""A pure ASGI middleware both HTTP servers (worker, gateway) use to count responses by status code.

Starlette's ``@app.middleware("http")`` (BaseHTTPMiddleware) re-streams every body chunk of a streaming
response through an extra task and memory stream: on a worker streaming SSE tokens at saturation that
was over half of the API process's CPU (py-spy, `elastune bench serve`). This hook only looks at the
``http.response.start`` message, so a streamed token costs one extra function call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class ResponseStatusHook:
    """Calls ``on_response(scope, status)`` once per HTTP response, when it starts (the handler has run
    by then, so what it stored in ``request.state`` is in ``scope["state"]``)."""

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        on_response: Callable[[Scope, int], None],
    ) -> None:
        self.app = app
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def hooked(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.on_response(scope, int(message["status"]))
            await send(message)

        await self.app(scope, receive, hooked)
