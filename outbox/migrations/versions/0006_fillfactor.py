"""Fillfactors for the tables every delivery rewrites (PostgreSQL only).

- ``attempts``: 50. A claim inserts an attempt row and the result finishes it;
  finishing changes no indexed column, so with room left on the row's page the
  update is HOT and writes no index entry. At the default of 100 the page is
  full and nearly every finish wrote a new entry in both of the table's indexes.
- ``outbox``: 75. A claim and a result each write a new version of the row;
  room on its page keeps the version there (less WAL, less bloat). These
  updates change ``status``, so they are never HOT: the indexes are written
  either way.

``ALTER TABLE ... SET (fillfactor)`` takes a lock that lets reads and writes
go on, and applies to pages filled from now on; existing pages are left as
they are. SQLite has no fillfactor: nothing to do there.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# The values of this revision, not the schema module's (which may change later).
_FILLFACTORS = {"outbox": 75, "attempts": 50}


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for table, fillfactor in _FILLFACTORS.items():
        op.execute(f"ALTER TABLE {table} SET (fillfactor = {fillfactor})")


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for table in _FILLFACTORS:
        op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
