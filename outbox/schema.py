"""The tables. SQLAlchemy Core, one ``MetaData`` with a naming convention.

Constraint names are part of the contract: code maps an ``IntegrityError`` to a
domain error by the constraint's name, and the tests prove that the database,
not only Python, refuses each illegal row.

The migrations in ``outbox/migrations`` create exactly these tables; a test
compares the migrated database with this module and fails on any drift.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles

from outbox import states

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC in Python; ``timestamptz`` on PostgreSQL, sortable text on SQLite.

    A naive datetime is refused: it is always a bug (ruff DTZ catches most).
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(sa.DateTime(timezone=False))
        return dialect.type_descriptor(sa.DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def sqlite_time(value: datetime | None) -> str | None:
    """A UTC datetime as ``UTCDateTime`` stores it on SQLite (sortable text).

    For statements sent straight to the driver, which skip the type's binding.
    """
    if value is None:
        return None
    if value.tzinfo is not UTC:
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC datetime")
        value = value.astimezone(UTC)
    # The text SQLAlchemy's SQLite DateTime writes (``YYYY-MM-DD HH:MM:SS.ffffff``, 26
    # characters), at a fifth of strftime's cost: the ISO text without its "+00:00".
    return value.isoformat(" ", "microseconds")[:26]


def _enum(enum: type[StrEnum], name: str, length: int = 32) -> sa.Enum:
    """A string column of ``enum``'s values. Its CHECK (named ``name``) is a ``OneOf``,
    added to every table at the end of this module, not the type's own."""
    return sa.Enum(
        enum,
        name=name,
        native_enum=False,
        create_constraint=False,
        length=length,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )


class OneOf(sa.ColumnElement[bool]):
    """The CHECK of an enum column: ``column`` holds one of ``values``.

    On PostgreSQL, ``column::text = ANY ('{a,b}'::text[])``: the list is one
    constant, stored as such. The type's own ``column IN ('a', 'b')`` is stored as
    an ``ARRAY['a'::varchar, ...]`` cast to ``text[]``, and PostgreSQL rebuilds
    that array in every statement that writes the table: the outbox row's three
    cost a create about 20 µs of server time (docs/performance.md, migration 0010).
    SQLite reads its CHECKs once per prepared statement: ``IN`` there.
    """

    inherit_cache = True

    def __init__(self, column: str, values: list[str]) -> None:
        for value in (column, *values):
            if not re.fullmatch(r"[a-z][a-z0-9_]*", value):
                raise ValueError(f"{value!r}: an enum's column and values are [a-z0-9_] names")
        self.column = column
        self.values = tuple(values)


@compiles(OneOf)
def _one_of(element: OneOf, compiler: Any, **kw: Any) -> str:
    return f"{element.column} IN ({', '.join(repr(v) for v in element.values)})"


@compiles(OneOf, "postgresql")
def _one_of_postgresql(element: OneOf, compiler: Any, **kw: Any) -> str:
    return f"{element.column}::text = ANY ('{{{','.join(element.values)}}}'::text[])"


# SQLite needs INTEGER PRIMARY KEY (the rowid alias) to autoincrement.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    # The tenant's API rate limit ("10/second"); NULL: OUTBOX_RATE_LIMIT.
    sa.Column("rate_limit", sa.String(64), nullable=True),
)

