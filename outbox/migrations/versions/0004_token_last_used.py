"""api_tokens.last_used_at: when a token last authenticated (at minute resolution),
so ``outbox tokens list`` shows which tokens are still in use.

Revision ID: 0004
Revises: 0001
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: SQLite adds it with a plain ALTER TABLE, no table copy.
    op.add_column("api_tokens", sa.Column("last_used_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("last_used_at")
