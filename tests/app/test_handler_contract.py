"""The handler contract: a handler may run twice for one create; only the database
writes of the run that commits count; it never calls the outside world.

Each test forces the second run the way the create path really does it, and
counts: the handler ran twice, and there is one refund row, one record and
one outbox row.

- A handler that takes ``ctx.conn`` after an insert: its first run's rows
  are dropped (SQLite: the transaction is rolled back; PostgreSQL: the rows
  collected for the one statement are never sent) and it runs again in an
  ordinary transaction.
- A crash after the handler ran and before the commit, then the caller's
  retry with the same key: the first run's rows were rolled back.
- PostgreSQL: the connection dies during the handler's transaction; the
  transaction runs once more on a new connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox import Outbox, db, errors, faults, schema, settings, tools
from outbox.app import App
from tests.conftest import _admin_engine
from tests.support.patience import TERMINATE_WAIT_MS

ARGS = {"order_id": "ord_1", "amount_cents": 1999, "currency": "EUR", "reason": "damaged"}


class Runs:
    def __init__(self) -> None:
        self.count = 0


def refund_tool(runs: Runs, *, after_insert=None) -> tools.Tool:  # type: ignore[no-untyped-def]
    from refunds_app.tools import IssueRefundArgs, issue_refund

    def handler(ctx: tools.ToolContext, args: IssueRefundArgs) -> tools.ToolOutput:
        runs.count += 1
        output = issue_refund(ctx, args)
        if after_insert is not None:
            after_insert(ctx, runs.count)
        return output

    return tools.Tool("issue_refund", 1, IssueRefundArgs, handler, adapters=("payments",))


def box_for(url: str, tool: tools.Tool, clock) -> Outbox:  # type: ignore[no-untyped-def]
    from refunds_app.app import app as example

    app = App(
        "refunds",
        tools=[tool],
        adapters_file=example.adapters_file,
        metadata=example.metadata,
        migrations=example.migrations,
    )
    box = Outbox(url, app=app, clock=clock)
    box.create_tenant("shop")
    return box


def counted(box: Outbox) -> dict[str, int]:
    from refunds_app import tables

    with db.read(box.engine) as conn:
        return {
            name: conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for name, table in (
                ("refunds", tables.refunds),
                ("operations", schema.operations),
                ("outbox", schema.outbox),
            )
        }


@pytest.fixture
def runs() -> Runs:
    return Runs()


@pytest.fixture
def closing() -> Iterator[list[Outbox]]:
    boxes: list[Outbox] = []
    yield boxes
    for box in boxes:
        assert db.in_use(box.engine) == 0
        box.close()


def test_a_handler_that_takes_the_connection_runs_twice_and_writes_once(
    app_db_url, runs, clock, closing
):
    def take_connection(ctx: tools.ToolContext, run: int) -> None:
        ctx.conn.execute(sa.select(1))  # the first run ends here: it needs a transaction

    box = box_for(app_db_url, refund_tool(runs, after_insert=take_connection), clock)
    closing.append(box)
    result = box.execute("shop", "refund-1", "issue_refund", ARGS)
    assert result.created and runs.count == 2
    assert counted(box) == {"refunds": 1, "operations": 1, "outbox": 1}
    # The receipt names the row the committing run wrote.
    from refunds_app import tables

    with db.read(box.engine) as conn:
        row = conn.execute(sa.select(tables.refunds)).one()
    assert result.receipt["refund_id"] == row.id and row.operation_id == "refund-1"

    again = box.execute("shop", "refund-1", "issue_refund", ARGS)
    assert again.replayed and again.receipt_json == result.receipt_json
    assert runs.count == 2  # a replay never runs the handler
    assert counted(box) == {"refunds": 1, "operations": 1, "outbox": 1}


def test_a_crash_after_the_handler_ran_keeps_nothing_and_the_retry_writes_once(
    app_db_url, runs, clock, closing
):
    box = box_for(app_db_url, refund_tool(runs), clock)
    closing.append(box)
    with (
        faults.armed("create.after_task_insert", faults.InjectedFault),
        pytest.raises(faults.InjectedFault),
    ):
        box.execute("shop", "refund-2", "issue_refund", ARGS)
    assert runs.count == 1
    assert counted(box) == {"refunds": 0, "operations": 0, "outbox": 0}

    result = box.execute("shop", "refund-2", "issue_refund", ARGS)
    assert result.created and runs.count == 2
    assert counted(box) == {"refunds": 1, "operations": 1, "outbox": 1}


@pytest.mark.postgres
def test_a_connection_lost_during_the_handlers_transaction_runs_it_again(
    postgres_url, refunds_app, runs, clock, closing
):
    engine = db.create_engine(settings.load(), url=postgres_url)
    try:
        refunds_app.upgrade(engine)
    finally:
        engine.dispose()

    def lose_connection(ctx: tools.ToolContext, run: int) -> None:
        pid = ctx.conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        if run == 2:  # the first run in a transaction: its connection dies under it
            admin = _admin_engine()
            try:
                with admin.connect() as conn:
                    conn.execute(
                        sa.text("SELECT pg_terminate_backend(:pid, :wait)"),
                        {"pid": pid, "wait": TERMINATE_WAIT_MS},
                    )
            finally:
                admin.dispose()
            ctx.conn.exec_driver_sql("SELECT 1")  # fails: the server side is gone

    box = box_for(postgres_url, refund_tool(runs, after_insert=lose_connection), clock)
    closing.append(box)
    result = box.execute("shop", "refund-3", "issue_refund", ARGS)
    # One-statement try (needs ctx.conn), the transaction that lost its
    # connection, and the transaction that committed.
    assert result.created and runs.count == 3
    assert counted(box) == {"refunds": 1, "operations": 1, "outbox": 1}


def test_the_database_refuses_a_second_refund_for_one_operation(app_db_url, runs, clock, closing):
    """The app's own constraint backs the contract up: one refund row per operation."""
    from refunds_app import tables

    box = box_for(app_db_url, refund_tool(runs), clock)
    closing.append(box)
    box.execute("shop", "refund-4", "issue_refund", ARGS)
    row = {
        "tenant": "shop",
        "operation_id": "refund-4",
        "order_id": "ord_1",
        "amount_cents": 1,
        "currency": "EUR",
        "reason": "x",
        "created_at": clock(),
    }
    with pytest.raises((sa.exc.IntegrityError, errors.OutboxError)), db.write(box.engine) as conn:
        conn.execute(sa.insert(tables.refunds), row)
