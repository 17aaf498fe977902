"""The wake-up's gate heals: who is counted in, so a dead dispatcher's count goes.

0008 kept ``dispatch_wakeup.sleepers`` as a bare count: a dispatcher killed while
counted in (SIGKILL, OOM, a lost host) left it one too high for good, and every
create notified from then on (four clients: 0.61x raw instead of 0.82x).

``dispatch_sleepers`` holds one row per dispatcher counted in, keyed by the
backend pid of its LISTEN connection, with that backend's start time (a pid can
be reused). A count-in, under the gate's advisory lock held exclusive as before,
deletes the rows whose backend no longer runs, writes its own, and sets
``sleepers`` to the number of rows; a count-out deletes its row and does the same.
A dispatcher that dies takes its LISTEN connection with it, so the next count-in
of any dispatcher drops it. The trigger is unchanged: it still reads the one
count, so a create pays nothing more.

Dispatchers of the release before count themselves in without a row: the first
count-in of a new dispatcher leaves them out, and until they are restarted they
may find new rows by their poll (OUTBOX_POLL_INTERVAL).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dispatch_sleepers",
        sa.Column("pid", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("backend_start", sa.DateTime(timezone=True), nullable=True),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("pid", name=op.f("pk_dispatch_sleepers")),
    )


def downgrade() -> None:
    op.drop_table("dispatch_sleepers")
