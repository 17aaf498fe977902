"""The example app end to end with the stock processes only, on SQLite and PostgreSQL.

``examples/refunds/run.py`` (what ``make example`` runs) starts two fake
providers, ``outbox serve``, ``outbox dispatcher`` and ``outbox reconciler``
for the app, calls both tools over HTTP (each call twice with one key),
waits (bounded) for every effect to settle, and reads the providers' ledgers.

And the stock ``outbox serve`` with that app answers 201 to each tool's
OpenAPI example, and replays it byte for byte.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.app.conftest import EXAMPLE, EXAMPLE_APP, child_env

pytestmark = pytest.mark.e2e

LAST_LINE = re.compile(r"^example: created=(\d+) delivered=(\d+) unknown=(\d+) duplicates=(\d+)$")


@pytest.mark.timeout(900)
def test_the_example_runs_end_to_end_on_the_stock_processes(db_url, tmp_path: Path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py"), "--work", str(tmp_path / "work")],
        env=child_env(OUTBOX_DATABASE_URL=db_url),
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    logs = "".join(
        f"\n--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
        for log in sorted((tmp_path / "work").glob("*.log"))
    )
    assert done.returncode == 0, done.stdout + done.stderr + logs
    last = done.stdout.strip().splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match, last
    created, delivered, unknown, duplicates = map(int, match.groups())
    assert created == delivered == 11  # six refunds (one approved first), five messages
    assert unknown == 0 and duplicates == 0
    # Both providers lost a reply after committing, and each recovered its own way.
    assert "payments: 6 tickets" in done.stderr and "chat: 5 tickets" in done.stderr


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def outbox(*argv: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "outbox"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.timeout(900)
def test_serve_answers_each_tools_openapi_example_and_replays_it_byte_for_byte(tmp_path: Path):
    env = child_env(
        OUTBOX_APP=EXAMPLE_APP, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'outbox.db'}"
    )
    outbox("db", "upgrade", env=env)
    outbox("tenants", "create", "shop", env=env)
    token = outbox("tokens", "create", "--tenant", "shop", "--role", "agent", env=env)
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "outbox"), "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # generous: a busy 2-core machine
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "outbox serve did not become ready"
            time.sleep(0.1)
        doc = httpx.get(f"{base}/openapi.json", timeout=10).json()
        for n, tool in enumerate(("issue_refund", "notify_customer")):
            content = doc["paths"][f"/v1/tools/{tool}"]["post"]["requestBody"]["content"]
            example = content["application/json"]["example"]
            headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": f"example-{n}"}
            first = httpx.post(f"{base}/v1/tools/{tool}", json=example, headers=headers)
            again = httpx.post(f"{base}/v1/tools/{tool}", json=example, headers=headers)
            assert first.status_code == 201, first.text
            assert first.headers["idempotent-replayed"] == "false"
            assert again.status_code == 201
            assert again.headers["idempotent-replayed"] == "true"
            assert again.content == first.content
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
