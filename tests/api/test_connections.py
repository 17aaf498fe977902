"""Slow and half-open clients: ``outbox serve``'s header-read timeout and connection cap.

The server is configured exactly as ``outbox serve`` configures it
(``connections.server_options``), with a short injected timeout. Closure is
awaited per connection (EOF on the socket), never timed against the wall clock
beyond a generous bound that only stops a broken run.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest

from outbox.api import connections, create_app
from outbox.service import Outbox
from tests.support.servers import serve_in_thread

HALF_OPEN = 500
HEADER_TIMEOUT_S = 1.0
GIVE_UP_S = 120.0  # only a broken run gets near this
PARTIAL_HEAD = b"POST /v1/tasks HTTP/1.1\r\nHost: outbox\r\nContent-Type: application/json\r\n"


@pytest.fixture
def served(sqlite_url: str, make_settings) -> Iterator[str]:
    config = make_settings(header_timeout=timedelta(seconds=HEADER_TIMEOUT_S))
    with Outbox(sqlite_url, config=config) as box:
        options = connections.server_options(config.header_timeout.total_seconds(), 1000)
        with serve_in_thread(create_app(box), **options) as url:
            yield url


async def _open_half(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(PARTIAL_HEAD)  # a request head that never ends
    await writer.drain()
    return reader, writer


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sent until it closed the connection (EOF)."""
    return await reader.read()


def test_half_open_connections_are_closed_and_a_normal_request_is_served(served: str):
    host, port = served.removeprefix("http://").split(":")

    async def scenario() -> tuple[list[bytes], int]:
        loop = asyncio.get_running_loop()
        opened = await asyncio.gather(*(_open_half(host, int(port)) for _ in range(HALF_OPEN)))
        closures = [asyncio.ensure_future(_closed(r)) for r, _ in opened]
        # While all 500 hang on their heads, a normal caller is served.
        async with httpx.AsyncClient(base_url=served, timeout=30) as client:
            normal = await client.get("/healthz")
        started = loop.time()
        answers = await asyncio.wait_for(asyncio.gather(*closures), GIVE_UP_S)
        waited = loop.time() - started
        for _, writer in opened:
            writer.close()
        assert waited < GIVE_UP_S
        return answers, normal.status_code

    answers, normal_status = asyncio.run(scenario())
    assert normal_status == 200
    assert len(answers) == HALF_OPEN
    # Every one was answered 408 and closed by the server (EOF), none left open.
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:40] for a in answers}


def test_a_slow_but_complete_head_is_served(served: str):
    """The deadline is for the whole head: one sent in pieces within it is answered."""
    host, port = served.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        sock.sendall(b"Host: outbox\r\n")
        sock.sendall(b"Connection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ")


def test_keep_alive_connection_gets_a_new_deadline_for_its_next_head(served: str):
    host, port = served.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: outbox\r\n\r\n")
        received = b""
        while b'{"status":"ok"}' not in received:  # the whole first response
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: out")  # the second head never ends
        rest = b""
        while chunk := sock.recv(4096):
            rest += chunk
    assert rest.startswith(b"HTTP/1.1 408 ")


def test_connections_over_the_cap_are_closed_at_once(sqlite_url: str, make_settings):
    config = make_settings()
    with Outbox(sqlite_url, config=config) as box:
        options = connections.server_options(30.0, 3)
        with serve_in_thread(create_app(box), **options) as url:
            host, port = url.removeprefix("http://").split(":")
            held = [socket.create_connection((host, int(port)), timeout=30) for _ in range(3)]
            try:
                with socket.create_connection((host, int(port)), timeout=30) as extra:
                    extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: outbox\r\n\r\n")
                    try:
                        answer = extra.recv(4096)
                    except ConnectionResetError:
                        answer = b""
                assert answer == b""  # closed before a byte was read or answered
            finally:
                for sock in held:
                    sock.close()
