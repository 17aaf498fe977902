"""The body size limit, enforced for every route without buffering an unbounded body.

``Content-Length`` over the limit is refused before a byte of the body is read.
A body without one (chunked) is counted while it streams, and refused the
moment it passes the limit, so a client cannot make the server hold more than
the limit in memory.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.api import problems

MAX_BODY_BYTES = 64 * 1024


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"the request body is larger than {limit} bytes; nothing was stored")


class BodyLimit:
    """Pure ASGI middleware (no ``BaseHTTPMiddleware``: it would buffer and break streaming)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lengths = [v for k, v in scope["headers"] if k == b"content-length"]
        if lengths:
            try:
                declared = int(lengths[0])
                valid = len(lengths) == 1 and declared >= 0 and lengths[0].isdigit()
            except ValueError:
                valid = False
            if not valid:
                bad = HTTPException(400, "the Content-Length header is invalid")
                await problems.render(bad)(scope, receive, send)
                return
            if declared > self.limit:
                await problems.render(_too_large(self.limit))(scope, receive, send)
                return

        received = 0
        limit = self.limit

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the route's body read: the exception handlers render
                    # it (FastAPI passes HTTPException through its own body parsing).
                    raise _too_large(limit)
            return message

        await self.app(scope, counted, send)
