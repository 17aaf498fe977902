"""The benchmark's CPU accounting: what the server spent, and the ceiling it sets.

``make bench`` prints, beside its ratios, the CPU each operation cost the clients
and the database server, and the most operations a second that CPU allows. The
table is how a missed target is explained, so its arithmetic and its readings
are tested here; the timings themselves never are.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import psycopg
import pytest
import sqlalchemy as sa

from bench.perf import harness, report
from tests.conftest import POSTGRES_URL

BUSY = "SELECT count(*) FROM generate_series(1, 4000000)"


def _row(case: str, system: str, streams: int, rate: float, client: float, server: float | None):
    variant = "clients" if case == "create" else "processes"
    metric = "ops_per_s" if case == "create" else "effects_per_s"
    row = {"case": case, "db": "postgres", "system": system, variant: streams, metric: rate}
    row["client_cpu_us"] = client
    if server is not None:
        row["server_cpu_us"] = server
    return row


def test_a_loop_that_waits_is_bounded_per_stream_and_the_dispatcher_by_the_cores() -> None:
    rows = [
        _row("dispatch", "raw", 1, 16_000, 5.0, 45.0),
        _row("dispatch", "outbox", 1, 9_000, 50.0, 100.0),
        _row("create", "raw", 4, 2_800, 300.0, 200.0),
        _row("create", "outbox", 4, 1_800, 500.0, 500.0),
    ]
    table = {(e["case"], e["system"]): e for e in report.cpu_table(rows, cores=2)}

    raw = table["dispatch", "raw"]
    assert raw["cpu_us"] == 50.0
    assert raw["ceiling"] == pytest.approx(20_000)  # one waiting stream: 1 / 50 us
    outbox = table["dispatch", "outbox"]
    assert outbox["ceiling"] == pytest.approx(2e6 / 150)  # overlapped: both cores
    assert outbox["ceiling_ratio"] == pytest.approx(2e6 / 150 / 16_000)
    # Four waiting clients on two cores: the cores bound them.
    assert table["create", "outbox"]["ceiling"] == pytest.approx(2e6 / 1000)
    assert table["create", "outbox"]["ceiling_ratio"] == pytest.approx(2_000 / 2_800)
    rendered = report.render_cpu(report.cpu_table(rows, cores=2))
    assert (
        "| dispatch | postgres | processes=1 | outbox | 50.0 | 100 | 150 | - | 9,000 |" in rendered
    )


def test_sqlite_work_is_the_clients_and_a_measurement_without_cpu_has_no_row() -> None:
    rows = [
        {"case": "dispatch", "db": "sqlite", "system": "raw", "processes": 1},
        {"case": "dispatch", "db": "sqlite", "system": "outbox", "processes": 1},
    ]
    rows[0].update(effects_per_s=36_000.0, client_cpu_us=26.0)
    rows[1].update(effects_per_s=8_000.0, client_cpu_us=120.0)
    rows.append({"case": "dispatch", "db": "postgres", "system": "pgqueuer", "processes": 1})
    rows[-1]["effects_per_s"] = 6_000.0
    table = report.cpu_table(rows, cores=2)
    assert [(e["db"], e["system"]) for e in table] == [("sqlite", "outbox"), ("sqlite", "raw")]
    assert table[0]["server_cpu_us"] is None
    assert table[0]["ceiling"] == pytest.approx(1e6 / 120)  # one process, one core
    assert "(in client)" in report.render_cpu(table)


def test_a_report_gives_the_cpu_per_operation_of_all_its_clients() -> None:
    reports = [{"ops": 100, "cpu_s": 0.01}, {"ops": 300, "cpu_s": 0.03}]
    assert harness.cpu_per_op(reports) == {"client_cpu_us": pytest.approx(100.0)}
    assert harness.cpu_per_op([{"ops": 5}]) == {}  # a peer's loop reports no CPU
    reports[0]["preempted"], reports[1]["preempted"] = 10, 390
    assert harness.cpu_per_op(reports)["preempted_per_op"] == pytest.approx(1.0)


def test_a_span_counts_the_preemptions_inside_it_only() -> None:
    """Two spinning processes for every core: the span sees the kernel
    take the core away, and a span begun after them sees none of theirs."""
    before = harness.begin()
    spinners = [
        multiprocessing.get_context("fork").Process(target=_spin, args=(0.3,))
        for _ in range((os.cpu_count() or 1) * 2)
    ]
    for p in spinners:
        p.start()
    _spin(0.3)
    for p in spinners:
        p.join()
    busy = harness.span(1, before)["preempted"]
    assert busy >= 1
    quiet = harness.begin()
    assert harness.span(1, quiet)["preempted"] <= 1


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_server_cpu_counted_is_the_databases_work_after_the_start(postgres_url: str) -> None:
    dsn = sa.make_url(postgres_url).set(drivername="postgresql").render_as_string(False)
    conn = psycopg.connect(dsn, autocommit=True)
    try:
        # Only a local PostgreSQL process is read (a remote server's ids mean nothing here).
        reader = harness.ServerCpu(POSTGRES_URL, postgres_url)
        (backend,) = conn.execute("SELECT pg_backend_pid()").fetchone() or (None,)
        assert isinstance(reader.cpu(backend), float)
        assert reader.cpu(os.getpid()) is None

        # Work after the start is counted.
        counted = harness.ServerCpu(POSTGRES_URL, postgres_url)
        counted.start(time.monotonic())
        _until_read(counted)
        conn.execute(BUSY).fetchall()
        _until_polled(counted)
        counted.stop()
        busy = counted.seconds
        assert busy is not None and busy >= 0.05, busy

        # Work before it (a client's warm-up) is not: nothing is read before the start.
        early = harness.ServerCpu(POSTGRES_URL, postgres_url)
        early.start(time.monotonic() + 3600)
        conn.execute(BUSY).fetchall()
        early.stop()
        assert (early.polls, early.seconds) == (0, None)
        conn.execute(BUSY).fetchall()
        idle = harness.ServerCpu(POSTGRES_URL, postgres_url)
        idle.start(time.monotonic())
        _until_read(idle)
        conn.execute("SELECT 1").fetchall()
        _until_polled(idle)
        idle.stop()
        assert idle.seconds is not None and idle.seconds < busy / 2, (idle.seconds, busy)

        # A backend that exits keeps what it was last seen to spend.
        leaving = harness.ServerCpu(POSTGRES_URL, postgres_url)
        leaving.start(time.monotonic())
        _until_read(leaving)
        conn.execute(BUSY).fetchall()
        _until_polled(leaving)
        spent = leaving.seconds
    finally:
        conn.close()
    _until_polled(leaving)
    leaving.stop()
    assert spent is not None and spent >= 0.05
    assert leaving.seconds == spent


def test_a_sqlite_measurement_has_no_server_to_read(tmp_path) -> None:
    scratch = harness.Scratch(pg_admin_url="postgresql://nobody@127.0.0.1:1/none", tmp=tmp_path)
    assert scratch.server_cpu(f"sqlite:///{tmp_path / 'x.db'}") is None


def _until_read(sampler: harness.ServerCpu) -> None:
    """Wait (bounded by count, not by time) until the sampler has read its backend once."""
    for _ in range(2_000):
        if sampler.seconds is not None:
            return
        time.sleep(0.005)
    raise AssertionError("the sampler never read the database's backend")


def _until_polled(sampler: harness.ServerCpu) -> None:
    """Two more polls: the last reading is taken after the work ended."""
    polls = sampler.polls
    for _ in range(2_000):
        if sampler.polls >= polls + 2:
            return
        time.sleep(0.005)
    raise AssertionError("the sampler stopped polling")


def test_the_latency_case_times_claims_only_while_it_runs() -> None:
    """The client processes serve the run's later cases (the RSS drain among them):
    the claim timer must not stay wrapped around ``claim_due``, nor wrap itself."""
    from bench.perf import latency
    from outbox.delivery import store

    original = store.claim_due
    with latency._claims_timed({}):
        assert store.claim_due is not original
    assert store.claim_due is original
