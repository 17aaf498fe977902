"""Initial schema: tenants, tokens, tasks, operations, outbox, attempts, lookups,
review actions and tombstones; the effect_key immutability trigger; and on
PostgreSQL the NOTIFY trigger that wakes dispatchers.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox import schema

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
    )
    op.create_table(
        "tombstones",
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("operation_id", sa.String(length=255), nullable=False),
        sa.Column("args_digest", sa.String(length=64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expired_at", TS, nullable=False),
        sa.Column("forget_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("tenant", "operation_id", name=op.f("pk_tombstones")),
    )
    op.create_index("ix_tombstones_forget_at", "tombstones", ["forget_at"], unique=False)
    op.create_table(
        "api_tokens",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("token_sha256", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column(
            "role",
            sa.Enum(
                "agent",
                "operator",
                name="role",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("label", sa.String(length=200), server_default="", nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("revoked_at", TS, nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant"], ["tenants.id"], name=op.f("fk_api_tokens_tenant_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_sha256", name=op.f("uq_api_tokens_token_sha256")),
    )
    op.create_table(
        "operations",
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("operation_id", sa.String(length=255), nullable=False),
        sa.Column("tool", sa.String(length=100), nullable=False),
        sa.Column("payload_version", sa.Integer(), nullable=False),
        sa.Column("args_digest", sa.String(length=64), nullable=False),
        sa.Column("receipt", sa.Text(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.BigInteger(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant"], ["tenants.id"], name=op.f("fk_operations_tenant_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant", "operation_id", name=op.f("pk_operations")),
    )
    op.create_index("ix_operations_expires_at", "operations", ["expires_at"], unique=False)
    op.create_table(
        "tasks",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("subject", sa.String(length=200), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column(
            "priority",
            sa.Enum(
                "low",
                "normal",
                "high",
                name="priority",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("operation_id", sa.String(length=255), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["tenant"], ["tenants.id"], name=op.f("fk_tasks_tenant_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
    )
    op.create_index("ix_tasks_tenant_id", "tasks", ["tenant", "id"], unique=False)
    op.create_table(
        "outbox",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("operation_id", sa.String(length=255), nullable=False),
        sa.Column("effect", sa.String(length=100), nullable=False),
        sa.Column("adapter", sa.String(length=100), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("effect_key", sa.String(length=100), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "pending",
                "in_flight",
                "succeeded",
                "failed",
                "outcome_unknown",
                name="status",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column(
            "reason",
            sa.Enum(
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
                name="reason",
                native_enum=False,
                create_constraint=True,
                length=40,
            ),
            nullable=False,
        ),
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
        sa.ForeignKeyConstraint(
            ["tenant", "operation_id"],
            ["operations.tenant", "operations.operation_id"],
            name="fk_outbox_operation",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
        sa.UniqueConstraint("effect_key", name=op.f("uq_outbox_effect_key")),
    )
    op.create_index(
        "ix_outbox_due",
        "outbox",
        ["next_attempt_at", "id"],
        unique=False,
        sqlite_where=sa.text("status = 'pending'"),
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "ix_outbox_leased",
        "outbox",
        ["lease_expires_at"],
        unique=False,
        sqlite_where=sa.text("status = 'in_flight'"),
        postgresql_where=sa.text("status = 'in_flight'"),
    )
    op.create_index(
        "ix_outbox_tenant_operation_id", "outbox", ["tenant", "operation_id"], unique=False
    )
    op.create_index(
        "ix_outbox_unknown",
        "outbox",
        ["next_lookup_at"],
        unique=False,
        sqlite_where=sa.text("status = 'outcome_unknown'"),
        postgresql_where=sa.text("status = 'outcome_unknown'"),
    )
    op.create_table(
        "attempts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("effect_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt_no", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("fence", sa.BigInteger(), nullable=False),
        sa.Column("effect_key", sa.String(length=100), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column(
            "outcome",
            sa.Enum(
                "delivered",
                "not_sent",
                "retryable",
                "permanent",
                "ambiguous",
                "adapter_error",
                "abandoned",
                name="outcome",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=True,
        ),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("provider_ref", sa.String(length=500), nullable=True),
        sa.Column("late", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.CheckConstraint(
            "(finished_at IS NULL) = (outcome IS NULL)",
            name=op.f("ck_attempts_finished_has_outcome"),
        ),
        sa.ForeignKeyConstraint(
            ["effect_id"],
            ["outbox.id"],
            name=op.f("fk_attempts_effect_id_outbox"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint(
            "effect_id", "attempt_no", name=op.f("uq_attempts_effect_id_attempt_no")
        ),
    )
    op.create_table(
        "lookups",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("effect_id", sa.BigInteger(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.Column(
            "outcome",
            sa.Enum(
                "found",
                "not_found",
                "inconclusive",
                "error",
                name="lookup_outcome",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("provider_ref", sa.String(length=500), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["effect_id"],
            ["outbox.id"],
            name=op.f("fk_lookups_effect_id_outbox"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_lookups")),
    )
    op.create_index("ix_lookups_effect_id", "lookups", ["effect_id"], unique=False)
    op.create_table(
        "review_actions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("action_id", sa.String(length=100), nullable=False),
        sa.Column("effect_id", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.Column(
            "choice",
            sa.Enum(
                "happened",
                "not_happened_requeue",
                "not_happened_abandon",
                name="choice",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("provider_ref", sa.String(length=500), nullable=True),
        sa.Column("status_before", sa.String(length=32), nullable=False),
        sa.Column("status_after", sa.String(length=32), nullable=False),
        sa.CheckConstraint("length(reason) > 0", name=op.f("ck_review_actions_reason_required")),
        sa.ForeignKeyConstraint(
            ["effect_id"],
            ["outbox.id"],
            name=op.f("fk_review_actions_effect_id_outbox"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_review_actions")),
        sa.UniqueConstraint("action_id", name=op.f("uq_review_actions_action_id")),
    )
    op.create_index("ix_review_actions_effect_id", "review_actions", ["effect_id"], unique=False)
    if op.get_bind().dialect.name == "sqlite":
        op.execute(schema.EFFECT_KEY_TRIGGER_SQLITE)
    else:
        for statement in schema.EFFECT_KEY_TRIGGER_POSTGRES + _NOTIFY_TRIGGER:
            op.execute(statement)


# This revision's wake-up trigger, as it was (0006 replaces it).
_NOTIFY_TRIGGER = [
    f"""
CREATE FUNCTION outbox_notify_pending() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{schema.NOTIFY_CHANNEL}', '');
    RETURN NULL;
END
$$ LANGUAGE plpgsql
""",
    """
CREATE TRIGGER trg_outbox_notify_pending
AFTER INSERT ON outbox
FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_pending()
""",
]


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trg_outbox_notify_pending ON outbox")
        op.execute("DROP TRIGGER IF EXISTS trg_outbox_effect_key_immutable ON outbox")
        op.execute("DROP FUNCTION IF EXISTS outbox_notify_pending()")
        op.execute("DROP FUNCTION IF EXISTS outbox_effect_key_immutable()")
    for table in (
        "review_actions",
        "lookups",
        "attempts",
        "outbox",
        "tasks",
        "operations",
        "api_tokens",
        "tombstones",
        "tenants",
    ):
        op.drop_table(table)
