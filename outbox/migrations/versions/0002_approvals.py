"""Approvals: held effects, the operation's approval state and its audit.

- ``outbox.status`` gains ``held`` (an effect waiting for an operator's
  approval; never claimable), ``outbox.reason`` gains ``awaiting_approval``,
  ``approved`` and ``rejected``, and ``ck_outbox_held_never_sent`` says a held
  effect was never attempted;
- ``operations.approval``: NULL unless the tool requires approval;
- ``approval_actions``: who decided, when and why (at most one per operation).

SQLite cannot change a table's CHECK constraints in place: the outbox table
is rebuilt (new table, copy, drop, rename; indexes and the effect_key trigger
again). ``outbox db upgrade`` runs SQLite migrations with foreign keys off, so
dropping the old table does not cascade to the attempts that reference it,
and checks every foreign key before it turns them back on.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox import schema

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)

# Frozen here: a later revision that adds a value must not change what this one did.
STATUS_BEFORE = ["pending", "in_flight", "succeeded", "failed", "outcome_unknown"]
STATUS_AFTER = ["held", *STATUS_BEFORE]
REASON_BEFORE = [
    "created",
    "claimed",
    "delivered",
    "permanent",
    "not_sent",
    "retryable",
    "ambiguous_keys_honoured",
    "ambiguous_no_key_support",
    "lease_expired",
    "released",
    "deadline_nothing_sent",
    "deadline_may_have_sent",
    "max_attempts",
    "adapter_error",
    "lookup_found",
    "lookup_not_found",
    "review_no_lookup",
    "review_lookup_exhausted",
    "operator_happened",
    "operator_requeue",
    "operator_abandon",
]
REASON_AFTER = [*REASON_BEFORE, "awaiting_approval", "approved", "rejected"]
APPROVAL = ["awaiting_approval", "approved", "rejected"]
HELD_NEVER_SENT = (
    "status <> 'held' OR (attempts = 0 AND maybe_sent = false AND lease_owner IS NULL)"
)


def _in(column: str, values: list[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.execute(
        "ALTER TABLE operations ADD COLUMN approval VARCHAR(32) "
        f"CONSTRAINT ck_operations_approval CHECK ({_in('approval', APPROVAL)})"
    )
    op.create_index(
        "ix_operations_awaiting_approval",
        "operations",
        ["tenant", "created_at"],
        unique=False,
        sqlite_where=sa.text("approval = 'awaiting_approval'"),
        postgresql_where=sa.text("approval = 'awaiting_approval'"),
    )
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_outbox_sqlite(STATUS_AFTER, REASON_AFTER, held=True)
    else:
        _replace_checks_postgres(STATUS_AFTER, REASON_AFTER)
        op.create_check_constraint(op.f("ck_outbox_held_never_sent"), "outbox", HELD_NEVER_SENT)
    op.create_table(
        "approval_actions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("operation_id", sa.String(length=255), nullable=False),
        sa.Column("decision", sa.String(length=32), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.Column("reason", sa.Text(), server_default="", nullable=False),
        sa.Column("status_before", sa.String(length=32), nullable=False),
        sa.Column("status_after", sa.String(length=32), nullable=False),
        sa.CheckConstraint(
            _in("decision", ["approve", "reject"]), name=op.f("ck_approval_actions_decision")
        ),
        sa.CheckConstraint(
            "decision <> 'reject' OR length(reason) > 0",
            name=op.f("ck_approval_actions_rejection_has_reason"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant", "operation_id"],
            ["operations.tenant", "operations.operation_id"],
            name="fk_approval_actions_operation",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_approval_actions")),
        sa.UniqueConstraint(
            "tenant", "operation_id", name=op.f("uq_approval_actions_tenant_operation_id")
        ),
    )


def downgrade() -> None:
    op.drop_table("approval_actions")
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_outbox_sqlite(STATUS_BEFORE, REASON_BEFORE, held=False)
    else:
        op.drop_constraint(op.f("ck_outbox_held_never_sent"), "outbox", type_="check")
        _replace_checks_postgres(STATUS_BEFORE, REASON_BEFORE)
    op.drop_index("ix_operations_awaiting_approval", table_name="operations")
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE operations DROP COLUMN approval")
    else:
        op.drop_column("operations", "approval")


def _replace_checks_postgres(status: list[str], reason: list[str]) -> None:
    for column, values in (("status", status), ("reason", reason)):
        op.drop_constraint(op.f(f"ck_outbox_{column}"), "outbox", type_="check")
        op.create_check_constraint(op.f(f"ck_outbox_{column}"), "outbox", _in(column, values))


_OUTBOX_COLUMNS = (
    "id, tenant, operation_id, effect, adapter, payload, effect_key, status, reason, attempts, "
    "maybe_sent, next_attempt_at, deadline_at, lease_owner, lease_expires_at, fence, "
    "needs_review, review_since, lookup_attempts, next_lookup_at, provider_ref, last_error, "
    "created_at, updated_at, finished_at"
)


def _rebuild_outbox_sqlite(status: list[str], reason: list[str], *, held: bool) -> None:
    """The outbox table again, with these CHECKs: create, copy, drop, rename."""
    checks = [
        sa.CheckConstraint(_in("status", status), name=op.f("ck_outbox_status")),
        sa.CheckConstraint(_in("reason", reason), name=op.f("ck_outbox_reason")),
        sa.CheckConstraint(
            "needs_review = false OR status = 'outcome_unknown'",
            name=op.f("ck_outbox_review_only_when_unknown"),
        ),
        sa.CheckConstraint(
            "status <> 'in_flight' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name=op.f("ck_outbox_in_flight_has_lease"),
        ),
        sa.CheckConstraint(
            "status <> 'succeeded' OR provider_ref IS NOT NULL",
            name=op.f("ck_outbox_succeeded_has_provider_ref"),
        ),
        sa.CheckConstraint(
            "status NOT IN ('failed', 'succeeded') OR finished_at IS NOT NULL",
            name=op.f("ck_outbox_terminal_has_finished_at"),
        ),
        sa.CheckConstraint(
            "attempts >= 0 AND lookup_attempts >= 0", name=op.f("ck_outbox_counts_not_negative")
        ),
    ]
    if held:
        checks.append(sa.CheckConstraint(HELD_NEVER_SENT, name=op.f("ck_outbox_held_never_sent")))
    op.create_table(
        "outbox_rebuilt",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("operation_id", sa.String(length=255), nullable=False),
        sa.Column("effect", sa.String(length=100), nullable=False),
        sa.Column("adapter", sa.String(length=100), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("effect_key", sa.String(length=100), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(length=40), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("maybe_sent", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("next_attempt_at", TS, nullable=False),
        sa.Column("deadline_at", TS, nullable=False),
        sa.Column("lease_owner", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("fence", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("needs_review", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("review_since", TS, nullable=True),
        sa.Column("lookup_attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_lookup_at", TS, nullable=True),
        sa.Column("provider_ref", sa.String(length=500), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        *checks,
        sa.ForeignKeyConstraint(
            ["tenant", "operation_id"],
            ["operations.tenant", "operations.operation_id"],
            name="fk_outbox_operation",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
        sa.UniqueConstraint("effect_key", name=op.f("uq_outbox_effect_key")),
    )
    op.execute(
        f"INSERT INTO outbox_rebuilt ({_OUTBOX_COLUMNS}) SELECT {_OUTBOX_COLUMNS} FROM outbox"
    )
    op.drop_table("outbox")  # its indexes and trigger go with it
    op.rename_table("outbox_rebuilt", "outbox")
    for name, columns, where in (
        ("ix_outbox_due", ["next_attempt_at", "id"], "status = 'pending'"),
        ("ix_outbox_leased", ["lease_expires_at"], "status = 'in_flight'"),
        ("ix_outbox_unknown", ["next_lookup_at"], "status = 'outcome_unknown'"),
    ):
        op.create_index(name, "outbox", columns, unique=False, sqlite_where=sa.text(where))
    op.create_index(
        "ix_outbox_tenant_operation_id", "outbox", ["tenant", "operation_id"], unique=False
    )
    op.execute(schema.EFFECT_KEY_TRIGGER_SQLITE)
