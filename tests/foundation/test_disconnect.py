"""A pooled connection that died while idle: the create path has no pre-ping, so it retries.

PostgreSQL only: ``pg_terminate_backend`` kills the server side of every pooled
connection, as a server restart or an idle timeout would. The create's first
statement then fails as a disconnect, before anything was committed, and the
transaction runs once more on a new connection: one task, the right receipt.
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from outbox import Outbox, db, schema
from outbox.creating import create
from tests.conftest import _admin_engine
from tests.foundation.conftest import counts
from tests.support.patience import TERMINATE_WAIT_MS

pytestmark = pytest.mark.postgres

TOOL = "create_support_task"
ARGS = {"subject": "Check delayed delivery"}


@pytest.fixture
def postgres_box(postgres_url: str, clock) -> Outbox:
    with Outbox(postgres_url, clock=clock) as outbox:
        outbox.create_tenant("acme")
        yield outbox
        assert db.in_use(outbox.engine) == 0


def _backend_pids(box: Outbox) -> set[int]:
    """The server processes of the pool's idle connections (each checked out, then
    returned) and of the connections parked for the next create."""
    parking = box.engine.pool
    assert isinstance(parking, db.Parking)
    parked = {
        db.driver_execute(conn, "SELECT pg_backend_pid()", ()).fetchone()[0]
        for conn in parking.parked()
    }
    held = [box.engine.connect() for _ in range(box.engine.pool.checkedin())]
    try:
        return parked | {c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() for c in held}
    finally:
        for conn in held:
            conn.close()


def _terminate(pids: set[int]) -> None:
    admin = _admin_engine()
    try:
        with admin.connect() as conn:
            for pid in pids:
                # Waits (up to 5 s) until the backend is gone.
                assert conn.execute(
                    sa.text("SELECT pg_terminate_backend(:pid, :wait)"),
                    {"pid": pid, "wait": TERMINATE_WAIT_MS},
                ).scalar_one()
    finally:
        admin.dispose()


def test_a_create_on_a_terminated_connection_runs_again_and_creates_once(postgres_box: Outbox):
    box = postgres_box
    box.execute("acme", "op-warm", TOOL, ARGS)  # the pool now holds a used connection
    pids = _backend_pids(box)
    assert pids
    _terminate(pids)

    result = box.execute("acme", "op-1", TOOL, ARGS)

    assert result.created and result.status_code == 201
    # The receipt names the one task row the committing run wrote (ids are
    # unique, not dense: the run on the dead connection drew one too).
    with db.read(box.engine) as conn:
        task_id = conn.execute(
            sa.select(schema.tasks.c.id).where(schema.tasks.c.operation_id == "op-1")
        ).scalar_one()
    assert result.receipt == {"operation_id": "op-1", "status": "created", "task_id": task_id}
    assert counts(box) == {"tasks": 2, "operations": 2, "outbox": 2}
    # It ran on a new connection: the dead one was dropped, not reused.
    assert not _backend_pids(box) & pids
    assert box.get_operation("acme", "op-1")["receipt"] == result.receipt


def test_a_replay_on_a_terminated_connection_answers_the_stored_receipt(postgres_box: Outbox):
    box = postgres_box
    first = box.execute("acme", "op-1", TOOL, ARGS)
    _terminate(_backend_pids(box))

    again = box.execute("acme", "op-1", TOOL, ARGS)

    assert again.replayed and again.receipt_json == first.receipt_json
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}


def test_other_paths_keep_the_pre_ping(postgres_box: Outbox):
    box = postgres_box
    box.execute("acme", "op-1", TOOL, ARGS)
    _terminate(_backend_pids(box))
    # A read outside ``db.transact`` pings first and gets a new connection.
    assert box.get_operation("acme", "op-1")["status_code"] == 201


def test_a_second_dead_connection_is_not_retried_again(postgres_box: Outbox, monkeypatch):
    """At most one more try: a server that keeps dropping us is an error, not a loop."""
    box = postgres_box
    box.execute("acme", "op-warm", TOOL, ARGS)
    calls = []

    def body(conn: sa.Connection) -> None:
        calls.append(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
        _terminate({calls[-1]})
        conn.exec_driver_sql("SELECT 1")

    with pytest.raises(sa.exc.DBAPIError) as caught:
        db.transact(box.engine, body)
    assert caught.value.connection_invalidated
    assert len(calls) == 2 and calls[0] != calls[1]


def _fill_pool(box: Outbox, size: int) -> None:
    """Leave ``size`` used connections idle in the pool, as after a burst of requests."""
    held = [box.engine.connect() for _ in range(size)]
    for conn in held:
        conn.exec_driver_sql("SELECT 1")
    for conn in held:
        conn.close()


@pytest.mark.parametrize("replay", [False, True], ids=["create", "replay"])
def test_after_a_restart_every_idle_connection_is_dead_and_the_next_call_still_succeeds(
    postgres_box: Outbox, replay: bool
):
    """A restart kills every pooled connection, not one: the first disconnect must
    drop the pool's older connections too (as SQLAlchemy's own ``Connection`` does),
    or the one retry draws the next dead one and the caller gets an error."""
    box = postgres_box
    first = box.execute("acme", "op-1", TOOL, ARGS)
    _fill_pool(box, 4)
    pids = _backend_pids(box)
    assert len(pids) == 4 + 1  # the four idle in the pool, and the first create's, parked
    _terminate(pids)

    result = box.execute("acme", "op-1" if replay else "op-2", TOOL, ARGS)

    assert result.replayed is replay and result.status_code == 201
    if replay:
        assert result.receipt_json == first.receipt_json
    assert counts(box) == {
        "tasks": 1 + (not replay),
        "operations": 1 + (not replay),
        "outbox": 1 + (not replay),
    }
    assert not _backend_pids(box) & pids


def test_after_a_restart_the_same_create_twice_at_once_makes_one_task(postgres_box: Outbox):
    """Two callers retry the same key at the same moment, both on dead connections:
    both run again on new ones, one creates and the other replays its receipt."""
    box = postgres_box
    _fill_pool(box, 4)
    _terminate(_backend_pids(box))
    start = threading.Barrier(2)
    results = []

    def call() -> None:
        start.wait()
        results.append(box.execute("acme", "op-1", TOOL, ARGS))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(r.created for r in results) == [False, True]
    assert results[0].receipt_json == results[1].receipt_json
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}


def test_a_create_that_draws_its_ids_on_a_dead_connection_runs_again(postgres_box: Outbox):
    """The handler's task id comes from a block drawn on the create's connection; when
    that draw is the first statement to meet the dead server, the create runs again
    on a new connection (not a lookup on the dead one, which raised AssertionError)."""
    box = postgres_box
    box.execute("acme", "op-warm", TOOL, ARGS)
    create._IDS.clear()  # the next create draws a block first
    _terminate(_backend_pids(box))

    result = box.execute("acme", "op-1", TOOL, ARGS)

    assert result.created and result.status_code == 201
    assert counts(box) == {"tasks": 2, "operations": 2, "outbox": 2}
