"""Fair sharing under a flood: one tenant floods from its own process and gets 429s with
Retry-After; another tenant's p99 stays within 3x of its unloaded p99.

``outbox serve`` runs as a real process with its production settings (the
default rate limit; the flooding tenant has its own, lower one). The flood is
``bench.flood.flood``, a separate process with 32 keep-alive connections that
ignores Retry-After. The victim makes a fixed number of sequential reads,
first with nobody else calling, then while the flood runs; the flood is
stopped only after the victim's last request, and must not have run out of
requests before it (so every loaded sample was taken under the flood).

On a busy shared machine one round's p99 is noise, so the comparison is made
on the medians over ``ROUNDS`` rounds, each measuring unloaded and loaded
back to back. The bound itself (3x) is not relaxed.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from outbox import cli
from outbox.service import Outbox

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("flood"), pytest.mark.timeout(900)]

ROUNDS = 5
SAMPLES = 200  # victim requests per measurement
CONNECTIONS = 32
FLOOD_CAP = 200_000  # a bound on the flood's requests, far above one measurement
START_LIMIT_S = 120
RATIO = 3.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _measure(client: httpx.Client, token: str, task_id: int) -> float:
    headers = {"Authorization": f"Bearer {token}"}
    samples = []
    for _ in range(SAMPLES):
        started = time.perf_counter()
        answer = client.get(f"/v1/tasks/{task_id}", headers=headers)
        samples.append(time.perf_counter() - started)
        assert answer.status_code == 200, answer.text
    return _p99(samples)


def test_a_flooding_tenant_gets_429s_and_another_tenants_p99_stays_within_3x(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'flood.db'}"
    assert cli.main(["--database-url", url, "db", "upgrade"]) == 0
    with Outbox(url) as box:
        box.create_tenant("flood", rate_limit="50/second")
        # The calm tenant calls back to back, which on a fast machine is over the
        # default 100/second: its own limit keeps it measuring latency, not its own 429s.
        box.create_tenant("calm", rate_limit="1000/second")
        flood_token = box.create_token("flood", "agent", "flood")
        calm_token = box.create_token("calm", "agent", "calm")
        for tenant in ("flood", "calm"):
            box.execute(tenant, "op-1", "create_support_task", {"subject": "read me"})
        calm_task = box.get_operation("calm", "op-1")["task_id"]
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "OUTBOX_DATABASE_URL": url,
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    unloaded: list[float] = []
    loaded: list[float] = []
    floods: list[dict[str, int]] = []
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.05)
        with httpx.Client(base_url=base, timeout=30) as client:
            _measure(client, calm_token, calm_task)  # warm-up: connection, caches
            for _ in range(ROUNDS):
                unloaded.append(_measure(client, calm_token, calm_task))
                flood = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.flood.flood",
                        "127.0.0.1",
                        str(port),
                        flood_token,
                        "--connections",
                        str(CONNECTIONS),
                        "--max-requests",
                        str(FLOOD_CAP),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=Path(__file__).resolve().parents[2],
                )
                try:
                    assert flood.stdout is not None and flood.stdin is not None
                    assert flood.stdout.readline().strip() == "ready"
                    loaded.append(_measure(client, calm_token, calm_task))
                    flood.stdin.close()  # stop only after the victim's last request
                    floods.append(json.loads(flood.stdout.readline()))
                finally:
                    if flood.poll() is None:
                        flood.kill()
                    flood.wait(10)
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)

    for counts in floods:
        assert counts["hit the request cap"] == 0, counts  # flooding all along
        assert counts.get("429", 0) > 0, counts
        assert counts["429 with Retry-After"] == counts["429"], counts
    unloaded_p99 = statistics.median(unloaded)
    loaded_p99 = statistics.median(loaded)
    report = (
        f"calm p99 unloaded {unloaded_p99 * 1000:.1f} ms, under flood {loaded_p99 * 1000:.1f} ms "
        f"(rounds: {[round(x * 1000, 1) for x in unloaded]} / "
        f"{[round(x * 1000, 1) for x in loaded]}); flood: {floods}"
    )
    print(report)
    assert loaded_p99 <= RATIO * unloaded_p99, report
