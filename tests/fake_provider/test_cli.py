"""``fake-provider serve`` as a real process: flags, clean stops, and kill -9 durability."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from fake_provider import FaultSpecError, Outcome
from fake_provider.__main__ import main, parse_fault_spec
from tests.support.patience import PATIENCE_S

from .conftest import ticket_body

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_SECONDS = PATIENCE_S


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Provider:
    """A running ``python -m fake_provider serve`` process and its base URL."""

    def __init__(self, process: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
        self.process = process
        self.base_url = base_url
        self.log = log

    def client(self, timeout: float | httpx.Timeout = 5.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout)


@contextmanager
def provider_process(tmp_path: Path, *args: str) -> Iterator[Provider]:
    """Start the provider on a free loopback port; wait (bounded) until it answers."""
    port = free_port()
    log = tmp_path / f"provider-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fake_provider",
                "serve",
                "--port",
                str(port),
                "--log-level",
                "warning",
                *args,
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    provider = Provider(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"provider exited with {process.returncode}: {log.read_text()}")
            try:
                if httpx.get(f"{provider.base_url}/_admin/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"provider did not answer within {START_TIMEOUT_SECONDS}s")
            time.sleep(0.02)  # a separate process: there is no event to await
        yield provider
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def post(client: httpx.Client, key: str) -> httpx.Response:
    return client.post("/v1/tickets", json=ticket_body(key), headers={"Idempotency-Key": key})


pytestmark = pytest.mark.e2e


def test_an_answered_ticket_survives_kill_9(tmp_path: Path) -> None:
    db = str(tmp_path / "provider.db")
    with provider_process(tmp_path, "--db", db) as provider, provider.client() as client:
        created = post(client, "key-1")
        assert created.status_code == 201
        provider.process.send_signal(signal.SIGKILL)
        provider.process.wait(10)
    with provider_process(tmp_path, "--db", db) as provider, provider.client() as client:
        ticket_id = created.json()["id"]
        assert client.get(f"/v1/tickets/{ticket_id}").json() == created.json()
        found = client.get("/v1/tickets", params={"idempotency_key": "key-1"}).json()
        assert [ticket["id"] for ticket in found["tickets"]] == [ticket_id]
        replay = post(client, "key-1")
        assert replay.status_code == 201
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.content == created.content
        assert post(client, "key-2").json()["id"] != ticket_id  # ids are not reused
        assert client.get("/_admin/stats").json()["tickets"] == 2


def test_kill_9_while_the_reply_is_held_keeps_the_committed_ticket(tmp_path: Path) -> None:
    db = str(tmp_path / "provider.db")
    args = [
        "--db",
        db,
        "--script",
        "drop_after_commit",
        "--drop-mode",
        "hold",
        "--hold-seconds",
        "60",
    ]
    errors: list[BaseException] = []
    with provider_process(tmp_path, *args) as provider, provider.client() as client:

        def send() -> None:
            try:
                with provider.client(timeout=30.0) as own:
                    post(own, "key-1")
            except httpx.TransportError as exc:
                errors.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + PATIENCE_S
        while not client.get("/_admin/effects").json()["effects"]:
            assert time.monotonic() < deadline, "the ticket was never committed"
            time.sleep(0.01)
        provider.process.send_signal(signal.SIGKILL)
        provider.process.wait(10)
        sender.join(10)
    assert not sender.is_alive()
    assert len(errors) == 1  # the client never got its reply
    with provider_process(tmp_path, "--db", db) as provider, provider.client() as client:
        [effect] = client.get("/_admin/effects").json()["effects"]
        assert effect["outcome"] == "drop_after_commit"
        retry = post(client, "key-1")
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.json()["id"] == effect["id"]


def test_kill_9_before_commit_frees_the_key(tmp_path: Path) -> None:
    db = str(tmp_path / "provider.db")
    with provider_process(tmp_path, "--db", db, "--latency-ms", "60000") as provider:
        sender = threading.Thread(target=lambda: _post_ignoring_errors(provider, "key-1"))
        sender.start()
        with provider.client(timeout=httpx.Timeout(5.0, read=1.0)) as client:
            for _ in range(10):  # bounded: one of the first two requests holds the claim
                try:
                    if post(client, "key-1").status_code == 409:
                        break
                except httpx.ReadTimeout:
                    continue
            else:
                pytest.fail("the key never showed as in progress")
        provider.process.send_signal(signal.SIGKILL)
        provider.process.wait(10)
        sender.join(10)
    with provider_process(tmp_path, "--db", db) as provider, provider.client() as client:
        retry = post(client, "key-1")
        assert retry.status_code == 201
        assert "Idempotent-Replayed" not in retry.headers
        assert client.get("/_admin/stats").json()["tickets"] == 1


def _post_ignoring_errors(provider: Provider, key: str) -> None:
    try:
        with provider.client(timeout=30.0) as client:
            post(client, key)
    except httpx.TransportError:
        pass


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_applies_its_flags_and_stops_cleanly(tmp_path: Path, signum: int) -> None:
    args = [
        "--mode",
        "ignore",
        "--no-lookup",
        "--lookup-lag-ms",
        "5",
        "--drop-mode",
        "hold",
        "--seed",
        "5",
        "--rate",
        "reject=0.5",
        "--script",
        "ok,rate_limit",
        "--latency-ms",
        "0:2",
        "--retry-after",
        "9",
    ]
    with provider_process(tmp_path, *args) as provider, provider.client() as client:
        health = client.get("/_admin/health").json()
        assert health["mode"] == "ignore"
        assert health["lookup_enabled"] is False
        assert health["lookup_lag_ms"] == 5
        assert health["drop_mode"] == "hold"
        plan = client.get("/_admin/faults").json()
        assert plan["seed"] == 5
        assert plan["rates"] == {"reject": 0.5}
        assert plan["script"] == ["ok", "rate_limit"]
        assert plan["latency_ms"] == {"min": 0, "max": 2}
        assert post(client, "k").status_code == 201
        limited = post(client, "k")
        assert limited.status_code == 429
        assert limited.headers["Retry-After"] == "9"
        provider.process.send_signal(signum)
        assert provider.process.wait(PATIENCE_S) == 0


def test_python_dash_m_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fake_provider", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0
    assert "serve" in result.stdout


def test_serve_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in [
        "--host",
        "--port",
        "--mode",
        "--no-lookup",
        "--lookup-lag-ms",
        "--key-retention-seconds",
        "--db",
        "--seed",
        "--rate",
        "--script",
        "--latency-ms",
        "--drop-mode",
        "--hold-seconds",
        "--retry-after",
        "--retry-after-format",
    ]:
        assert flag in text


def test_no_command_prints_help() -> None:
    assert main([]) == 2


@pytest.mark.parametrize(
    "args",
    [
        ["--rate", "explode=0.5"],
        ["--rate", "reject"],
        ["--rate", "reject=lots"],
        ["--rate", "reject=0.8", "--rate", "unavailable=0.8"],
        ["--script", "ok,nope"],
        ["--latency-ms", "fast"],
        ["--lookup-lag-ms", "-1"],
    ],
)
def test_bad_flags_exit_2_without_serving(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--port", "1", *args]) == 2
    assert capsys.readouterr().err.startswith("fake-provider: ")


def test_parse_fault_spec() -> None:
    spec = parse_fault_spec(["reject=0.1", " rate_limit = 0.2"], "ok, fail_after_commit", "3:7")
    assert spec.rates == {Outcome.REJECT: 0.1, Outcome.RATE_LIMIT: 0.2}
    assert spec.script == (Outcome.OK, Outcome.FAIL_AFTER_COMMIT)
    assert (spec.latency_min_ms, spec.latency_max_ms) == (3, 7)
    assert parse_fault_spec([], "", "4").latency_max_ms == 4
    with pytest.raises(FaultSpecError):
        parse_fault_spec([], "", "7:3")
