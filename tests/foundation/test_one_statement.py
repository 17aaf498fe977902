"""The create's writers: rows collected into one statement, or written in a transaction.

On PostgreSQL a handler that only calls ``ctx.insert`` has its rows sent with
the receipt and the outbox rows in one statement that commits alone; a handler
that takes ``ctx.conn`` (or asks an insert for a value only the database
knows) runs again in an ordinary transaction. Either way the contract holds:
one task, one record, one outbox row per effect, or nothing. And what falls
between the key's lookup and the statement (a concurrent create of the key, a
tombstone) writes nothing of ours.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from outbox import Outbox, db, errors, faults, schema, tools
from outbox.creating import create
from tests.foundation.conftest import counts

TOOL = "create_support_task"
ARGS = {"subject": "Check delayed delivery"}


class Note(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    subject: str


def _task_row(ctx: tools.ToolContext, subject: str) -> dict[str, Any]:
    return {
        "tenant": ctx.tenant,
        "subject": subject,
        "body": "",
        "priority": "normal",
        "status": "open",
        "operation_id": ctx.operation_id,
        "created_at": ctx.now,
        "updated_at": ctx.now,
    }


def _output(ctx: tools.ToolContext, task_id: int) -> tools.ToolOutput:
    effect = tools.EffectSpec("open_ticket", "helpdesk", {"subject": "s"})
    receipt = {"operation_id": ctx.operation_id, "task_id": task_id}
    return tools.ToolOutput(receipt, [effect], task_id)


runs: list[str] = []


def with_conn(ctx: tools.ToolContext, args: Note) -> tools.ToolOutput:
    """Writes through the connection: SQLAlchemy Core, as a handler may."""
    runs.append("with_conn")
    result = ctx.conn.execute(
        sa.insert(schema.tasks).returning(schema.tasks.c.id), _task_row(ctx, args.subject)
    )
    return _output(ctx, result.scalar_one())


def returning_subject(ctx: tools.ToolContext, args: Note) -> tools.ToolOutput:
    """Asks for a column that is not the auto-incremented key."""
    runs.append("returning_subject")
    ctx.insert(schema.tasks, _task_row(ctx, args.subject), returning="subject")
    task_id = ctx.conn.execute(sa.select(sa.func.max(schema.tasks.c.id))).scalar_one()
    return _output(ctx, task_id)


def two_rows(ctx: tools.ToolContext, args: Note) -> tools.ToolOutput:
    """Two business rows, the second without RETURNING, and no effects."""
    runs.append("two_rows")
    first = ctx.insert(schema.tasks, _task_row(ctx, args.subject), returning="id")
    ctx.insert(schema.tasks, _task_row(ctx, args.subject + " (copy)"))
    return tools.ToolOutput({"operation_id": ctx.operation_id, "task_id": first}, [], first)


def swallows(ctx: tools.ToolContext, args: Note) -> tools.ToolOutput:
    """A careless handler: it must not swallow the switch to the transaction."""
    runs.append("swallows")
    try:
        conn = ctx.conn
    except Exception:  # noqa: BLE001 - what a careless handler does
        return _output(ctx, -1)
    result = conn.execute(
        sa.insert(schema.tasks).returning(schema.tasks.c.id), _task_row(ctx, args.subject)
    )
    return _output(ctx, result.scalar_one())


@pytest.fixture
def handlers_box(db_url: str, clock) -> Iterator[Outbox]:
    registry = tools.default_registry()
    for handler in (with_conn, returning_subject, two_rows, swallows):
        registry.register(tools.Tool(handler.__name__, 1, Note, handler))
    runs.clear()
    with Outbox(db_url, clock=clock, registry=registry) as box:
        box.create_tenant("acme")
        yield box
        assert box.engine.pool.checkedout() == 0


@pytest.mark.parametrize("tool", ["with_conn", "returning_subject", "swallows"])
def test_a_handler_that_needs_the_connection_creates_once(handlers_box: Outbox, tool: str):
    box = handlers_box
    first = box.execute("acme", "op-1", tool, {"subject": "s"})
    again = box.execute("acme", "op-1", tool, {"subject": "s"})
    assert first.created and again.replayed and again.receipt_json == first.receipt_json
    assert first.receipt["task_id"] > 0
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}
    # It first ran on the fast path, up to ``ctx.conn``; then in a transaction.
    assert runs == [tool, tool]


def test_rows_without_returning_and_no_effects_travel_with_the_record(handlers_box: Outbox):
    box = handlers_box
    first = box.execute("acme", "op-1", "two_rows", {"subject": "s"})
    assert first.created and runs == ["two_rows"]
    with db.read(box.engine) as conn:
        rows = conn.execute(
            sa.select(schema.tasks.c.id, schema.tasks.c.subject).order_by(schema.tasks.c.id)
        ).all()
        task_id = conn.execute(sa.select(schema.operations.c.task_id)).scalar_one()
    assert [subject for _, subject in rows] == ["s", "s (copy)"]
    assert rows[0][0] == first.receipt["task_id"] == task_id
    assert counts(box) == {"tasks": 2, "operations": 1, "outbox": 0}


@pytest.fixture
def pg_box(postgres_url: str, clock) -> Iterator[Outbox]:
    with Outbox(postgres_url, clock=clock) as box:
        box.create_tenant("acme")
        yield box
        assert box.engine.pool.checkedout() == 0


def _once(action: Any) -> Any:
    """A crash-window action that runs once: the create it starts must not re-enter it."""

    def run() -> None:
        faults.disarm()
        action()

    return run


@pytest.mark.postgres
def test_a_create_that_commits_between_lookup_and_statement_wins(
    pg_box: Outbox, postgres_url, clock
):
    """The statement inserts nothing when the key was taken after our lookup: we replay."""
    with Outbox(postgres_url, clock=clock) as other:
        winner: list[create.ExecuteResult] = []
        faults.arm(
            "create.after_outbox_insert",
            _once(lambda: winner.append(other.execute("acme", "op-1", TOOL, ARGS))),
        )
        ours = pg_box.execute("acme", "op-1", TOOL, ARGS)
    assert winner[0].created
    assert ours.replayed and ours.receipt_json == winner[0].receipt_json
    assert counts(pg_box) == {"tasks": 1, "operations": 1, "outbox": 1}


@pytest.mark.postgres
def test_a_tombstone_written_between_lookup_and_statement_writes_nothing(pg_box: Outbox, clock):
    """The record's insert is guarded by the tombstone, and every other row by the record."""
    now = clock()
    tombstone = {
        "tenant": "acme",
        "operation_id": "op-1",
        "args_digest": "0" * 64,
        "created_at": now - timedelta(days=8),
        "expired_at": now,
        "forget_at": now + timedelta(days=30),
    }

    def expire() -> None:
        with db.write(pg_box.engine) as conn:
            conn.execute(sa.insert(schema.tombstones), tombstone)

    faults.arm("create.after_outbox_insert", _once(expire))
    with pytest.raises(errors.OperationExpired):
        pg_box.execute("acme", "op-1", TOOL, ARGS)
    assert counts(pg_box) == {"tasks": 0, "operations": 0, "outbox": 0}


