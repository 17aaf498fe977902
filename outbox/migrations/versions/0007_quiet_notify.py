"""A quieter wake-up (PostgreSQL only): notify only when a pending row was inserted.

``trg_outbox_notify_pending`` fired for every INSERT statement on ``outbox``.
A create's one statement now carries the key's lookup, so a replay sends it
too and inserts nothing: it must not NOTIFY. A NOTIFY makes its commit take a
lock that serialises every notifying commit in the cluster, and wakes every
dispatcher for a pass that finds nothing. The trigger now reads the
statement's transition table. Held rows (awaiting approval) wake nobody: the
approval sends its own NOTIFY.

``CREATE OR REPLACE FUNCTION`` and the trigger's re-creation are one
transaction with the revision's stamp: a create running meanwhile waits for
the trigger's lock, then sees either trigger.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

CHANNEL = "outbox_pending"  # schema.NOTIFY_CHANNEL, as of this revision


def _trigger(*, referencing: str, notify: str) -> list[str]:
    function = (
        "CREATE OR REPLACE FUNCTION outbox_notify_pending() RETURNS trigger AS $$"
        f" BEGIN {notify} RETURN NULL; END $$ LANGUAGE plpgsql"
    )
    trigger = (
        f"CREATE TRIGGER trg_outbox_notify_pending AFTER INSERT ON outbox {referencing}"
        " FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_pending()"
    )
    return [function, "DROP TRIGGER IF EXISTS trg_outbox_notify_pending ON outbox", trigger]


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for statement in _trigger(
        referencing="REFERENCING NEW TABLE AS inserted",
        notify="IF EXISTS (SELECT 1 FROM inserted WHERE status = 'pending') THEN"
        f" PERFORM pg_notify('{CHANNEL}', ''); END IF;",
    ):
        op.execute(statement)


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for statement in _trigger(referencing="", notify=f"PERFORM pg_notify('{CHANNEL}', '');"):
        op.execute(statement)
