"""Per-tenant rate limits, token expiry, and the authenticated actor of review actions.

- ``tenants.rate_limit``: the tenant's API rate limit (``10/second``, the
  ``limits`` library's notation); NULL means ``OUTBOX_RATE_LIMIT``.
- ``api_tokens.expires_at``: after it the token authenticates nothing; NULL
  means it does not expire.
- ``review_actions.actor_token_id``: the token that made the action (NULL for
  actions from the command line, whose principal is the OS account);
  ``review_actions.actor_note``: what the caller said about who they are, kept
  as a note, never as the actor.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("rate_limit", sa.String(length=64), nullable=True))
    op.add_column("api_tokens", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("review_actions", sa.Column("actor_token_id", sa.BigInteger(), nullable=True))
    op.add_column("review_actions", sa.Column("actor_note", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("review_actions") as batch:
        batch.drop_column("actor_note")
        batch.drop_column("actor_token_id")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("expires_at")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("rate_limit")
