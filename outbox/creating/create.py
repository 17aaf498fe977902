# Longer than 500 lines on purpose: the create path's two shapes (one statement on
# PostgreSQL, an ordinary transaction elsewhere) must stay side by side to stay equivalent.
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
key to finish. If ours inserted nothing, nothing of ours is kept and we replay
what the winner committed.

PostgreSQL, one statement. A create is one round trip: one statement that
commits alone (autocommit) and writes everything: a data-modifying CTE inserts
the record (unless the key has a tombstone, and ``ON CONFLICT DO NOTHING``),
and the handler's rows and the outbox rows are selected from what that insert
returned, so a replay, a lost race or a tombstone writes nothing at all. The
key's lookup rides in the same statement: a replay is one round trip too, and
runs the handler for nothing (the handler contract allows it). One statement is
one transaction: the rows commit together or not at all, as in the transaction
it replaces, without BEGIN and COMMIT and the round trips between them. The
handler's rows are collected, not sent, while it runs (``ctx.insert``); a row's
auto-incremented id is drawn beforehand from the table's sequence, in blocks
(``_Ids``).

SQLite: one ``BEGIN IMMEDIATE`` transaction of plain statements on the pooled
driver connection (``db.direct_write``); the handler's rows are written as it
calls ``ctx.insert``.

Both fast paths send their statements straight to the driver. A handler that
takes ``ctx.conn`` (a SQLAlchemy ``Connection``) is run again in an ordinary
SQLAlchemy transaction: the general path, with the same rows and guarantees,
at the cost of its round trips.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from outbox import db, errors, faults, schema, states, tools
from outbox.creating import digest

OPERATION_ID = re.compile(r"^[\x21-\x7e]{1,255}$")
CREATED_STATUS = 201
ACCEPTED_STATUS = 202  # created, and waiting for an operator's approval


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


class _NeedsTransaction(BaseException):
    """The handler took ``ctx.conn`` on the one-statement path: run it in a transaction.

    A ``BaseException``, so that a handler's ``except Exception`` cannot swallow it.
    ``by_the_tool``: the handler asked for the connection (not this call's size),
    so the tool's later calls start in the transaction (``Registry.needs_transaction``)
    rather than run the handler for nothing on every call and every replay.
    """

    def __init__(self, *, by_the_tool: bool = False) -> None:
        super().__init__()
        self.by_the_tool = by_the_tool


class _Request(NamedTuple):
    spec: tools.Tool
    args: Any
    tenant: str
    operation_id: str
    args_digest: str
    now: datetime
    retention: timedelta
    effect_deadline: timedelta


def validate_operation_id(operation_id: Any) -> str:
    if not isinstance(operation_id, str) or not OPERATION_ID.match(operation_id):
        raise errors.InvalidOperationId(
            "the operation id (Idempotency-Key) must be 1-255 visible ASCII characters "
            "(no spaces or control characters)"
        )
    return operation_id


def new_effect_key() -> str:
    """Minted once per effect, in the creating transaction, and never again.

    ``obx_`` and a random (version 4) UUID's 32 hex digits: ``uuid.uuid4().hex``,
    without the ``UUID`` object's checks and conversions (a tenth of a create's
    own Python).
    """
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    return "obx_" + raw.hex()


def encode_receipt(receipt: Mapping[str, Any]) -> str:
    return _RECEIPT_JSON.encode(receipt)


# One encoder for every receipt (``json.dumps`` with options builds one a call).
_RECEIPT_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


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

    request = _Request(
        spec, args, tenant, operation_id, args_digest, now, retention, effect_deadline
    )

    def body(conn: db.Driver) -> ExecuteResult:
        found = _find(conn, tenant, operation_id)
        if found is not None:
            return _answer_existing(tenant, operation_id, args_digest, found)
        return _create(conn, request, conn if isinstance(conn, Connection) else None)

    try:
        try:
            if spec.name in registry.needs_transaction:
                raise _NeedsTransaction()
            if engine.dialect.name == "postgresql":
                # No pre-ping, and once more on a new connection if this one was
                # dead: safe, because the second run's statement finds the key
                # taken and answers the first run's record if its statement did commit.
                return db.autocommit(engine, lambda conn: _one_statement(engine, conn, request))
            return db.direct_write(engine, body)
        except _NeedsTransaction as needs:
            if needs.by_the_tool:
                registry.needs_transaction.add(spec.name)
            # The handler takes ``ctx.conn``: a SQLAlchemy transaction. No pre-ping:
            # a dead pooled connection fails a statement instead, and the
            # transaction runs again on a new one. That is safe because nothing
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