@pytest.mark.postgres
def test_ids_come_from_the_sequence_in_blocks_and_a_forked_child_draws_its_own(pg_box: Outbox):
    first = pg_box.execute("acme", "op-1", TOOL, ARGS).receipt["task_id"]
    second = pg_box.execute("acme", "op-2", TOOL, ARGS).receipt["task_id"]
    assert (first, second) == (1, 2)  # one block drawn, taken in order
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's engine, and none of its ids
        code = 1
        try:
            pg_box.engine.dispose(close=False)
            task_id = pg_box.execute("acme", "op-child", TOOL, ARGS).receipt["task_id"]
            os.write(write, str(task_id).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = int(os.read(read, 64) or b"0")
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child == create._Ids.BLOCK + 1  # a fresh block, not the parent's next id
    third = pg_box.execute("acme", "op-3", TOOL, ARGS).receipt["task_id"]
    assert third == 3
    assert counts(pg_box) == {"tasks": 4, "operations": 4, "outbox": 4}


MANY = 40  # more than one statement folds


def many_rows(ctx: tools.ToolContext, args: Note) -> tools.ToolOutput:
    runs.append("many_rows")
    first = ctx.insert(schema.tasks, _task_row(ctx, args.subject), returning="id")
    for i in range(1, MANY):
        ctx.insert(schema.tasks, _task_row(ctx, f"{args.subject} {i}"))
    effects = [tools.EffectSpec(f"notify_{i}", "helpdesk", {"n": i}) for i in range(MANY)]
    return tools.ToolOutput({"operation_id": ctx.operation_id, "task_id": first}, effects, first)


def test_a_create_with_many_rows_and_effects_takes_the_general_path(db_url: str, clock, backend):
    registry = tools.default_registry()
    registry.register(tools.Tool("many_rows", 1, Note, many_rows))
    runs.clear()
    with Outbox(db_url, clock=clock, registry=registry) as box:
        box.create_tenant("acme")
        first = box.execute("acme", "op-1", "many_rows", {"subject": "s"})
        again = box.execute("acme", "op-1", "many_rows", {"subject": "s"})
        assert first.created and again.replayed and again.receipt_json == first.receipt_json
        assert counts(box) == {"tasks": MANY, "operations": 1, "outbox": MANY}
        # PostgreSQL stopped collecting at the fold limit and ran it in a transaction.
        assert runs == (["many_rows", "many_rows"] if backend == "postgres" else ["many_rows"])
        assert box.engine.pool.checkedout() == 0


@pytest.mark.postgres
def test_a_statement_that_committed_before_its_connection_died_replays(pg_box: Outbox, monkeypatch):
    """The one statement commits alone; its reply is lost with the connection.
    The create runs once more on a new connection, finds its own record, and
    answers it: one task, one record, one outbox row, the stored receipt."""
    from sqlalchemy import exc

    real = db.driver_execute
    lost: list[str] = []

    def reply_lost(conn, sql, params, *, many=False):  # type: ignore[no-untyped-def]
        cursor = real(conn, sql, params, many=many)
        if sql.startswith("WITH record") and not lost:
            lost.append(sql)
            error = ConnectionResetError("server closed the connection unexpectedly")
            conn.invalidate(error)
            raise exc.OperationalError(sql, params, error, connection_invalidated=True)
        return cursor

    monkeypatch.setattr(db, "driver_execute", reply_lost)
    result = pg_box.execute("acme", "op-1", TOOL, ARGS)
    assert lost, "the one statement was not reached"
    assert result.replayed and result.status_code == 201
    assert result.receipt_json == pg_box.execute("acme", "op-1", TOOL, ARGS).receipt_json
    assert pg_box.get_operation("acme", "op-1")["receipt"] == result.receipt
    assert counts(pg_box) == {"tasks": 1, "operations": 1, "outbox": 1}
