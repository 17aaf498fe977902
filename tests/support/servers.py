"""Run an ASGI app on a real uvicorn server in a background thread, on loopback.

Used wherever a test needs real HTTP (sockets, timeouts, aborted connections)
rather than an in-process transport. The port is ephemeral: the OS picks it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tests.support.patience import PATIENCE_S


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # a thread must not steal SIGINT
        pass


@contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", **config: Any) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL (``http://127.0.0.1:PORT``)."""
    # IPPROTO_TCP explicitly: asyncio then sets TCP_NODELAY (about 40 ms less per request).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = _Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="auto", **config)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + PATIENCE_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.005)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
