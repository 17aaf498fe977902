"""The app's own table. Its migration is ``migrations/0001_refunds.py``."""

from __future__ import annotations

import sqlalchemy as sa

from outbox.schema import UTCDateTime

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "pk": "pk_%(table_name)s",
    }
)

refunds = sa.Table(
    "refunds",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    # The operation that created the refund: one refund per operation, enforced here too.
    sa.Column("operation_id", sa.String(255), nullable=False),
    sa.Column("order_id", sa.String(64), nullable=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("currency", sa.String(3), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.UniqueConstraint("tenant", "operation_id"),
    sa.CheckConstraint("amount_cents > 0", name="amount_positive"),
)