# At most this many rows (the handler's and the outbox rows) go in one
# statement: its text and parameters grow with each, and PostgreSQL takes at
# most 65,535 parameters. A create with more takes the general path.
_FOLD_LIMIT = 32


@functools.lru_cache(maxsize=256)
def _pg_create(
    operation_columns: tuple[str, ...],
    rows: tuple[tuple[sa.Table, tuple[str, ...]], ...],
    effect_columns: tuple[str, ...],
    count: int,
) -> str:
    """PostgreSQL: the record, the handler's ``rows`` and ``count`` outbox rows, one statement.

    A data-modifying CTE. The record's insert is guarded by the key's
    tombstone and keeps its ``ON CONFLICT DO NOTHING`` (the identity; it waits
    for a concurrent inserter of the key); every other row is selected from
    what it returned, so a conflict or a tombstone inserts nothing at all and
    the statement returns no row. Parameters: the record's columns by name,
    row ``i``'s as ``r{i}_<column>``, effect ``i``'s as ``e{i}_<column>``.
    """
    ops, out, tombs = schema.operations, schema.outbox, schema.tombstones

    def bind(prefix: str, table: sa.Table, name: str) -> sa.BindParameter[Any]:
        return sa.bindparam(f"{prefix}{name}", type_=table.c[name].type)

    tombstone = sa.exists().where(
        tombs.c.tenant == bind("", ops, "tenant"),
        tombs.c.operation_id == bind("", ops, "operation_id"),
    )
    record = (
        postgresql.insert(ops)
        .from_select(
            list(operation_columns),
            sa.select(*(bind("", ops, name) for name in operation_columns)).where(~tombstone),
        )
        .on_conflict_do_nothing()
        .returning(ops.c.tenant, ops.c.operation_id)
        .cte("record")
    )
    writes = [
        sa.insert(table)
        .from_select(
            list(columns),
            sa.select(*(bind(f"r{i}_", table, name) for name in columns)).select_from(record),
        )
        .cte(f"row{i}")
        for i, (table, columns) in enumerate(rows)
    ]
    if count:
        effects = [
            sa.select(
                record.c.tenant,
                record.c.operation_id,
                *(bind(f"e{i}_", out, name) for name in effect_columns),
            )
            for i in range(count)
        ]
        select = effects[0] if count == 1 else sa.union_all(*effects)
        writes.append(
            sa.insert(out)
            .from_select(["tenant", "operation_id", *effect_columns], select)
            .cte("effects")
        )
    # The key's lookup rides along: what holds the key in the statement's snapshot
    # (a record or a tombstone) comes back with the row that says we wrote.
    statement: sa.CompoundSelect[Any] = sa.union_all(*_FIND.selects, _wrote(record))
    statement = statement.add_cte(*writes)
    return db.driver_sql(statement, "postgresql")


def _wrote(record: sa.CTE) -> sa.Select[str, None, None, None]:
    """One row when the record was inserted, in the shape of ``_FIND``'s rows."""
    return sa.select(
        sa.literal_column("'new'", sa.String()).label("kind"),
        sa.null().label("args_digest"),
        sa.null().label("receipt"),
        sa.null().label("status_code"),
    ).select_from(record)


def _wrote_or_found(conn: db.Driver, sql: str, params: dict[str, Any]) -> bool | _Found | None:
    """Send ``_pg_create``'s statement: True if it wrote, else what held the key.

    None: it wrote nothing and its snapshot held neither a record nor a
    tombstone. A create of the key committed while the statement ran (its
    ``ON CONFLICT`` waited for it), or expired just then: look again.
    """
    rows = db.driver_execute(conn, sql, params).fetchall()
    if any(row[0] == "new" for row in rows):
        return True
    return _Found(*rows[0]) if rows else None


