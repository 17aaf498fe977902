"""The refunds table.

Revision ID: refunds_0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.schema import UTCDateTime

revision = "refunds_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "refunds",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("operation_id", sa.String(255), nullable=False),
        sa.Column("order_id", sa.String(64), nullable=False),
        sa.Column("amount_cents", sa.Integer, nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_refunds"),
        sa.UniqueConstraint("tenant", "operation_id", name="uq_refunds_tenant_operation_id"),
        sa.CheckConstraint("amount_cents > 0", name="ck_refunds_amount_positive"),
    )


def downgrade() -> None:
    op.drop_table("refunds")
