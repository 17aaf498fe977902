"""Dispatcher processes, started from the CLI: many workers, a paused worker, kill -9, SIGTERM.

The fake provider runs on a uvicorn thread in the test process (ephemeral
loopback port); the dispatchers reach it through an adapters TOML file.
Every wait is bounded, and every child is killed in a ``finally``.
"""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import adapters
from fake_provider import DropMode, FaultSpec, Mode, ProviderConfig, create_app
from outbox import db, schema, settings
from outbox.delivery import store
from outbox.states import AttemptOutcome, EffectStatus, Reason
from tests.dispatcher.support import attempts, row, rows, seed, statuses
from tests.support.patience import PATIENCE_S
from tests.support.servers import serve_in_thread

pytestmark = pytest.mark.e2e

S = EffectStatus
ROOT = Path(__file__).resolve().parents[2]
HONOURS = adapters.Capabilities(True, True, 1.0)
IGNORES = adapters.Capabilities(False, True, 1.0)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + max(timeout, PATIENCE_S)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@contextmanager
def provider(**fields: Any) -> Iterator[tuple[Any, str]]:
    app = create_app(ProviderConfig(**{"seed": 0, **fields}))
    try:
        with serve_in_thread(app) as base_url:
            yield app, base_url
    finally:
        app.state.ledger.close()


def adapters_file(tmp_path: Path, base_url: str, honours: bool) -> Path:
    path = tmp_path / "adapters.toml"
    path.write_text(
        "[adapters.helpdesk]\n"
        'kind = "helpdesk"\n'
        f'base_url = "{base_url}"\n'
        f"honours_idempotency_keys = {'true' if honours else 'false'}\n"
        "lookup_settle_seconds = 1.0\n"
        "read_timeout = 60\n"
        "total_timeout = 60\n",
        encoding="utf-8",
    )
    return path


class Children:
    """Dispatcher processes of one test; all of them die with the test."""

    def __init__(self, tmp_path: Path, url: str, adapters_toml: Path) -> None:
        self.tmp_path = tmp_path
        self.url = url
        self.adapters_toml = adapters_toml
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, **settings: Any) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update({f"OUTBOX_{k.upper()}": str(v) for k, v in settings.items()})
        env["OUTBOX_ADAPTERS"] = str(self.adapters_toml)
        log = open(self.tmp_path / f"dispatcher-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "--database-url", self.url, "dispatcher", *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.tmp_path.glob("dispatcher-*.log"))
        )

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(10)


@contextmanager
def children(tmp_path: Path, url: str, adapters_toml: Path) -> Iterator[Children]:
    kids = Children(tmp_path, url, adapters_toml)
    try:
        yield kids
    finally:
        kids.kill_all()


def attempt_row(engine: Engine, effect_id: int, worker: str) -> Any:
    for a in attempts(engine, effect_id):
        if a.worker == worker:
            return a
    return None


# --- many workers ------------------------------------------------------------------------


