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
        assert db.in_use(box.engine) == 0


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
        assert db.in_use(box.engine) == 0


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
        # PostgreSQL stopped collecting at the fold limit and ran it in a transaction;
        # the replay's optimistic run stopped there too, and the lookup answered it.
        assert runs == (["many_rows"] * 3 if backend == "postgres" else ["many_rows"])
        assert db.in_use(box.engine) == 0


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


def _statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement the fast paths send from now on, first words only."""
    sent: list[str] = []
    real = db.driver_execute

    def counted(conn, sql, params, *, many=False):  # type: ignore[no-untyped-def]
        sent.append(" ".join(sql.split()[:2]))
        return real(conn, sql, params, many=many)

    monkeypatch.setattr(db, "driver_execute", counted)
    return sent


@pytest.mark.postgres
def test_a_first_call_and_a_replay_are_one_round_trip_each(pg_box: Outbox, monkeypatch):
    pg_box.execute("acme", "op-warm", TOOL, ARGS)  # draws the first block of task ids
    sent = _statements(monkeypatch)
    first = pg_box.execute("acme", "op-1", TOOL, ARGS)
    assert first.created and sent == ["WITH record"]
    sent.clear()
    again = pg_box.execute("acme", "op-1", TOOL, ARGS)
    assert again.replayed and again.receipt_json == first.receipt_json
    assert sent == ["WITH record"]  # the lookup rode along; nothing was written
    sent.clear()
    with pytest.raises(errors.IdempotencyKeyReused):
        pg_box.execute("acme", "op-1", TOOL, {"subject": "other"})
    assert sent == ["WITH record"]
    assert counts(pg_box) == {"tasks": 2, "operations": 2, "outbox": 2}


@pytest.mark.postgres
def test_in_a_retry_storm_the_key_is_looked_up_first_and_after_it_not(pg_box: Outbox, monkeypatch):
    """While most recent calls were replays, a replay is the lookup alone (no
    handler run, no write statement); once first calls are back, a first call
    is one statement again."""
    for i in range(20):
        pg_box.execute("acme", f"op-{i}", TOOL, ARGS)
    sent = _statements(monkeypatch)
    storm = [pg_box.execute("acme", f"op-{i}", TOOL, ARGS) for i in range(20)]
    assert all(r.replayed for r in storm)
    # The first replays ride the optimistic statement; then the lookup comes first.
    assert sent[:5] == ["WITH record"] * 5
    assert sent[-10:] == ["SELECT 'op'"] * 10
    sent.clear()
    first_calls = [pg_box.execute("acme", f"new-{i}", TOOL, ARGS) for i in range(20)]
    assert all(r.created for r in first_calls)
    # A first call in a storm pays for the lookup too, until the storm has passed.
    assert sent[:2] == ["SELECT 'op'", "WITH record"]
    assert sent[-10:] == ["WITH record"] * 10
    assert counts(pg_box) == {"tasks": 40, "operations": 40, "outbox": 40}


def test_a_replay_is_answered_even_when_the_handler_now_fails(db_url: str, clock):
    """The stored receipt is the answer to a replay, whatever today's handler does
    (new code, or data it reads that changed): the optimistic run's error is not."""
    failing = False

    def flaky(ctx: tools.ToolContext, args: Note) -> tools.ToolOutput:
        if failing:
            raise ValueError("today's handler refuses this")
        return _output(ctx, ctx.insert(schema.tasks, _task_row(ctx, args.subject), returning="id"))

    registry = tools.default_registry()
    registry.register(tools.Tool("flaky", 1, Note, flaky))
    with Outbox(db_url, clock=clock, registry=registry) as box:
        box.create_tenant("acme")
        first = box.execute("acme", "op-1", "flaky", {"subject": "s"})
        failing = True
        again = box.execute("acme", "op-1", "flaky", {"subject": "s"})
        assert again.replayed and again.receipt_json == first.receipt_json
        with pytest.raises(ValueError, match="refuses"):  # a first call still fails
            box.execute("acme", "op-2", "flaky", {"subject": "s"})
        assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}
        assert db.in_use(box.engine) == 0


def test_a_tool_that_took_the_connection_starts_in_the_transaction(handlers_box: Outbox):
    box = handlers_box
    box.execute("acme", "op-1", "with_conn", {"subject": "s"})
    assert runs == ["with_conn", "with_conn"]  # up to ``ctx.conn``, then in a transaction
    runs.clear()
    second = box.execute("acme", "op-2", "with_conn", {"subject": "t"})
    replay = box.execute("acme", "op-2", "with_conn", {"subject": "t"})
    assert second.created and replay.replayed and replay.receipt_json == second.receipt_json
    assert runs == ["with_conn"]  # once: no run for nothing, and none for the replay
    assert counts(box) == {"tasks": 2, "operations": 2, "outbox": 2}


@pytest.mark.postgres
def test_a_create_committed_while_our_statement_waits_is_found_after_it(
    pg_box: Outbox, postgres_url: str
):
    """Our statement's snapshot predates the other create, so the lookup riding in it
    sees nothing; its ON CONFLICT waits for the other to commit and writes nothing.
    The key is looked up again, after, and the other's record answers."""
    import threading
    import time

    holder = sa.create_engine(db.normalise_url(postgres_url), poolclass=sa.pool.NullPool)
    try:
        with holder.connect() as other:
            pid = other.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            other.execute(
                sa.insert(schema.operations),
                {
                    "tenant": "acme",
                    "operation_id": "op-1",
                    "tool": TOOL,
                    "payload_version": 1,
                    "args_digest": "f" * 64,  # other arguments than ours
                    "receipt": "{}",
                    "status_code": 201,
                    "created_at": pg_box.clock(),
                    "expires_at": pg_box.clock() + timedelta(days=1),
                },
            )  # not committed: our insert of the key must wait for it
            outcome: list[BaseException | create.ExecuteResult] = []

            def ours() -> None:
                try:
                    outcome.append(pg_box.execute("acme", "op-1", TOOL, ARGS))
                except BaseException as error:  # noqa: BLE001 - handed to the test
                    outcome.append(error)

            thread = threading.Thread(target=ours)
            thread.start()
            waiting = (  # a lock our create waits for, in this test's database only
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                f" WHERE NOT l.granted AND a.datname = current_database() AND l.pid <> {pid}"
            )
            for _ in range(2000):  # bounded by count; each probe is a round trip
                if other.exec_driver_sql(waiting).scalar_one():
                    break
                time.sleep(0.005)
            else:
                pytest.fail("our create never waited for the other's key")
            other.commit()
            thread.join(timeout=30)
    finally:
        holder.dispose()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.IdempotencyKeyReused)
    assert counts(pg_box) == {"tasks": 0, "operations": 1, "outbox": 0}
