"""``outbox serve`` as a real process: it serves, and stops with status 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.patience import PATIENCE_S

pytestmark = pytest.mark.e2e

START_LIMIT_SECONDS = PATIENCE_S


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_serve_answers_and_stops_cleanly_on_sigterm(sqlite_url: str, tmp_path: Path) -> None:
    # SIGINT takes the same path (uvicorn's handle_exit); one process start is enough.
    port = free_port()
    env = {**os.environ, "OUTBOX_DATABASE_URL": sqlite_url, "OUTBOX_LOG_LEVEL": "WARNING"}
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + START_LIMIT_SECONDS
        while True:  # the process gives no other signal that it listens; bounded in time
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read() if process.stdout else ""
                assert time.monotonic() < deadline, "outbox serve did not start"
                time.sleep(0.05)
        assert ready.status_code == 200
        assert ready.json()["status"] == "ready"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=PATIENCE_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == 0, output
