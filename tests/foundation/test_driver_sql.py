"""Statements sent straight to the driver behave as SQLAlchemy's would.

The create path renders its statements once (``db.driver_sql``) and runs them
on the driver's cursor (``db.driver_execute``), skipping SQLAlchemy's binding
and result handling. What must not change: the values stored, the errors
raised (SQLAlchemy's kinds, so ``translate_errors`` and the disconnect retry
still see them), and a naive datetime still refused.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from sqlalchemy import exc

from outbox import Outbox, db, errors, schema, states
from outbox.creating import create


def _task(tenant: str, operation_id: str, at: datetime) -> dict[str, object]:
    return {
        "tenant": tenant,
        "subject": "Late parcel",
        "body": "It was promised for Tuesday.",
        "priority": "high",
        "status": "open",
        "operation_id": operation_id,
        "created_at": at,
        "updated_at": at + timedelta(microseconds=7),
    }


def test_insert_row_stores_what_the_orm_path_reads_back(box: Outbox) -> None:
    at = datetime(2026, 12, 3, 9, 30, 1, 123456, tzinfo=UTC)
    with db.write(box.engine) as conn:
        task_id = db.insert_row(conn, schema.tasks, _task("acme", "op-1", at), "id")
    assert isinstance(task_id, int)
    with db.read(box.engine) as conn:
        row = conn.execute(sa.select(schema.tasks).where(schema.tasks.c.id == task_id)).one()
    assert row.created_at == at and row.created_at.tzinfo is not None
    assert row.updated_at == at + timedelta(microseconds=7)
    assert (row.tenant, row.operation_id, row.priority) == ("acme", "op-1", "high")
    # Sorting and comparing in SQL still work: the text on SQLite is UTCDateTime's.
    with db.read(box.engine) as conn:
        later = conn.execute(
            sa.select(sa.func.count())
            .select_from(schema.tasks)
            .where(schema.tasks.c.created_at > at - timedelta(microseconds=1))
        ).scalar_one()
    assert later == 1


def test_a_datetime_in_another_zone_is_stored_as_the_same_instant(box: Outbox) -> None:
    at = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
    elsewhere = at.astimezone(ZoneInfo("Asia/Tokyo"))
    with db.write(box.engine) as conn:
        task_id = db.insert_row(conn, schema.tasks, _task("acme", "op-2", elsewhere), "id")
    with db.read(box.engine) as conn:
        stored = conn.execute(
            sa.select(schema.tasks.c.created_at).where(schema.tasks.c.id == task_id)
        ).scalar_one()
    assert stored == at


def test_a_naive_datetime_is_refused_and_nothing_is_written(box: Outbox) -> None:
    naive = datetime(2026, 12, 3, 10, 0)  # the mistake under test
    with pytest.raises(ValueError, match="naive datetime"), db.write(box.engine) as conn:
        db.insert_row(conn, schema.tasks, _task("acme", "op-3", naive), "id")
    # The create path refuses it before any statement runs.
    with pytest.raises(ValueError, match="naive datetime"):
        create.execute(
            box.engine,
            box.tools,
            tenant="acme",
            operation_id="op-3",
            tool="create_support_task",
            arguments={"subject": "Late parcel"},
            now=naive,
            retention=timedelta(days=1),
            effect_deadline=timedelta(minutes=5),
        )
    with db.read(box.engine) as conn:
        for table in (schema.tasks, schema.operations, schema.outbox):
            assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one() == 0


def test_enum_values_are_stored_as_their_values(box: Outbox) -> None:
    assert db.driver_values("sqlite", {"s": states.EffectStatus.PENDING}) == {"s": "pending"}
    assert db.driver_values("postgresql", {"s": states.Reason.CREATED}) == {"s": "created"}


def test_a_constraint_violation_is_sqlalchemys_integrity_error(box: Outbox) -> None:
    at = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
    with pytest.raises(exc.IntegrityError) as raised, db.write(box.engine) as conn:
        db.insert_row(conn, schema.tasks, _task("no-such-tenant", "op-4", at), "id")
    assert not raised.value.connection_invalidated
    # The create path maps the same error to the caller's error.
    with pytest.raises(errors.UnknownTenant):
        box.execute("no-such-tenant", "op-4", "create_support_task", {"subject": "x"})
    assert db.in_use(box.engine) == 0


def test_the_rendered_sql_is_the_statements(backend: str) -> None:
    statement = sa.select(schema.tasks.c.id).where(schema.tasks.c.tenant == sa.bindparam("t"))
    name = "sqlite" if backend == "sqlite" else "postgresql"
    sql = db.driver_sql(statement, name)
    assert "FROM tasks" in sql
    assert (":t" if name == "sqlite" else "%(t)s") in sql
    assert db.driver_sql(statement, name) is sql  # rendered once


def test_the_stored_form_is_the_one_sqlalchemys_binding_stores(box: Outbox) -> None:
    # Byte for byte, so sorting and range scans mix rows from both paths.
    at = datetime(2026, 12, 3, 9, 30, 1, 120000, tzinfo=UTC)
    with db.write(box.engine) as conn:
        fast = db.insert_row(conn, schema.tasks, _task("acme", "op-5", at), "id")
        core = conn.execute(
            sa.insert(schema.tasks).values(_task("acme", "op-6", at)).returning(schema.tasks.c.id)
        ).scalar_one()
    with db.read(box.engine) as conn:
        raw = dict(
            conn.exec_driver_sql(
                f"SELECT id, CAST(created_at AS TEXT) FROM tasks WHERE id IN ({fast}, {core})"
            ).all()
        )
    assert raw[fast] == raw[core]