def test_four_dispatchers_on_postgres_deliver_every_effect_once(
    engine, backend, db_url, tmp_path
) -> None:
    if backend != "postgres":
        pytest.skip("many dispatchers on many hosts is the PostgreSQL deployment")
    count = 2000
    with provider(mode=Mode.HONOUR) as (app, base_url):
        # Some replies get lost after the provider acted, some are refused:
        # retries happen, and they must reuse the key.
        app.state.faults.replace(
            FaultSpec.from_json(
                {
                    "rates": {
                        "drop_after_commit": 0.02,
                        "fail_after_commit": 0.02,
                        "unavailable": 0.02,
                    }
                }
            ),
            seed=11,
        )
        toml = adapters_file(tmp_path, base_url, honours=True)
        with children(tmp_path, db_url, toml) as kids:
            ids = seed(engine, count, now=schema.utcnow())
            for i in range(4):
                kids.start(
                    "--concurrency",
                    "8",
                    "--batch",
                    "50",
                    "--worker-id",
                    f"w{i}",
                    poll_interval="0.2s",
                    backoff_initial="0.05s",
                    backoff_max="0.5s",
                )
            wait_for(
                lambda: (
                    statuses(engine).get("succeeded") == count
                    or any(p.poll() is not None for p in kids.procs)
                ),
                90,
                "every effect to be delivered",
            )
            for proc in kids.procs:
                proc.send_signal(signal.SIGTERM)
            codes = [proc.wait(30) for proc in kids.procs]
            assert codes == [0, 0, 0, 0], kids.logs()[-3000:]
        stats = app.state.ledger.stats()
        tickets = {t.idempotency_key: t.id for t in app.state.ledger.tickets()}
    assert statuses(engine) == {"succeeded": count}
    assert stats["tickets"] == count and stats["duplicates"] == {} and stats["duplicate_keys"] == {}
    by_effect: dict[int, list[Any]] = {}
    for a in attempts(engine):
        by_effect.setdefault(a.effect_id, []).append(a)
    assert sorted(by_effect) == ids
    workers = set()
    retried = 0
    current = rows(engine)
    for effect_id, tries in by_effect.items():
        r = current[effect_id]
        assert r.provider_ref == tickets[r.effect_key]
        assert {a.effect_key for a in tries} == {r.effect_key}
        retried += len(tries) > 1
        # The attempt rows prove one holder at a time: fences strictly rise,
        # each attempt finished before the next began, and no result was late.
        for before, after in itertools.pairwise(tries):
            assert before.fence < after.fence
            assert before.finished_at <= after.started_at
        assert not any(a.late for a in tries)
        assert tries[-1].outcome == AttemptOutcome.DELIVERED
        workers.update(a.worker for a in tries)
    assert workers == {"w0", "w1", "w2", "w3"}
    assert retried > 0  # the faults did bite


# --- a paused worker ----------------------------------------------------------------------


def stop_outside_transaction(proc: subprocess.Popen[bytes], engine: Engine, url: str) -> None:
    """SIGSTOP ``proc`` at a moment it holds no transaction (else it would block the others)."""
    for _ in range(50):
        os.kill(proc.pid, signal.SIGSTOP)
        if not _holds_transaction(engine, url):
            return
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("the dispatcher always held a transaction")


