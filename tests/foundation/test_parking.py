"""``db.Parking``: a few autocommit connections kept out between creates (PostgreSQL).

A create's one statement runs in autocommit (``db.autocommit``); its connection
waits, still checked out and in autocommit, for the next call instead of going
through the pool's checkout and return each time. What must hold: each statement
still commits alone; parked connections never take capacity a caller was
promised; a connection that died while parked is not handed out twice, and one
disconnect gives back every parked connection; a failed call or a connection left
in a transaction is never parked; an old one goes back to the pool; ``dispose``
closes them; a forked child never uses its parent's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import exc
from sqlalchemy.engine import Engine

from outbox import db, settings
from tests.foundation.test_disconnect import _terminate
from tests.support import notify

pytestmark = pytest.mark.postgres


def _engine(url: str, **kwargs: Any) -> Engine:
    return db.create_engine(settings.load(), url=url, **kwargs)


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    engine = _engine(postgres_url)
    yield engine
    assert db.in_use(engine) == 0  # nothing left checked out but what is parked
    engine.dispose()


def _parking(engine: Engine) -> db.Parking:
    assert isinstance(engine.pool, db.Parking)
    return engine.pool


def _pid(conn: db.Direct) -> int:
    return int(db.driver_execute(conn, "SELECT pg_backend_pid()", ()).fetchone()[0])


def _park_at_once(engine: Engine, count: int) -> set[int]:
    """``count`` calls that hold their connections at the same time, then park them."""
    together = threading.Barrier(count, timeout=30)
    pids: list[int] = []

    def body(conn: db.Direct) -> None:
        pids.append(_pid(conn))
        together.wait()

    threads = [threading.Thread(target=db.autocommit, args=(engine, body)) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(set(pids)) == count
    return set(pids)


def test_the_next_call_runs_on_the_parked_connection_and_each_statement_commits_alone(
    engine: Engine, postgres_url: str
) -> None:
    first = db.autocommit(engine, _pid)
    db.autocommit(engine, lambda c: db.driver_execute(c, "CREATE TABLE t (x int)", ()))
    db.autocommit(engine, lambda c: db.driver_execute(c, "INSERT INTO t VALUES (1)", ()))
    with psycopg.connect(notify.dsn(postgres_url)) as other:
        assert other.execute("SELECT x FROM t").fetchall() == [(1,)]
    assert db.autocommit(engine, _pid) == first
    parked = _parking(engine).parked()
    raw: Any = parked[0].connection.dbapi_connection
    assert len(parked) == 1 and raw.autocommit
    assert engine.pool.checkedout() == 1 and db.in_use(engine) == 0


def test_parked_connections_leave_callers_the_capacity_they_were_given(
    postgres_url: str,
) -> None:
    engine = _engine(postgres_url, pool_size=2, max_overflow=1, pool_timeout=0.5)
    try:
        _park_at_once(engine, db.Parking.LIMIT)
        assert len(_parking(engine).parked()) == db.Parking.LIMIT
        # pool_size + max_overflow checked out at once, with the parking full:
        held = [engine.connect() for _ in range(3)]
        try:
            for conn in held:
                assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1
            # and the limit is still a limit.
            with pytest.raises(exc.TimeoutError):
                engine.connect()
        finally:
            for conn in held:
                conn.close()
    finally:
        engine.dispose()


def test_at_most_limit_connections_are_parked(engine: Engine) -> None:
    pids = _park_at_once(engine, db.Parking.LIMIT + 2)
    parked = _parking(engine).parked()
    assert len(parked) == db.Parking.LIMIT
    assert {_pid(conn) for conn in parked} <= pids
    assert engine.pool.checkedin() == 2  # the others went back to the pool


def test_a_parked_connection_that_died_is_replaced_and_the_statement_runs_again(
    engine: Engine,
) -> None:
    dead = db.autocommit(engine, _pid)
    _terminate({dead})
    runs: list[int] = []

    def body(conn: db.Direct) -> int:
        runs.append(1)
        return _pid(conn)

    assert db.autocommit(engine, body) != dead
    assert len(runs) == 2  # once on the dead connection, once on a new one
    assert [_pid(c) for c in _parking(engine).parked()] != [dead]


def test_one_disconnect_gives_back_every_parked_connection(engine: Engine) -> None:
    """A restart kills every parked connection: after the first is found dead, the one
    retry must not draw the next dead one from the parking."""
    pids = _park_at_once(engine, 3)
    _terminate(pids)
    runs: list[int] = []

    def body(conn: db.Direct) -> int:
        runs.append(1)
        return _pid(conn)

    assert db.autocommit(engine, body) not in pids
    assert len(runs) == 2
    assert len(_parking(engine).parked()) == 1  # only the new one


def test_a_failed_call_is_not_parked_and_its_connection_goes_back_out_of_autocommit(
    engine: Engine,
) -> None:
    def fails(conn: db.Direct) -> None:
        db.driver_execute(conn, "SELECT 1", ())
        raise ValueError("the handler refused")

    with pytest.raises(ValueError, match="refused"):
        db.autocommit(engine, fails)
    assert _parking(engine).parked() == []
    with engine.connect() as conn:
        raw: Any = conn.connection.dbapi_connection
        assert raw.autocommit is False


def test_a_connection_left_in_a_transaction_is_not_parked(engine: Engine) -> None:
    db.autocommit(engine, lambda c: db.driver_execute(c, "BEGIN", ()))
    assert _parking(engine).parked() == []
    # The pool's reset ended that transaction: the next caller starts clean.
    with engine.connect() as conn:
        raw: Any = conn.connection.dbapi_connection
        assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_connection_parked_too_long_goes_back_to_the_pool(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    db.autocommit(engine, _pid)
    parking = _parking(engine)
    monkeypatch.setattr(db.Parking, "MAX_PARKED_S", -1.0)  # every parked one is too old
    assert parking.take() is None
    assert parking.parked() == [] and engine.pool.checkedin() == 1


def test_dispose_closes_the_parked_connections(postgres_url: str) -> None:
    engine = _engine(postgres_url)
    pid = db.autocommit(engine, _pid)
    parking = _parking(engine)
    engine.dispose()
    assert parking.parked() == []
    with psycopg.connect(notify.dsn(postgres_url), autocommit=True) as admin:
        # The backend leaves pg_stat_activity once it has exited: look up to 300 times.
        for _ in range(300):
            if not admin.execute("SELECT FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall():
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"backend {pid} still connected after dispose")


def test_a_call_that_ends_after_dispose_is_not_parked(postgres_url: str) -> None:
    """``Outbox.close`` from another thread while a create runs: the create's connection
    must not wait in a pool nobody will close again."""
    engine = _engine(postgres_url)
    parking = _parking(engine)

    def body(conn: db.Direct) -> int:
        engine.dispose()
        return _pid(conn)

    db.autocommit(engine, body)
    assert parking.parked() == []
    engine.dispose()


def test_a_forked_child_does_not_use_or_close_its_parents_parked_connection(
    engine: Engine,
) -> None:
    pid = db.autocommit(engine, _pid)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 0 if _parking(engine).parked() == [] else 3
        os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's session survived the child's exit.
    assert db.autocommit(engine, _pid) == pid


def test_many_threads_share_the_parking(engine: Engine) -> None:
    db.autocommit(engine, lambda c: db.driver_execute(c, "CREATE TABLE n (x int)", ()))
    errors: list[BaseException] = []

    def calls(worker: int) -> None:
        try:
            for i in range(50):
                db.autocommit(
                    engine,
                    lambda c, v=worker * 1000 + i: db.driver_execute(
                        c, "INSERT INTO n VALUES (%(v)s)", {"v": v}
                    ),
                )
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=calls, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    count = db.autocommit(
        engine, lambda c: db.driver_execute(c, "SELECT count(*) FROM n", ()).fetchone()[0]
    )
    assert count == 400
    assert len(_parking(engine).parked()) <= db.Parking.LIMIT
