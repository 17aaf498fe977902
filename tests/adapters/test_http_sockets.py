"""HttpAdapter over real loopback sockets: refused connections and the timeouts."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from adapters import HttpAdapter, HttpAdapterConfig, LookupStatus, Outcome
from tests.adapters.support import request_for
from tests.support.servers import serve_in_thread


class SlowApp:
    """ASGI app: ``/hang`` answers only when released; ``/trickle`` sends 201 then drips."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        message = await receive()
        while message.get("more_body"):
            message = await receive()
        if scope["path"] == "/hang":
            await asyncio.to_thread(self.release.wait, 10)
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": b'{"id": "late"}'})
            return
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"id": "T', "more_body": True})
        while not self.release.is_set():
            await asyncio.sleep(0.02)
            await send({"type": "http.response.body", "body": b" ", "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def slow_server() -> Iterator[tuple[str, SlowApp]]:
    app = SlowApp()
    with serve_in_thread(app) as base_url:
        try:
            yield base_url, app
        finally:
            app.release.set()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_refused_connection_is_not_sent() -> None:
    adapter = HttpAdapter(
        "h",
        HttpAdapterConfig(
            url=f"http://127.0.0.1:{free_port()}/v1/tickets",
            lookup_url=f"http://127.0.0.1:{free_port()}/v1/tickets?r={{effect_key}}",
        ),
    )
    result = adapter.deliver(request_for())
    assert result.outcome is Outcome.NOT_SENT
    assert result.error is not None and result.error.startswith("ConnectError")
    assert adapter.lookup("k", None).status is LookupStatus.INCONCLUSIVE
    adapter.close()


def test_a_read_timeout_is_ambiguous(slow_server: tuple[str, SlowApp]) -> None:
    base_url, _ = slow_server
    adapter = HttpAdapter("h", HttpAdapterConfig(url=f"{base_url}/hang", read_timeout=0.2))
    result = adapter.deliver(request_for())
    # /hang answers 201 only when released (or after 10 s): ambiguous means the
    # read timeout ended the wait, whatever the machine's speed.
    assert result.outcome is Outcome.AMBIGUOUS
    assert result.error is not None and result.error.startswith("ReadTimeout")
    adapter.close()


def test_total_timeout_bounds_a_reply_that_trickles(slow_server: tuple[str, SlowApp]) -> None:
    base_url, _ = slow_server
    config = HttpAdapterConfig(url=f"{base_url}/trickle", read_timeout=5, total_timeout=0.3)
    adapter = HttpAdapter("h", config)
    started = time.monotonic()
    result = adapter.deliver(request_for())
    elapsed = time.monotonic() - started
    # Each chunk arrives well within read_timeout and the drip never ends by
    # itself: only the total deadline can end it, and not before it is due.
    assert elapsed >= 0.3
    assert (result.outcome, result.status_code, result.provider_ref) == (
        Outcome.AMBIGUOUS,
        201,
        None,
    )
    assert result.error is not None and "total_timeout" in result.error
    adapter.close()


def test_total_timeout_caps_the_read_timeout(slow_server: tuple[str, SlowApp]) -> None:
    base_url, _ = slow_server
    config = HttpAdapterConfig(url=f"{base_url}/hang", read_timeout=30, total_timeout=0.2)
    adapter = HttpAdapter("h", config)
    result = adapter.deliver(request_for())
    # Not the 30 s read timeout: /hang would have answered 201 after 10 s.
    assert result.outcome is Outcome.AMBIGUOUS
    assert result.error is not None and result.error.startswith("ReadTimeout")
    adapter.close()