def _pg_statement(
    record: dict[str, Any],
    rows: list[tuple[sa.Table, dict[str, Any]]],
    effects: list[dict[str, Any]],
) -> tuple[str, dict[str, Any]]:
    """``_pg_create``'s SQL for these values, and its parameters named as it names them."""
    params = dict(record)
    shapes = []
    for i, (table, row) in enumerate(rows):
        columns = tuple(row)
        shapes.append((table, columns))
        params.update(zip(_names("r", i, columns), row.values(), strict=True))
    effect_columns: tuple[str, ...] = ()
    for i, effect in enumerate(effects):
        effect_columns = tuple(effect)
        params.update(zip(_names("e", i, effect_columns), effect.values(), strict=True))
    sql = _pg_create(tuple(record), tuple(shapes), effect_columns, len(effects))
    return sql, params


@functools.lru_cache(maxsize=1024)
def _names(kind: str, index: int, columns: tuple[str, ...]) -> tuple[str, ...]:
    """``_pg_create``'s parameter names for row (``r``) or effect (``e``) ``index``'s
    columns (built once a shape)."""
    return tuple(f"{kind}{index}_{name}" for name in columns)


_NEXT_IDS = (
    "SELECT nextval(pg_get_serial_sequence(%(table)s, %(column)s)) FROM generate_series(1, {})"
)


class _Ids:
    """Auto-incremented ids drawn from a table's sequence before its row is written.

    A block at a time (one round trip per ``BLOCK`` rows), so the row can
    travel in the create's one statement with its id already known. A sequence
    hands out each value once, whatever becomes of the transaction that drew
    it, so an id drawn and never used is a gap, as a rolled-back insert's is;
    ids are unique, not dense, and not in commit order across processes (they
    never were). The blocks belong to an engine (a new engine may be a new
    database) and a forked child drops them: it must not use its parent's.
    """

    BLOCK = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: weakref.WeakKeyDictionary[Engine, dict[str, deque[int]]] = (
            weakref.WeakKeyDictionary()
        )

    def take(self, engine: Engine, conn: db.Driver, table: sa.Table, column: str) -> int:
        with self._lock:
            blocks = self._free.get(engine)
            if blocks is None:
                blocks = self._free[engine] = {}
            free = blocks.get(table.fullname)
            if free is None:
                free = blocks[table.fullname] = deque()
            if not free:
                sql = _NEXT_IDS.format(self.BLOCK)
                params = {"table": table.fullname, "column": column}
                free.extend(row[0] for row in db.driver_execute(conn, sql, params).fetchall())
            return free.popleft()

    def clear(self) -> None:
        with self._lock:
            self._free = weakref.WeakKeyDictionary()


_IDS = _Ids()
os.register_at_fork(after_in_child=_IDS.clear)


@functools.cache
def _serial_column(table: sa.Table) -> str | None:
    """The table's auto-incremented integer primary key, if it has one."""
    key = list(table.primary_key.columns)
    serial = len(key) == 1 and key[0].autoincrement in (True, "auto")
    return key[0].name if serial and isinstance(key[0].type, sa.Integer) else None


class _Immediate:
    """Rows go to the transaction at once; ``ctx.conn`` is there only on the general path."""

    def __init__(self, driver: db.Driver, conn: Connection | None) -> None:
        self._driver, self._conn = driver, conn

    def connection(self) -> Connection:
        if self._conn is None:
            raise _NeedsTransaction(by_the_tool=True)
        return self._conn

    def insert(self, table: sa.Table, values: Mapping[str, Any], returning: str | None) -> Any:
        return db.insert_row(self._driver, table, values, returning)


class _Collected:
    """The one-statement path's writer: rows are kept, to be sent with the record."""

    def __init__(self, engine: Engine, conn: db.Driver) -> None:
        self._engine, self._conn = engine, conn
        self.rows: list[tuple[sa.Table, dict[str, Any]]] = []

    def connection(self) -> Connection:
        raise _NeedsTransaction(by_the_tool=True)

    def insert(self, table: sa.Table, values: Mapping[str, Any], returning: str | None) -> Any:
        if len(self.rows) >= _FOLD_LIMIT:
            raise _NeedsTransaction()
        row = dict(values)
        if returning is not None and returning not in row:
            if returning != _serial_column(table):
                # Only the database knows it before the insert, on every call.
                raise _NeedsTransaction(by_the_tool=True)
            row[returning] = _IDS.take(self._engine, self._conn, table, returning)
        self.rows.append((table, db.driver_values("postgresql", row)))
        return None if returning is None else row[returning]