def _holds_transaction(engine: Engine, url: str) -> bool:
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            return bool(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
                    )
                ).scalar()
            )
    path = db.sqlite_path(engine)
    assert path is not None
    conn = sqlite3.connect(path, timeout=0.2, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        conn.close()


def test_a_paused_worker_past_its_lease_only_leaves_evidence(
    engine, db_url, tmp_path, make_dispatcher
) -> None:
    with provider(mode=Mode.HONOUR) as (app, base_url):
        # Slow replies: the paused worker's request is still out when it stops.
        app.state.faults.replace(FaultSpec.from_json({"latency_ms": {"min": 700, "max": 700}}))
        toml = adapters_file(tmp_path, base_url, honours=True)
        (effect_id,) = seed(engine, 1, now=schema.utcnow())
        with children(tmp_path, db_url, toml) as kids:
            paused = kids.start(
                "--worker-id",
                "paused",
                lease_duration="1.5s",
                lease_renew_interval="0.5s",
                poll_interval="5s",
            )
            # Stop it once its request has reached the provider (which then
            # takes 700 ms to answer), so the send really is out.
            wait_for(lambda: sum(app.state.faults.counts().values()), 20, "the first request")
            stop_outside_transaction(paused, engine, db_url)
            assert row(engine, effect_id).lease_owner == "paused"
            # While it sleeps, its lease runs out and the row moves on.
            wait_for(
                lambda: row(engine, effect_id).lease_expires_at < schema.utcnow(), 10, "expiry"
            )
            assert (
                store.expire_leases(engine, capabilities_for=lambda _: HONOURS, max_attempts=5) == 1
            )
            wait_for(lambda: app.state.ledger.stats()["tickets"] == 1, 10, "the provider to act")
            healthy = make_dispatcher(
                adapters.load_registry(toml).get("helpdesk"), worker_id="healthy"
            )
            assert healthy.run_once() == 1
            after_healthy = row(engine, effect_id)
            assert (after_healthy.status, after_healthy.fence) == (S.SUCCEEDED, 2)
            os.kill(paused.pid, signal.SIGCONT)
            wait_for(lambda: attempt_row(engine, effect_id, "paused").late, 20, "the late result")
            paused.send_signal(signal.SIGTERM)
            assert paused.wait(PATIENCE_S) == 0, kids.logs()
        assert app.state.ledger.stats()["tickets"] == 1
    final = row(engine, effect_id)
    # The late result changed nothing on the row ...
    assert (final.status, final.fence, final.provider_ref, final.updated_at) == (
        S.SUCCEEDED,
        2,
        after_healthy.provider_ref,
        after_healthy.updated_at,
    )
    # ... and is kept, as evidence, on its own attempt row.
    late = attempt_row(engine, effect_id, "paused")
    assert (late.late, late.fence, late.outcome) == (True, 1, AttemptOutcome.DELIVERED)
    assert late.provider_ref == final.provider_ref
    current = attempt_row(engine, effect_id, "healthy")
    assert (current.late, current.fence, current.outcome) == (False, 2, AttemptOutcome.DELIVERED)


# --- kill -9 between the send and the record --------------------------------------------------


@pytest.mark.parametrize("honours", [True, False], ids=["honour", "ignore"])
def test_kill_9_between_send_and_record(engine, db_url, tmp_path, make_dispatcher, honours) -> None:
    mode = Mode.HONOUR if honours else Mode.IGNORE
    with provider(mode=mode, drop_mode=DropMode.HOLD, hold_seconds=30) as (app, base_url):
        # The provider commits the ticket, then holds the reply: the dispatcher
        # is between "sent" and "recorded" for as long as we like.
        app.state.faults.replace(FaultSpec.from_json({"script": ["drop_after_commit"]}))
        toml = adapters_file(tmp_path, base_url, honours=honours)
        (effect_id,) = seed(engine, 1, now=schema.utcnow())
        with children(tmp_path, db_url, toml) as kids:
            crashed = kids.start(
                "--once", "--worker-id", "crashed", lease_duration="1s", lease_renew_interval="0.3s"
            )
            wait_for(lambda: app.state.ledger.stats()["tickets"] == 1, 20, "the ticket")
            crashed.kill()
            crashed.wait(10)
            # The evidence: an attempt that started and never finished.
            (open_attempt,) = attempts(engine, effect_id)
            assert open_attempt.started_at is not None and open_attempt.finished_at is None
            assert row(engine, effect_id).status == S.IN_FLIGHT
            # The reconciler's sweep, once the lease has run out.
            wait_for(
                lambda: row(engine, effect_id).lease_expires_at < schema.utcnow(), 10, "expiry"
            )
            caps = HONOURS if honours else IGNORES
            assert store.expire_leases(engine, capabilities_for=lambda _: caps, max_attempts=5) == 1
            after_sweep = row(engine, effect_id)
            assert after_sweep.maybe_sent
            assert attempts(engine, effect_id)[0].outcome == AttemptOutcome.ABANDONED
            with adapters.load_registry(toml) as registry:
                again = make_dispatcher(registry.get("helpdesk"), worker_id="again")
                assert again.run_once() == (1 if honours else 0)
        final = row(engine, effect_id)
        keys = [t.idempotency_key for t in app.state.ledger.tickets()]
        assert len(keys) == 1  # one ticket, in both modes
        if honours:
            assert (final.status, final.provider_ref) == (
                S.SUCCEEDED,
                app.state.ledger.tickets()[0].id,
            )
            assert [a.worker for a in attempts(engine, effect_id)] == ["crashed", "again"]
            assert keys == [final.effect_key]  # delivered again with the same key: replayed
        else:
            assert (final.status, final.reason) == (S.OUTCOME_UNKNOWN, Reason.LEASE_EXPIRED)
            assert len(attempts(engine, effect_id)) == 1  # no automatic resend


# --- SIGTERM ----------------------------------------------------------------------------


def test_sigterm_releases_an_in_flight_row_as_possibly_sent(engine, db_url, tmp_path) -> None:
    with provider(mode=Mode.HONOUR, drop_mode=DropMode.HOLD, hold_seconds=30) as (app, base_url):
        # The provider acts, then holds its reply: the send is out and unanswered.
        app.state.faults.replace(FaultSpec.from_json({"script": ["drop_after_commit"]}))
        toml = adapters_file(tmp_path, base_url, honours=True)
        (effect_id,) = seed(engine, 1, now=schema.utcnow())
        with children(tmp_path, db_url, toml) as kids:
            proc = kids.start("--worker-id", "stopping", shutdown_grace="0.3s")
            wait_for(lambda: app.state.ledger.stats()["tickets"] == 1, 20, "the ticket")
            proc.send_signal(signal.SIGTERM)
            # The grace, not the provider's hold: a send still blocked is not waited for
            # (the attempt below is abandoned, not answered).
            assert proc.wait(PATIENCE_S) == 0, kids.logs()
    r = row(engine, effect_id)
    assert (r.status, r.reason, r.maybe_sent, r.lease_owner) == (
        S.PENDING,
        Reason.LEASE_EXPIRED,
        True,
        None,
    )
    (a,) = attempts(engine, effect_id)
    assert (a.outcome, a.late, a.worker) == (AttemptOutcome.ABANDONED, False, "stopping")
    assert a.finished_at is not None


# --- kill -9 while asleep: the wake-up's gate heals ------------------------------------------


@pytest.mark.postgres
def test_a_dispatcher_killed_asleep_stops_costing_notifications(postgres_url, tmp_path) -> None:
    """A dispatcher killed while counted in to the wake-up's gate (PostgreSQL) leaves
    its row; the next dispatcher's count-in drops it, so once that one stops, creates
    notify nobody. Before migration 0009 the count stayed one too high for good."""
    engine = db.create_engine(settings.load(), url=postgres_url)
    db_url = postgres_url
    try:

        def counted() -> list[tuple[int, str]]:
            with db.read(engine) as conn:
                return [
                    (r.pid, r.worker)
                    for r in conn.execute(sa.select(schema.dispatch_sleepers)).all()
                ]

        def sleepers() -> int:
            with db.read(engine) as conn:
                return int(conn.execute(sa.select(schema.dispatch_wakeup.c.sleepers)).scalar_one())

        def gone(pid: int) -> bool:
            with db.read(engine) as conn:
                return not conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = %(pid)s", {"pid": pid}
                ).scalar_one()

        toml = adapters_file(tmp_path, "http://127.0.0.1:9", honours=True)  # nothing is sent
        with children(tmp_path, db_url, toml) as kids:
            killed = kids.start("--worker-id", "killed", poll_interval="60s")
            wait_for(lambda: [w for _, w in counted()] == ["killed"], 30, "killed counts in")
            ((dead_pid, _),) = counted()
            killed.kill()
            killed.wait(10)
            wait_for(lambda: gone(dead_pid), 10, "its LISTEN backend ends")
            assert sleepers() == 1  # nobody counted it out

            stopped = kids.start("--worker-id", "stopped", poll_interval="60s")
            wait_for(lambda: [w for _, w in counted()] == ["stopped"], 30, "the next counts in")
            assert sleepers() == 1
            stopped.send_signal(signal.SIGTERM)
            assert stopped.wait(PATIENCE_S) == 0, kids.logs()
            assert (sleepers(), counted()) == (0, [])
    finally:
        engine.dispose()