api_tokens = sa.Table(
    "api_tokens",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    # SHA-256 hex of the token; the token itself is never stored.
    sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
    sa.Column("tenant", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("role", _enum(states.Role, "role"), nullable=False),
    sa.Column("label", sa.String(200), nullable=False, server_default=""),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("revoked_at", UTCDateTime(), nullable=True),
    # Written at most once a minute per token (service.TOKEN_LAST_USED_RESOLUTION).
    sa.Column("last_used_at", UTCDateTime(), nullable=True),
    # After it the token authenticates nothing; NULL: no expiry.
    sa.Column("expires_at", UTCDateTime(), nullable=True),
)

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("tenant", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("subject", sa.String(200), nullable=False),
    sa.Column("body", sa.Text(), nullable=False),
    sa.Column("priority", _enum(states.TaskPriority, "priority"), nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("operation_id", sa.String(255), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Index("ix_tasks_tenant_id", "tenant", "id"),
)

operations = sa.Table(
    "operations",
    metadata,
    # The identity: one (tenant, operation_id) is one logical operation.
    sa.Column("tenant", sa.String(64), sa.ForeignKey("tenants.id"), primary_key=True),
    sa.Column("operation_id", sa.String(255), primary_key=True),
    sa.Column("tool", sa.String(100), nullable=False),
    sa.Column("payload_version", sa.Integer(), nullable=False),
    sa.Column("args_digest", sa.String(64), nullable=False),
    # The exact bytes of the first reply's body, and its status code.
    sa.Column("receipt", sa.Text(), nullable=False),
    sa.Column("status_code", sa.Integer(), nullable=False),
    sa.Column("task_id", sa.BigInteger(), nullable=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("expires_at", UTCDateTime(), nullable=False),
    # NULL unless the tool requires approval; then awaiting_approval, until an
    # operator's compare-and-set moves it to approved or rejected (final).
    sa.Column("approval", _enum(states.ApprovalStatus, "approval"), nullable=True),
    sa.Index("ix_operations_expires_at", "expires_at"),
    sa.Index(
        "ix_operations_awaiting_approval",
        "tenant",
        "created_at",
        sqlite_where=sa.text("approval = 'awaiting_approval'"),
        postgresql_where=sa.text("approval = 'awaiting_approval'"),
    ),
)

S = states.EffectStatus
_TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in sorted(states.TERMINAL))
ORDERING_OPEN_SQL = f"ordering_key IS NOT NULL AND status NOT IN ({_TERMINAL_SQL})"
"""The rows of ``ix_outbox_ordering_open``: grouped effects that still hold their group."""

# PostgreSQL storage parameters of the two tables every delivery rewrites
# (docs/performance.md, "The table itself"; migration 0006).
OUTBOX_FILLFACTOR = 75
ATTEMPTS_FILLFACTOR = 50

outbox = sa.Table(
    "outbox",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("operation_id", sa.String(255), nullable=False),
    sa.Column("effect", sa.String(100), nullable=False),
    sa.Column("adapter", sa.String(100), nullable=False),
    sa.Column("payload", sa.Text(), nullable=False),
    # The downstream idempotency key: minted once, in the creating transaction.
    # A trigger refuses any UPDATE that changes it.
    sa.Column("effect_key", sa.String(100), nullable=False, unique=True),
    sa.Column("status", _enum(states.EffectStatus, "status"), nullable=False),
    sa.Column("reason", _enum(states.Reason, "reason", 40), nullable=False),
    sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
    # True once any attempt may have reached the provider (open or ambiguous).
    sa.Column("maybe_sent", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("next_attempt_at", UTCDateTime(), nullable=False),
    sa.Column("deadline_at", UTCDateTime(), nullable=False),
    sa.Column("lease_owner", sa.String(200), nullable=True),
    sa.Column("lease_expires_at", UTCDateTime(), nullable=True),
    # Raised by every claim; a result is recorded only under the fence it was claimed with.
    sa.Column("fence", sa.BigInteger(), nullable=False, server_default="0"),
    sa.Column("needs_review", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("review_since", UTCDateTime(), nullable=True),
    sa.Column("lookup_attempts", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("next_lookup_at", UTCDateTime(), nullable=True),
    sa.Column("provider_ref", sa.String(500), nullable=True),
    sa.Column("last_error", sa.Text(), nullable=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("finished_at", UTCDateTime(), nullable=True),
    # Effects sharing (tenant, adapter, ordering_key) are delivered in creation (id)
    # order: the claim skips one while an earlier effect of its group is not terminal.
    sa.Column("ordering_key", sa.String(200), nullable=True),
    # Which source of evidence settled the effect (lookup, webhook, operator);
    # NULL when the dispatcher's own result did, or while it is not settled.
    sa.Column("settled_by", _enum(states.SettleSource, "settled_by"), nullable=True),
    sa.ForeignKeyConstraint(
        ["tenant", "operation_id"],
        ["operations.tenant", "operations.operation_id"],
        name="fk_outbox_operation",
        ondelete="CASCADE",
    ),
    sa.CheckConstraint(
        f"status NOT IN ({_TERMINAL_SQL}) OR finished_at IS NOT NULL",
        name="terminal_has_finished_at",
    ),
    sa.CheckConstraint(
        "status <> 'succeeded' OR provider_ref IS NOT NULL", name="succeeded_has_provider_ref"
    ),
    sa.CheckConstraint(
        "status <> 'in_flight' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="in_flight_has_lease",
    ),
    sa.CheckConstraint(
        "needs_review = false OR status = 'outcome_unknown'", name="review_only_when_unknown"
    ),
    sa.CheckConstraint("attempts >= 0 AND lookup_attempts >= 0", name="counts_not_negative"),
    # A held effect was never offered to a dispatcher: nothing can have been sent.
    sa.CheckConstraint(
        "status <> 'held' OR (attempts = 0 AND maybe_sent = false AND lease_owner IS NULL)",
        name="held_never_sent",
    ),
    sa.Index("ix_outbox_tenant_operation_id", "tenant", "operation_id"),
    # Partial indexes: the hot queries touch only live rows, so a million
    # finished rows do not slow the claim.
    sa.Index(
        "ix_outbox_due",
        "next_attempt_at",
        "id",
        sqlite_where=sa.text("status = 'pending'"),
        postgresql_where=sa.text("status = 'pending'"),
    ),
    sa.Index(
        "ix_outbox_leased",
        "lease_expires_at",
        sqlite_where=sa.text("status = 'in_flight'"),
        postgresql_where=sa.text("status = 'in_flight'"),
    ),
    sa.Index(
        "ix_outbox_unknown",
        "next_lookup_at",
        sqlite_where=sa.text("status = 'outcome_unknown'"),
        postgresql_where=sa.text("status = 'outcome_unknown'"),
    ),
    # The claim's "earlier effect of my group still open?" probe: only live, grouped rows.
    sa.Index(
        "ix_outbox_ordering_open",
        "tenant",
        "adapter",
        "ordering_key",
        "id",
        sqlite_where=sa.text(ORDERING_OPEN_SQL),
        postgresql_where=sa.text(ORDERING_OPEN_SQL),
    ),
    # Room in each page for a row's next versions: a claim and a result each write
    # one, and a version that stays on its page costs less WAL and bloats less.
    postgresql_with={"fillfactor": OUTBOX_FILLFACTOR},
)

attempts = sa.Table(
    "attempts",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column(
        "effect_id", sa.BigInteger(), sa.ForeignKey("outbox.id", ondelete="CASCADE"), nullable=False
    ),
    sa.Column("attempt_no", sa.Integer(), nullable=False),
    sa.Column("worker", sa.String(200), nullable=False),
    sa.Column("fence", sa.BigInteger(), nullable=False),
    sa.Column("effect_key", sa.String(100), nullable=False),
    sa.Column("started_at", UTCDateTime(), nullable=False),
    sa.Column("finished_at", UTCDateTime(), nullable=True),
    sa.Column("outcome", _enum(states.AttemptOutcome, "outcome"), nullable=True),
    sa.Column("status_code", sa.Integer(), nullable=True),
    sa.Column("error", sa.Text(), nullable=True),
    sa.Column("provider_ref", sa.String(500), nullable=True),
    # The worker had lost its lease when it reported: evidence only, never state.
    sa.Column("late", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.UniqueConstraint("effect_id", "attempt_no"),
    sa.CheckConstraint("(finished_at IS NULL) = (outcome IS NULL)", name="finished_has_outcome"),
    # Half of each page free: finishing an attempt changes no indexed column, so with
    # room on its page the update is HOT (no index entries), as nearly all are.
    postgresql_with={"fillfactor": ATTEMPTS_FILLFACTOR},
)

lookups = sa.Table(
    "lookups",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column(
        "effect_id", sa.BigInteger(), sa.ForeignKey("outbox.id", ondelete="CASCADE"), nullable=False
    ),
    sa.Column("worker", sa.String(200), nullable=False),
    sa.Column("at", UTCDateTime(), nullable=False),
    sa.Column("outcome", _enum(states.LookupOutcome, "lookup_outcome"), nullable=False),
    sa.Column("provider_ref", sa.String(500), nullable=True),
    sa.Column("error", sa.Text(), nullable=True),
    sa.Index("ix_lookups_effect_id", "effect_id"),
)

review_actions = sa.Table(
    "review_actions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    # Chosen by the caller: the same action id again is a replay, not a second action.
    sa.Column("action_id", sa.String(100), nullable=False, unique=True),
    sa.Column(
        "effect_id", sa.BigInteger(), sa.ForeignKey("outbox.id", ondelete="CASCADE"), nullable=False
    ),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("at", UTCDateTime(), nullable=False),
    sa.Column("choice", _enum(states.ReviewChoice, "choice"), nullable=False),
    sa.Column("reason", sa.Text(), nullable=False),
    sa.Column("provider_ref", sa.String(500), nullable=True),
    sa.Column("status_before", sa.String(32), nullable=False),
    sa.Column("status_after", sa.String(32), nullable=False),
    # The authenticated principal: the token that acted (NULL from the command line,
    # where the actor is the OS account); the caller's own words are only a note.
    sa.Column("actor_token_id", sa.BigInteger(), nullable=True),
    sa.Column("actor_note", sa.String(200), nullable=True),
    sa.CheckConstraint("length(reason) > 0", name="reason_required"),
    sa.Index("ix_review_actions_effect_id", "effect_id"),
)

approval_actions = sa.Table(
    "approval_actions",
    metadata,
    # The audit of an approval-required operation's decision: who, when, why.
    # A decision is final, so there is at most one per operation (the unique
    # key is the second guard, after the compare-and-set on operations.approval).
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("operation_id", sa.String(255), nullable=False),
    sa.Column("decision", _enum(states.ApprovalDecision, "decision"), nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("at", UTCDateTime(), nullable=False),
    sa.Column("reason", sa.Text(), nullable=False, server_default=""),
    sa.Column("status_before", sa.String(32), nullable=False),
    sa.Column("status_after", sa.String(32), nullable=False),
    sa.ForeignKeyConstraint(
        ["tenant", "operation_id"],
        ["operations.tenant", "operations.operation_id"],
        name="fk_approval_actions_operation",
        ondelete="CASCADE",
    ),
    sa.UniqueConstraint("tenant", "operation_id"),
    sa.CheckConstraint("decision <> 'reject' OR length(reason) > 0", name="rejection_has_reason"),
)

webhook_events = sa.Table(
    "webhook_events",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("adapter", sa.String(100), nullable=False),
    # The provider's event id: a second delivery of the same event is a duplicate.
    sa.Column("event_id", sa.String(255), nullable=False),
    sa.Column("event_type", sa.String(200), nullable=False),
    # What the event says happened: succeeded, failed, or NULL (it settles nothing).
    sa.Column("outcome", sa.String(32), nullable=True),
    # How it names the effect: our key, the client reference we sent, or the provider's ref.
    sa.Column("effect_key", sa.String(200), nullable=True),
    sa.Column("provider_ref", sa.String(500), nullable=True),
    sa.Column("tenant", sa.String(64), nullable=True),
    sa.Column(
        "effect_id", sa.BigInteger(), sa.ForeignKey("outbox.id", ondelete="CASCADE"), nullable=True
    ),
    sa.Column("disposition", _enum(states.WebhookDisposition, "disposition"), nullable=False),
    sa.Column("detail", sa.Text(), nullable=True),
    sa.Column("signed_at", UTCDateTime(), nullable=False),
    sa.Column("received_at", UTCDateTime(), nullable=False),
    sa.Column("processed_at", UTCDateTime(), nullable=True),
    # The body exactly as received (it was signed): evidence.
    sa.Column("body", sa.Text(), nullable=False),
    sa.UniqueConstraint("adapter", "event_id"),
    sa.Index("ix_webhook_events_effect_id", "effect_id"),
    sa.Index(
        "ix_webhook_events_unmatched",
        "received_at",
        sqlite_where=sa.text("disposition = 'unmatched'"),
        postgresql_where=sa.text("disposition = 'unmatched'"),
    ),
)

bulk_actions = sa.Table(
    "bulk_actions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    # Chosen by the caller: the same bulk id again replays the recorded action.
    sa.Column("bulk_id", sa.String(100), nullable=False, unique=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("action", sa.String(32), nullable=False),
    # The filter as given (JSON) and the effect ids it selected (JSON list), frozen.
    sa.Column("filter", sa.Text(), nullable=False),
    sa.Column("effect_ids", sa.Text(), nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("reason", sa.Text(), nullable=False),
    sa.Column("at", UTCDateTime(), nullable=False),
    sa.Column("finished_at", UTCDateTime(), nullable=True),
    sa.Column("applied", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("skipped", sa.Integer(), nullable=False, server_default="0"),
)

bulk_action_items = sa.Table(
    "bulk_action_items",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("bulk_id", sa.String(100), nullable=False),
    sa.Column(
        "effect_id", sa.BigInteger(), sa.ForeignKey("outbox.id", ondelete="CASCADE"), nullable=False
    ),
    sa.Column("action", sa.String(32), nullable=False),
    # applied: the item changed; skipped: it was no longer as selected, nothing changed.
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("status_before", sa.String(32), nullable=False),
    sa.Column("status_after", sa.String(32), nullable=False),
    sa.Column("detail", sa.Text(), nullable=True),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("at", UTCDateTime(), nullable=False),
    # One entry per item per bulk action: a repeat or a concurrent run cannot apply twice.
    sa.UniqueConstraint("bulk_id", "effect_id"),
    sa.Index("ix_bulk_action_items_effect_id", "effect_id"),
)

tombstones = sa.Table(
    "tombstones",
    metadata,
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("operation_id", sa.String(255), primary_key=True),
    sa.Column("args_digest", sa.String(64), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("expired_at", UTCDateTime(), nullable=False),
    sa.Column("forget_at", UTCDateTime(), nullable=False),
    sa.Index("ix_tombstones_forget_at", "forget_at"),
)

# The effect_key is immutable: the database refuses an UPDATE that changes it.
EFFECT_KEY_TRIGGER_SQLITE = """
CREATE TRIGGER trg_outbox_effect_key_immutable
BEFORE UPDATE OF effect_key ON outbox
WHEN NEW.effect_key IS NOT OLD.effect_key
BEGIN
    SELECT RAISE(ABORT, 'effect_key is immutable');
END
"""

EFFECT_KEY_TRIGGER_POSTGRES = [
    """
CREATE FUNCTION outbox_effect_key_immutable() RETURNS trigger AS $$
BEGIN
    IF NEW.effect_key IS DISTINCT FROM OLD.effect_key THEN
        RAISE EXCEPTION 'effect_key is immutable' USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END
$$ LANGUAGE plpgsql
""",
    """
CREATE TRIGGER trg_outbox_effect_key_immutable
BEFORE UPDATE OF effect_key ON outbox
FOR EACH ROW EXECUTE FUNCTION outbox_effect_key_immutable()
""",
]

# Wake dispatchers as soon as new rows commit (PostgreSQL only): a statement-level
# trigger on outbox notifies this channel when its statement inserted a pending
# row (migrations 0001 and 0007). Not on every insert statement: a replay's create
# statement inserts none (its lookup rides in it), and every NOTIFY makes its commit
# take a lock that serialises all notifying commits in the cluster, and wakes every
# dispatcher for a pass that finds nothing.
NOTIFY_CHANNEL = "outbox_pending"

# The wake-up's gate (PostgreSQL; the table exists on SQLite too, unused): how many
# dispatchers are about to sleep on LISTEN. The trigger holds WAKEUP_LOCK shared,
# reads the count and notifies only when it is above zero, so under a backlog (every
# dispatcher busy) or with none running, a create's commit takes no notify lock. A
# dispatcher counts itself in under WAKEUP_LOCK exclusive, which waits for the
# creates that read the count before it, and then looks once more before it sleeps:
# a create that saw zero has committed by then. Migration 0008.
WAKEUP_LOCK = 726374  # an advisory lock key (db.upgrade's is 726373)
dispatch_wakeup = sa.Table(
    "dispatch_wakeup",
    metadata,
    sa.Column("id", sa.SmallInteger(), primary_key=True, autoincrement=False),
    sa.Column("sleepers", sa.Integer(), nullable=False, server_default="0"),
    sa.CheckConstraint("id = 1", name="one_row"),
)

# Who is counted in (migration 0009): one row per sleeping dispatcher, keyed by the
# backend pid of its LISTEN connection and that backend's start (pids are reused).
# Every count-in and count-out, under WAKEUP_LOCK exclusive, deletes the rows whose
# backend is gone and sets ``dispatch_wakeup.sleepers`` to the rows left, so a
# dispatcher killed while counted in stops costing notifications at the next
# count-in of any dispatcher.
dispatch_sleepers = sa.Table(
    "dispatch_sleepers",
    metadata,
    sa.Column("pid", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("backend_start", sa.DateTime(timezone=True), nullable=True),
    sa.Column("worker", sa.String(200), nullable=False),
    sa.Column("since", sa.DateTime(timezone=True), nullable=False),
)


def utcnow() -> datetime:
    return datetime.now(UTC)


def _enum_checks() -> None:
    """Each enum column's CHECK, named as the type's own would be (``ck_outbox_status``)."""
    for table in metadata.tables.values():
        for column in table.columns:
            if isinstance(column.type, sa.Enum):
                assert column.type.name is not None
                table.append_constraint(
                    sa.CheckConstraint(
                        OneOf(column.name, list(column.type.enums)), name=column.type.name
                    )
                )


_enum_checks()