def _find(conn: db.Driver, tenant: str, operation_id: str) -> _Found | None:
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


class _ReplayShare:
    """How many of this process's recent creates were replays (a moving average).

    It only picks which of two correct paths runs first. Writing optimistically
    costs a replay the handler's run and a statement that writes nothing; looking
    the key up first costs a first call a round trip. In ordinary traffic
    replays are rare and the optimistic path wins; in a retry storm (a provider
    or a network fault makes every caller retry) most calls are replays, and the
    lookup alone answers them. Threads may race on ``share``: a lost update
    nudges a heuristic, nothing more.
    """

    WEIGHT = 0.1  # about the last ten calls
    LOOK_FIRST_ABOVE = 0.5  # a lookup (~a third of a create) pays off above ~40% replays

    def __init__(self) -> None:
        self.share = 0.0

    def note(self, replayed: bool) -> None:
        self.share += self.WEIGHT * (float(replayed) - self.share)

    def look_first(self) -> bool:
        return self.share > self.LOOK_FIRST_ABOVE


_REPLAYS = _ReplayShare()


def _one_statement(engine: Engine, conn: db.Driver, request: _Request) -> ExecuteResult:
    """PostgreSQL, autocommit: one statement writes everything, or finds the key's holder.

    Optimistic: the handler runs first, and its rows go in the statement with the
    key's lookup, so a first call is one round trip, and so is a replay (whose
    handler run is discarded: the handler contract allows a second run, and its
    rows are never sent). A handler that fails, or asks for ``ctx.conn``, may be
    answering a replay: the key is looked up before anything else is decided.
    While most recent calls were replays (``_ReplayShare``), the key is looked up
    first, and only a first call runs the handler.
    """
    tenant, operation_id = request.tenant, request.operation_id
    if _REPLAYS.look_first():
        found = _find(conn, tenant, operation_id)
        if found is not None:
            _REPLAYS.note(True)
            return _answer_existing(tenant, operation_id, request.args_digest, found)
    result = _write_optimistically(engine, conn, request)
    _REPLAYS.note(not result.created)
    return result


def _write_optimistically(engine: Engine, conn: db.Driver, request: _Request) -> ExecuteResult:
    tenant, operation_id = request.tenant, request.operation_id
    writer = _Collected(engine, conn)
    try:
        output = _run_handler(writer, request)
        if len(writer.rows) + len(output.effects) > _FOLD_LIMIT:
            raise _NeedsTransaction()
        receipt_json, record, effects = _record_and_effects(request, output, "postgresql")
    except (Exception, _NeedsTransaction) as error:
        if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
            # The handler's own statement (its ids' block) found the server gone: no
            # lookup on a dead connection; the caller runs it all again on a new one.
            raise
        # A replay is answered from its record whatever the handler does today
        # (its code, or the data it reads, may have changed since the first call).
        found = _find(conn, tenant, operation_id)
        if found is None:
            raise
        return _answer_existing(tenant, operation_id, request.args_digest, found)
    # The writes are one statement that commits alone: the crash windows of
    # the general path's transaction all fall here, before it is sent.
    faults.point("create.after_operation_insert")
    faults.point("create.after_outbox_insert")
    outcome = _wrote_or_found(conn, *_pg_statement(record, writer.rows, effects))
    if outcome is True:
        return ExecuteResult(tenant, operation_id, True, record["status_code"], receipt_json)
    # The key was taken: by a create before ours (a replay), or by one that
    # committed while our statement ran (its record was not in our snapshot).
    found = outcome or _find(conn, tenant, operation_id)
    if found is None:  # pragma: no cover - the statement found the record or tombstone
        raise errors.Busy()
    return _answer_existing(tenant, operation_id, request.args_digest, found)


