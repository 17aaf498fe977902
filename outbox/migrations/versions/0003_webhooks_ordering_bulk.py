"""Webhooks, ordering groups and bulk review actions.

- ``outbox.ordering_key``: effects sharing (tenant, adapter, ordering_key) are
  delivered in creation order; ``ix_outbox_ordering_open`` serves the claim's
  "is an earlier effect of my group still open?" probe;
- ``outbox.settled_by``: which source of evidence (lookup, webhook, operator)
  settled an effect;
- ``webhook_events``: every verified provider event, deduplicated on
  (adapter, event_id), with what it did;
- ``bulk_actions`` and ``bulk_action_items``: one filtered operator action
  over many review items, idempotent on its ``bulk_id``, audited per item.

Only columns are added to ``outbox`` (``ALTER TABLE ... ADD COLUMN`` on both
backends), so the table is not rebuilt and its trigger stays.

Revision ID: 0003
Revises: 0001
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox import schema

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
SETTLED_BY = ["lookup", "webhook", "operator"]
DISPOSITION = ["unmatched", "settled", "confirmed", "conflict", "ignored"]


def _in(column: str, values: list[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.add_column("outbox", sa.Column("ordering_key", sa.String(length=200), nullable=True))
    # With its CHECK inline: SQLite cannot add a constraint to an existing table.
    op.execute(
        "ALTER TABLE outbox ADD COLUMN settled_by VARCHAR(32) "
        f"CONSTRAINT ck_outbox_settled_by CHECK ({_in('settled_by', SETTLED_BY)})"
    )
    op.create_index(
        "ix_outbox_ordering_open",
        "outbox",
        ["tenant", "adapter", "ordering_key", "id"],
        unique=False,
        sqlite_where=sa.text(schema.ORDERING_OPEN_SQL),
        postgresql_where=sa.text(schema.ORDERING_OPEN_SQL),
    )
    op.create_table(
        "webhook_events",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("adapter", sa.String(length=100), nullable=False),
        sa.Column("event_id", sa.String(length=255), nullable=False),
        sa.Column("event_type", sa.String(length=200), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=True),
        sa.Column("effect_key", sa.String(length=200), nullable=True),
        sa.Column("provider_ref", sa.String(length=500), nullable=True),
        sa.Column("tenant", sa.String(length=64), nullable=True),
        sa.Column("effect_id", sa.BigInteger(), nullable=True),
        sa.Column(
            "disposition",
            sa.Enum(
                *DISPOSITION,
                name="disposition",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("signed_at", TS, nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.Column("processed_at", TS, nullable=True),
        sa.Column("body", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["effect_id"],
            ["outbox.id"],
            name=op.f("fk_webhook_events_effect_id_outbox"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_events")),
        sa.UniqueConstraint("adapter", "event_id", name=op.f("uq_webhook_events_adapter_event_id")),
    )
    op.create_index("ix_webhook_events_effect_id", "webhook_events", ["effect_id"], unique=False)
    op.create_index(
        "ix_webhook_events_unmatched",
        "webhook_events",
        ["received_at"],
        unique=False,
        sqlite_where=sa.text("disposition = 'unmatched'"),
        postgresql_where=sa.text("disposition = 'unmatched'"),
    )
    op.create_table(
        "bulk_actions",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("bulk_id", sa.String(length=100), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("filter", sa.Text(), nullable=False),
        sa.Column("effect_ids", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("applied", sa.Integer(), server_default="0", nullable=False),
        sa.Column("skipped", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bulk_actions")),
        sa.UniqueConstraint("bulk_id", name=op.f("uq_bulk_actions_bulk_id")),
    )
    op.create_table(
        "bulk_action_items",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("bulk_id", sa.String(length=100), nullable=False),
        sa.Column("effect_id", sa.BigInteger(), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("status_before", sa.String(length=32), nullable=False),
        sa.Column("status_after", sa.String(length=32), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["effect_id"],
            ["outbox.id"],
            name=op.f("fk_bulk_action_items_effect_id_outbox"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bulk_action_items")),
        sa.UniqueConstraint(
            "bulk_id", "effect_id", name=op.f("uq_bulk_action_items_bulk_id_effect_id")
        ),
    )
    op.create_index(
        "ix_bulk_action_items_effect_id", "bulk_action_items", ["effect_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_bulk_action_items_effect_id", table_name="bulk_action_items")
    op.drop_table("bulk_action_items")
    op.drop_table("bulk_actions")
    op.drop_index("ix_webhook_events_unmatched", table_name="webhook_events")
    op.drop_index("ix_webhook_events_effect_id", table_name="webhook_events")
    op.drop_table("webhook_events")
    op.drop_index("ix_outbox_ordering_open", table_name="outbox")
    # SQLite (3.35+) drops a column only without a constraint on it; the
    # CHECK is the column's own, so it goes with it on both backends.
    op.execute("ALTER TABLE outbox DROP COLUMN settled_by")
    op.drop_column("outbox", "ordering_key")
