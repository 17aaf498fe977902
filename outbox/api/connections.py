"""Slow and abusive clients: a header-read timeout and a cap on open connections.

uvicorn closes an *idle* keep-alive connection after ``timeout_keep_alive``,
but a connection that has started a request and never finishes its head
(slowloris, or a half-open connection whose peer is gone) is held for as long
as the client likes: 3,000 of them were, in a test. ``HeaderTimeoutProtocol``
is uvicorn's h11 protocol with one timer more: from the moment a connection
is accepted, and again after each response, the next request head (request
line and headers) must be complete within ``OUTBOX_HEADER_TIMEOUT`` (default
10 s). Otherwise the server answers ``408 Request Timeout`` and closes the
connection. A head is at most h11's 16 KiB (``h11_max_incomplete_event_size``),
past which the answer is 400.

The cap: a process holds at most ``OUTBOX_MAX_CONNECTIONS`` (default 1000)
connections; one more is closed as soon as it is accepted, before a byte is
read. With the timeout, it bounds the memory and file descriptors one process
can be made to hold, and for how long.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from outbox.api.ratelimit import PAUSE_READING_KEY

log = logging.getLogger("outbox.api")

KEEP_ALIVE_SECONDS = 5  # uvicorn's: an idle connection between requests is closed after it

_TIMEOUT_BODY = b"request head not received in time\n"
REQUEST_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n"
    b"Connection: close\r\n\r\n" + _TIMEOUT_BODY
)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request head and a connection cap."""

    header_timeout_seconds: float = 10.0
    max_connections: int = 1000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._cycle_timed: Any = None
        if len(self.connections) > self.max_connections:
            # Over the cap: closed before a byte is read; the client sees a reset/EOF.
            log.warning(
                "connection refused: %d open (cap %d)",
                len(self.connections) - 1,
                self.max_connections,
            )
            transport.close()
            return
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._cycle_timed = self.cycle  # a new cycle means a whole head arrived
        self._head_timer = self.loop.call_later(self.header_timeout_seconds, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._cycle_timed:
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        pause = (self.scope or {}).get("state", {}).get(PAUSE_READING_KEY)
        if pause and not self.transport.is_closing():
            # Answered 429: the next request of this connection is not read before its
            # Retry-After (ratelimit.PAUSE_READING_MAX_SECONDS at most).
            self.flow.pause_reading()
            self.loop.call_later(pause, self._resume_reading)
        if not self.transport.is_closing():
            # The next request's head gets the same deadline (uvicorn's keep-alive
            # timer only covers a connection on which nothing at all arrives).
            self._arm_head_timer()

    def _resume_reading(self) -> None:
        if not self.transport.is_closing():
            self.flow.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request is being served (pipelined); its response arms the timer again
        if cycle is not None and cycle is not self._cycle_timed:
            return  # the head arrived in the same loop iteration
        self.transport.write(REQUEST_TIMEOUT_RESPONSE)
        self.transport.close()


def protocol_class(header_timeout_seconds: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these bounds."""
    return type(
        "OutboxHttpProtocol",
        (HeaderTimeoutProtocol,),
        {"header_timeout_seconds": header_timeout_seconds, "max_connections": max_connections},
    )


def server_options(header_timeout_seconds: float, max_connections: int) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that put both bounds in place."""
    return {
        "http": protocol_class(header_timeout_seconds, max_connections),
        "timeout_keep_alive": KEEP_ALIVE_SECONDS,
    }
