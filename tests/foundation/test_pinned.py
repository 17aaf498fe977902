"""``db.Pinned``: the dispatcher loop's claim on a connection it holds (PostgreSQL).

It skips the pool's checkout and return on every pass. What must hold: each
statement commits alone, a held connection that died while idle is replaced and
the statement runs once more, a refused statement drops the connection (the next
call starts from the pool), an interrupted one discards it, and ``close`` gives
it back to the pool as the pool hands them out (not in autocommit).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Engine

from outbox import db, settings
from tests.foundation.test_disconnect import _terminate
from tests.support import notify

pytestmark = pytest.mark.postgres


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    engine = db.create_engine(settings.load(), url=postgres_url)
    yield engine
    assert db.in_use(engine) == 0  # nothing left held
    engine.dispose()


def _pid(conn: db.Direct) -> int:
    return int(db.driver_execute(conn, "SELECT pg_backend_pid()", ()).fetchone()[0])


def test_every_call_runs_on_the_one_held_connection_and_commits_alone(
    engine: Engine, postgres_url: str
) -> None:
    pinned = db.Pinned(engine)
    try:
        first = pinned.autocommit(_pid)
        checkouts = db.in_use(engine)
        pinned.autocommit(lambda c: db.driver_execute(c, "CREATE TABLE t (x int)", ()))
        pinned.autocommit(lambda c: db.driver_execute(c, "INSERT INTO t VALUES (1)", ()))
        # Committed: another session sees the row at once.
        with psycopg.connect(notify.dsn(postgres_url)) as other:
            assert other.execute("SELECT x FROM t").fetchall() == [(1,)]
        assert pinned.autocommit(_pid) == first
        assert db.in_use(engine) == checkouts == 1  # held, not checked out again
    finally:
        pinned.close()


def test_a_held_connection_that_died_idle_is_replaced_and_the_statement_runs_again(
    engine: Engine,
) -> None:
    pinned = db.Pinned(engine)
    runs: list[int] = []

    def body(conn: db.Direct) -> int:
        runs.append(1)
        return _pid(conn)

    try:
        dead = pinned.autocommit(_pid)
        _terminate({dead})  # a server restart, an idle timeout
        alive = pinned.autocommit(body)
        assert alive != dead and len(runs) == 2  # failed on the dead one, ran again
        assert pinned.autocommit(_pid) == alive  # and holds the new one
    finally:
        pinned.close()


def test_a_refused_statement_gives_the_connection_back(engine: Engine) -> None:
    pinned = db.Pinned(engine)
    try:
        pinned.autocommit(_pid)
        with pytest.raises(exc.DataError):
            pinned.autocommit(lambda c: db.driver_execute(c, "SELECT 1 / 0", ()))
        assert db.in_use(engine) == 0  # back in the pool, still usable
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1
        assert pinned.autocommit(lambda c: db.driver_execute(c, "SELECT 2", ()).fetchone()[0]) == 2
    finally:
        pinned.close()


def test_an_interrupted_call_discards_the_connection(engine: Engine) -> None:
    pinned = db.Pinned(engine)

    def interrupted(conn: db.Direct) -> None:
        raise KeyboardInterrupt  # mid-statement: the driver's state is unknown

    try:
        before = pinned.autocommit(_pid)
        with pytest.raises(KeyboardInterrupt):
            pinned.autocommit(interrupted)
        assert db.in_use(engine) == 0
        assert pinned.autocommit(_pid) != before  # a new connection, not the suspect one
    finally:
        pinned.close()


def test_close_gives_the_connection_back_out_of_autocommit(engine: Engine) -> None:
    pinned = db.Pinned(engine)
    held = pinned.autocommit(_pid)
    pinned.close()
    pinned.close()  # twice is harmless
    assert db.in_use(engine) == 0
    with engine.connect() as conn:  # the pool's only connection: the one that was held
        assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() == held
        assert conn.connection.dbapi_connection.autocommit is False  # type: ignore[union-attr]
        conn.exec_driver_sql("CREATE TABLE u (x int)")
        conn.rollback()  # a transaction again: rolled back, not committed
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT to_regclass('u')")).scalar_one() is None
