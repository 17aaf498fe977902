"""The create path: one transaction writes the task, the receipt and the outbox rows.

The contract (DESIGN.md, "The caller's contract"):

- the key is ``(tenant, operation_id)``, supplied by the caller;
- same key, same arguments: the stored receipt, byte for byte, with the first
  reply's status code;
- same key, different arguments: ``IdempotencyKeyReused``, nothing written;
- a tombstone for the key: ``OperationExpired`` (reconcile, never a fresh key);
- the task, the operation record and every outbox row commit together or not at all.

Concurrency. SQLite: the transaction starts with ``BEGIN IMMEDIATE``, so two
creators of one key serialise and the second finds the first's record.
PostgreSQL: the primary key of ``operations`` is the identity; the insert is
``ON CONFLICT DO NOTHING``, which waits for a concurrent inserter of the same
key to finish. If ours inserted nothing we roll back everything we wrote
(the task included) and replay what the winner committed. On PostgreSQL the
record and the outbox rows are one statement (a data-modifying CTE whose
outbox insert selects from the record insert's RETURNING): a conflict inserts
neither.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from outbox import db, digest, errors, faults, schema, states, tools

OPERATION_ID = re.compile(r"^[\x21-\x7e]{1,255}$")
CREATED_STATUS = 201


@dataclass(frozen=True)
class ExecuteResult:
    """What ``execute`` did. ``receipt_json`` is the exact stored body."""

    tenant: str
    operation_id: str
    created: bool
    status_code: int
    receipt_json: str

    @property
    def replayed(self) -> bool:
        return not self.created

    @cached_property
    def receipt(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.receipt_json)
        return value


class _Found(NamedTuple):
    kind: str
    args_digest: str
    receipt: str | None
    status_code: int | None


class _LostRace(Exception):
    """PostgreSQL: a concurrent transaction committed this key first."""


def validate_operation_id(operation_id: Any) -> str:
    if not isinstance(operation_id, str) or not OPERATION_ID.match(operation_id):
        raise errors.InvalidOperationId(
            "the operation id (Idempotency-Key) must be 1-255 visible ASCII characters "
            "(no spaces or control characters)"
        )
    return operation_id


def new_effect_key() -> str:
    """Minted once per effect, in the creating transaction, and never again."""
    return f"obx_{uuid.uuid4().hex}"


def encode_receipt(receipt: Mapping[str, Any]) -> str:
    return json.dumps(receipt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def execute(
    engine: Engine,
    registry: tools.Registry,
    *,
    tenant: str,
    operation_id: str,
    tool: str,
    arguments: Any,
    now: datetime,
    retention: timedelta,
    effect_deadline: timedelta,
) -> ExecuteResult:
    validate_operation_id(operation_id)
    if now.tzinfo is None:
        raise ValueError(f"naive datetime {now!r}: pass a timezone-aware UTC datetime")
    spec = registry.get(tool)
    args = spec.validate(arguments)
    arg_values = args.model_dump(mode="json")
    args_digest = digest.args_digest(spec.name, spec.payload_version, arg_values)

    def body(conn: Connection) -> ExecuteResult:
        found = _find(conn, tenant, operation_id)
        if found is not None:
            return _answer_existing(tenant, operation_id, args_digest, found)
        return _create(
            conn,
            spec,
            args,
            tenant=tenant,
            operation_id=operation_id,
            args_digest=args_digest,
            now=now,
            retention=retention,
            effect_deadline=effect_deadline,
        )

    try:
        # No pre-ping: a dead pooled connection fails a statement instead, and
        # the transaction runs again on a new one. That is safe because nothing
        # committed, and the key makes a second run a replay if anything had.
        return db.transact(engine, body)
    except _LostRace:
        pass
    except exc.IntegrityError as error:
        raise _integrity_error(error, tenant) from error
    # The winner has committed; what did it write?
    with db.read(engine) as conn:
        found = _find(conn, tenant, operation_id)
    if found is None:  # pragma: no cover - the winner committed, so its row exists
        raise errors.Busy()
    return _answer_existing(tenant, operation_id, args_digest, found)


def _find_statement() -> sa.CompoundSelect[Any]:
    ops, tombs = schema.operations, schema.tombstones
    tenant: sa.BindParameter[str] = sa.bindparam("tenant", type_=sa.String())
    operation_id: sa.BindParameter[str] = sa.bindparam("operation_id", type_=sa.String())
    return sa.union_all(
        sa.select(
            sa.literal_column("'op'").label("kind"),
            ops.c.args_digest,
            ops.c.receipt,
            ops.c.status_code,
        ).where(ops.c.tenant == tenant, ops.c.operation_id == operation_id),
        sa.select(
            sa.literal_column("'tomb'").label("kind"),
            tombs.c.args_digest,
            sa.null().label("receipt"),
            sa.null().label("status_code"),
        ).where(tombs.c.tenant == tenant, tombs.c.operation_id == operation_id),
    )


# Built once, and run as the driver's SQL (``db.driver_sql``): on the hot path,
# building a statement and binding its parameters cost more than running it
# (profiled: SQLAlchemy's statement handling was over half a create's CPU time
# on SQLite, where the database itself is fast).
_FIND = _find_statement()


@functools.cache
def _insert_operation(backend: str, columns: tuple[str, ...]) -> str:
    """The operation record alone; ``ON CONFLICT DO NOTHING RETURNING`` tells a lost race."""
    ops = schema.operations
    insert = postgresql.insert if backend == "postgresql" else sqlite.insert
    statement = (
        insert(ops)
        .values({name: sa.bindparam(name, type_=ops.c[name].type) for name in columns})
        .on_conflict_do_nothing()
        .returning(ops.c.tenant)
    )
    return db.driver_sql(statement, backend)


@functools.cache
def _pg_insert_operation_and_effects(
    operation_columns: tuple[str, ...], effect_columns: tuple[str, ...], count: int
) -> str:
    """PostgreSQL: the operation record and ``count`` outbox rows in one statement.

    A data-modifying CTE: the record's insert keeps its ``ON CONFLICT DO
    NOTHING`` (the identity; it waits for a concurrent inserter of the key),
    and the outbox rows are selected from what it returned, so a conflict
    inserts no outbox row either and the statement returns no id. One round
    trip less than the two inserts; the same rows, in the same transaction.
    """
    ops, out = schema.operations, schema.outbox
    record = (
        postgresql.insert(ops)
        .values({name: sa.bindparam(name, type_=ops.c[name].type) for name in operation_columns})
        .on_conflict_do_nothing()
        .returning(ops.c.tenant, ops.c.operation_id)
        .cte("record")
    )
    rows = [
        sa.select(
            record.c.tenant,
            record.c.operation_id,
            *(sa.bindparam(f"e{i}_{name}", type_=out.c[name].type) for name in effect_columns),
        )
        for i in range(count)
    ]
    select = rows[0] if count == 1 else sa.union_all(*rows)
    statement = (
        sa.insert(out)
        .from_select(["tenant", "operation_id", *effect_columns], select)
        .returning(out.c.id)
    )
    return db.driver_sql(statement, "postgresql")


def _find(conn: Connection, tenant: str, operation_id: str) -> _Found | None:
    """One round trip for both the live record and its tombstone."""
    sql = db.driver_sql(_FIND, conn.dialect.name)
    row = db.driver_execute(conn, sql, {"tenant": tenant, "operation_id": operation_id}).fetchone()
    return None if row is None else _Found(*row)


def _answer_existing(
    tenant: str, operation_id: str, args_digest: str, found: _Found
) -> ExecuteResult:
    if found.kind == "tomb":
        raise errors.OperationExpired(
            tenant, operation_id, same_arguments=found.args_digest == args_digest
        )
    if found.args_digest != args_digest:
        raise errors.IdempotencyKeyReused(tenant, operation_id)
    assert found.status_code is not None and found.receipt is not None  # a record has both
    return ExecuteResult(tenant, operation_id, False, found.status_code, found.receipt)


def _create(
    conn: Connection,
    spec: tools.Tool,
    args: Any,
    *,
    tenant: str,
    operation_id: str,
    args_digest: str,
    now: datetime,
    retention: timedelta,
    effect_deadline: timedelta,
) -> ExecuteResult:
    output = spec.handler(tools.ToolContext(conn, tenant, operation_id, now), args)
    faults.point("create.after_task_insert")
    receipt_json = encode_receipt(output.receipt)
    values = {
        "tenant": tenant,
        "operation_id": operation_id,
        "tool": spec.name,
        "payload_version": spec.payload_version,
        "args_digest": args_digest,
        "receipt": receipt_json,
        "status_code": CREATED_STATUS,
        "task_id": output.task_id,
        "created_at": now,
        "expires_at": now + retention,
    }
    effects = [
        {
            "effect": effect.effect,
            "adapter": effect.adapter,
            "payload": digest.canonical_json(dict(effect.payload)).decode("utf-8"),
            "effect_key": new_effect_key(),
            "status": states.EffectStatus.PENDING,
            "reason": states.Reason.CREATED,
            "attempts": 0,
            "maybe_sent": False,
            "next_attempt_at": now,
            "deadline_at": now + (effect.deadline or effect_deadline),
            "fence": 0,
            "needs_review": False,
            "lookup_attempts": 0,
            "created_at": now,
            "updated_at": now,
        }
        for effect in output.effects
    ]
    backend = conn.dialect.name
    values = db.driver_values(backend, values)
    effects = [db.driver_values(backend, e) for e in effects]
    if effects and backend == "postgresql":
        # One statement: both crash windows fall after it.
        params = dict(values)
        for i, effect_values in enumerate(effects):
            params.update({f"e{i}_{name}": value for name, value in effect_values.items()})
        sql = _pg_insert_operation_and_effects(tuple(values), tuple(effects[0]), len(effects))
        if not db.driver_execute(conn, sql, params).fetchall():  # the key was taken
            raise _LostRace()
        faults.point("create.after_operation_insert")
    else:
        sql = _insert_operation(backend, tuple(values))
        if db.driver_execute(conn, sql, values).fetchone() is None:
            raise _LostRace()
        faults.point("create.after_operation_insert")
        if effects:
            rows = [{"tenant": tenant, "operation_id": operation_id, **e} for e in effects]
            sql = db.insert_sql(schema.outbox, tuple(rows[0]), None, backend)
            db.driver_execute(conn, sql, rows if len(rows) > 1 else rows[0], many=len(rows) > 1)
    faults.point("create.after_outbox_insert")
    return ExecuteResult(tenant, operation_id, True, CREATED_STATUS, receipt_json)


def _integrity_error(error: exc.IntegrityError, tenant: str) -> errors.OutboxError:
    name = db.constraint_name(error) or ""
    text = str(error.orig).lower()
    if (name.startswith("fk_") and "tenant" in name) or "foreign key" in text:
        return errors.UnknownTenant(tenant)
    return errors.OutboxError(f"the database refused the write ({name or text})")
