"""The processes an operator runs, from the CLI: metrics ports, health, JSON logs, ``outbox dev``.

Every port is an ephemeral loopback port, every wait is bounded, and every
child is killed in a ``finally`` (``outbox dev``'s children by the pids it
prints, should it fail to stop them itself).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from fake_provider import ProviderConfig, create_app
from outbox import db, schema, settings
from outbox.service import Outbox
from tests.support.patience import PATIENCE_S
from tests.support.servers import serve_in_thread

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TOOL = "create_support_task"
# Customer text: it reaches the provider, and must never reach a log line.
BODY = "Customer writes: parcel 7731 never arrived, call me on 555-0143"
SWEEPS = ("expire_leases", "enforce_deadlines", "run_lookups", "apply_retention")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + max(timeout, PATIENCE_S)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.TransportError:
        return None


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


def child_env(**outbox: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({f"OUTBOX_{k.upper()}": v for k, v in outbox.items()})
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextmanager
def outbox_process(
    args: list[str], cwd: Path, env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", *args],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def set_revision(url: str, revision: str) -> str:
    """Pretend another version migrated the database; returns the revision it replaced."""
    engine = db.create_engine(settings.load(), url=url)
    try:
        with engine.begin() as conn:
            previous: str = conn.execute(
                sa.text("SELECT version_num FROM alembic_version")
            ).scalar_one()
            conn.execute(sa.text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
        return previous
    finally:
        engine.dispose()


def assert_health_and_readiness(base_url: str, database_url: str) -> None:
    healthz = get(f"{base_url}/healthz")
    assert healthz is not None and healthz.json() == {"status": "ok"}
    ready = get(f"{base_url}/readyz")
    assert ready is not None and ready.status_code == 200, ready and ready.text
    previous = set_revision(database_url, "ffffffffffff")
    try:
        ready = get(f"{base_url}/readyz")
        assert ready is not None and ready.status_code == 503
        assert ready.json()["status"] == "not_ready"
        assert "ffffffffffff" in ready.json()["detail"]
    finally:
        set_revision(database_url, previous)
    ready = get(f"{base_url}/readyz")
    assert ready is not None and ready.status_code == 200


def json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        if line.strip():
            lines.append(json.loads(line))  # every line: one JSON object, nothing else
    return lines


@pytest.fixture
def provider_url() -> Iterator[str]:
    """The fake provider (honour mode) on a uvicorn thread."""
    app = create_app(ProviderConfig(seed=0))
    try:
        with serve_in_thread(app) as url:
            yield url
    finally:
        app.state.ledger.close()


def test_dispatcher_serves_metrics_and_health_and_logs_each_attempt_as_json(
    sqlite_url: str, provider_url: str, tmp_path: Path
) -> None:
    out = schema.outbox
    with Outbox(sqlite_url) as box:
        box.create_tenant("acme")
        token = box.create_token("acme", "agent", "ops test")
        box.execute("acme", "op-json-logs", TOOL, {"subject": "Late parcel", "body": BODY})
        with db.read(box.engine) as conn:
            effect_id = conn.execute(sa.select(out.c.id)).scalar_one()

    def succeeded() -> bool:
        with Outbox(sqlite_url) as box, db.read(box.engine) as conn:
            query = sa.select(out.c.status).where(out.c.id == effect_id)
            return bool(conn.execute(query).scalar_one() == "succeeded")

    adapters_toml = tmp_path / "adapters.toml"
    adapters_toml.write_text(
        f'[adapters.helpdesk]\nkind = "helpdesk"\nbase_url = "{provider_url}"\n',
        encoding="utf-8",
    )
    env = child_env(adapters=str(adapters_toml), poll_interval="0.1")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = tmp_path / "dispatcher.log"
    args = ["--database-url", sqlite_url, "dispatcher", "--worker-id", "ops-1"]
    args += ["--metrics-port", str(port), "--log-format", "json"]
    with outbox_process(args, tmp_path, env, log) as proc:
        wait_for(succeeded, 30, "the delivery")
        scraped = wait_for(lambda: get(f"{base_url}/metrics"), 10, "/metrics").text
        delivered = sample(
            scraped, "outbox_deliveries_total", adapter="helpdesk", outcome="delivered"
        )
        assert delivered == 1
        timed = sample(scraped, "outbox_attempt_duration_seconds_count", adapter="helpdesk")
        assert timed == 1
        assert sample(scraped, "outbox_circuit_breaker_open", adapter="helpdesk") == 0
        assert sample(scraped, "outbox_effects", status="pending") == 0
        assert sample(scraped, "outbox_review_queue") == 0
        assert_health_and_readiness(base_url, sqlite_url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(PATIENCE_S) == 0, log.read_text()

    text = log.read_text()
    lines = json_lines(text)
    attempt = [line for line in lines if line.get("effect_id") == effect_id]
    assert attempt, text
    assert attempt[0] == {
        "at": attempt[0]["at"],
        "level": "info",
        "logger": "outbox.dispatcher",
        "message": "attempt 1 delivered: effect succeeded",
        "tenant": "acme",
        "operation_id": "op-json-logs",
        "effect_id": effect_id,
        "attempt": 1,
        "outcome": "delivered",
        "adapter": "helpdesk",
        "status_code": 201,
        "worker": "ops-1",
    }
    assert token not in text
    assert BODY not in text and "555-0143" not in text


def test_reconciler_serves_metrics_and_health_and_counts_each_sweep(
    sqlite_url: str, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "reconciler.log"
    env = child_env(sweep_interval="0.2s")
    args = ["--database-url", sqlite_url, "reconciler", "--metrics-port", str(port)]
    args += ["--log-format", "json"]
    base_url = f"http://127.0.0.1:{port}"

    def every_sweep_ran() -> str | None:
        scraped = get(f"{base_url}/metrics")
        if scraped is None:
            return None
        runs = [sample(scraped.text, "outbox_sweep_runs_total", sweep=name) for name in SWEEPS]
        return scraped.text if all(runs) else None

    with outbox_process(args, tmp_path, env, log) as proc:
        scraped = wait_for(every_sweep_ran, 30, "a pass of every sweep")
        for name in SWEEPS:
            assert sample(scraped, "outbox_sweep_rows_total", sweep=name) == 0
        assert sample(scraped, "outbox_effects", status="outcome_unknown") == 0
        assert sample(scraped, "outbox_review_queue") == 0
        assert_health_and_readiness(base_url, sqlite_url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(PATIENCE_S) == 0, log.read_text()
    messages = [line["message"] for line in json_lines(log.read_text())]
    assert any(m.startswith("reconciler started") for m in messages)
    assert "reconciler stopped" in messages


class Lines:
    """``outbox dev``'s stdout, read on a thread so the pipe never fills."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in iter(stream.readline, ""):
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def find(self, pattern: str) -> list[re.Match[str]]:
        return [m for m in (re.search(pattern, line) for line in self.snapshot()) if m]

    def join(self) -> None:
        self._thread.join(10)


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_outbox_dev_delivers_a_task_and_leaves_no_child_on_sigterm(tmp_path: Path) -> None:
    api_port, provider_port = free_port(), free_port()
    env = child_env(database_url=f"sqlite:///{tmp_path / 'dev.db'}")
    args = ["dev", "--port", str(api_port), "--provider-port", str(provider_port)]
    args += ["--log-format", "json", "--grace", "5"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    out = Lines(proc.stdout)
    pids: dict[str, int] = {}
    try:
        wait_for(lambda: len(out.find(r"started \w+ pid \d+")) == 4, 30, "four children")
        pids = {m[1]: int(m[2]) for m in out.find(r"started (\w+) pid (\d+)")}
        assert set(pids) == {"provider", "api", "dispatcher", "reconciler"}
        token = out.find(r"agent token: (\S+)")[0][1]
        operator = out.find(r"operator token: (\S+)")[0][1]
        # The banner says where to go next: the console, who signs in, the review queue.
        assert out.find(rf"^Console +http://127\.0\.0\.1:{api_port}/console/sign-in")
        assert out.find(
            rf"^Review +http://127\.0\.0\.1:{api_port}/console/queue .*outbox review list"
        )
        assert operator.startswith("obx_") and operator != token
        api = f"http://127.0.0.1:{api_port}"
        wait_for(
            lambda: (r := get(f"{api}/readyz")) is not None and r.status_code == 200, 30, "the API"
        )
        created = httpx.post(
            f"{api}/v1/tasks",
            json={"subject": "Late parcel", "body": BODY},
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": "op-dev-1"},
            timeout=10,
        )
        assert created.status_code == 201, created.text

        def tickets() -> int:
            stats = get(f"http://127.0.0.1:{provider_port}/_admin/stats")
            return int(stats.json()["tickets"]) if stats is not None else 0

        wait_for(lambda: tickets() == 1, 30, "the ticket at the fake provider")
        wait_for(lambda: out.find(r'^dispatcher +\| .*"outcome": "delivered"'), 10, "the log")
        # The reconciler has nothing to do here; on a loaded machine it may still be
        # starting when the ticket is delivered. Stop it once it runs, not before.
        wait_for(lambda: out.find(r"^reconciler +\| .*reconciler started"), 30, "the reconciler")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(PATIENCE_S) == 0
        out.join()
        gone = [name for name, pid in pids.items() if alive(pid)]
        assert not gone, f"children left running: {gone}"
    finally:
        for pid in pids.values():
            if alive(pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)

    lines = out.snapshot()
    for name in ("api", "dispatcher", "reconciler"):
        # Each of our processes honours --log-format: every line it writes is one JSON object.
        logged = [json.loads(line.split("| ", 1)[1]) for line in lines if line.startswith(name)]
        assert logged and all("at" in doc and "message" in doc for doc in logged), name
    dispatcher = [
        json.loads(line.split("| ", 1)[1]) for line in lines if line.startswith("dispatcher ")
    ]
    delivered = [d for d in dispatcher if d.get("outcome") == "delivered"]
    assert delivered[0]["tenant"] == "dev"
    assert delivered[0]["operation_id"] == "op-dev-1"
    assert delivered[0]["attempt"] == 1
    assert isinstance(delivered[0]["effect_id"], int)
    created_line = [
        json.loads(line.split("| ", 1)[1])
        for line in lines
        if line.startswith("api ") and '"operation_id": "op-dev-1"' in line
    ]
    assert created_line and created_line[0]["outcome"] == "created"
    text = "\n".join(lines)
    assert text.count(token) == 1  # the banner that hands it over, and nowhere else
    assert BODY not in text and "555-0143" not in text