def _create(conn: db.Driver, request: _Request, sa_conn: Connection | None) -> ExecuteResult:
    """Inside the transaction: the handler writes at once, and may take ``sa_conn``."""
    output = _run_handler(_Immediate(conn, sa_conn), request)
    backend = conn.dialect.name
    receipt_json, record, effects = _record_and_effects(request, output, backend)
    tenant, operation_id = request.tenant, request.operation_id
    if backend == "postgresql" and len(effects) <= _FOLD_LIMIT:
        # One statement for the record and the outbox rows: both crash windows fall after it.
        if _wrote_or_found(conn, *_pg_statement(record, [], effects)) is not True:
            raise _LostRace()  # the key was taken after this transaction looked
        faults.point("create.after_operation_insert")
    else:
        sql = _insert_operation(backend, tuple(record))
        if db.driver_execute(conn, sql, record).fetchone() is None:
            raise _LostRace()
        faults.point("create.after_operation_insert")
        if effects:
            rows = [{"tenant": tenant, "operation_id": operation_id, **e} for e in effects]
            sql = db.insert_sql(schema.outbox, tuple(rows[0]), None, backend)
            db.driver_execute(conn, sql, rows if len(rows) > 1 else rows[0], many=len(rows) > 1)
    faults.point("create.after_outbox_insert")
    return ExecuteResult(tenant, operation_id, True, record["status_code"], receipt_json)


def _run_handler(writer: tools.RowWriter, request: _Request) -> tools.ToolOutput:
    ctx = tools.ToolContext(writer, request.tenant, request.operation_id, request.now)
    output = request.spec.handler(ctx, request.args)
    faults.point("create.after_task_insert")
    return output


def _record_and_effects(
    request: _Request, output: tools.ToolOutput, backend: str
) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """The receipt, and the record's and the outbox rows' values as the driver takes them.

    Built as plain values at once (``db.driver_values``' job, done here for the
    three instants every row shares: a create converts each once). An outbox
    row's counters and flags (``attempts``, ``maybe_sent``, ``fence``,
    ``needs_review``, ``lookup_attempts``) start at their columns' defaults
    (0 and false), written by the database: five parameters fewer an effect.
    """
    now = request.now
    when = schema.sqlite_time if backend == "sqlite" else _same
    created, expires = when(now), when(now + request.retention)
    receipt = output.receipt
    status_code = CREATED_STATUS
    held = request.spec.needs_approval(request.args)
    if held:
        # The receipt says what happened to the request: it waits for an operator.
        receipt = {**receipt, "status": states.ApprovalStatus.AWAITING_APPROVAL.value}
        status_code = ACCEPTED_STATUS
    receipt_json = encode_receipt(receipt)
    record = {
        "tenant": request.tenant,
        "operation_id": request.operation_id,
        "tool": request.spec.name,
        "payload_version": request.spec.payload_version,
        "args_digest": request.args_digest,
        "receipt": receipt_json,
        "status_code": status_code,
        "task_id": output.task_id,
        "created_at": created,
        "expires_at": expires,
    }
    if held:
        record["approval"] = states.ApprovalStatus.AWAITING_APPROVAL.value
    default_deadline = when(now + request.effect_deadline)
    effects = [
        {
            "effect": effect.effect,
            "adapter": effect.adapter,
            "payload": digest.canonical_text(dict(effect.payload)),
            "effect_key": new_effect_key(),
            "status": _HELD if held else _PENDING,
            "reason": _AWAITING_APPROVAL if held else _CREATED,
            "next_attempt_at": created,
            "deadline_at": when(now + effect.deadline) if effect.deadline else default_deadline,
            "ordering_key": _ordering_key(effect.ordering_key),
            "created_at": created,
            "updated_at": created,
        }
        for effect in output.effects
    ]
    return receipt_json, record, effects


ORDERING_KEY_MAX = 200


def _ordering_key(value: str | None) -> str | None:
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= ORDERING_KEY_MAX):
        raise ValueError(f"ordering_key: 1-{ORDERING_KEY_MAX} characters, or None")
    return value


_PENDING = states.EffectStatus.PENDING.value
_CREATED = states.Reason.CREATED.value
_HELD = states.EffectStatus.HELD.value
_AWAITING_APPROVAL = states.Reason.AWAITING_APPROVAL.value


def _same(value: datetime) -> datetime:
    return value


def _integrity_error(error: exc.IntegrityError, tenant: str) -> errors.OutboxError:
    name = db.constraint_name(error) or ""
    text = str(error.orig).lower()
    if (name.startswith("fk_") and "tenant" in name) or "foreign key" in text:
        return errors.UnknownTenant(tenant)
    return errors.OutboxError(f"the database refused the write ({name or text})")
