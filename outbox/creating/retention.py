"""Retention: receipts become tombstones, tombstones are forgotten.

An operation's record is kept ``OUTBOX_RETENTION`` after its creation. Then,
once every one of its effects is terminal (succeeded or failed: never while
one is pending, in flight or ``outcome_unknown``), the record, its outbox rows
and their evidence are deleted and a tombstone (key and digest, no body) is
written in the same transaction. The tombstone answers a late retry with
"expired: reconcile" until ``OUTBOX_TOMBSTONE_RETENTION`` after the operation's
creation. Tasks are business records: retention never touches them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import db, schema, states

PRUNE_BATCH_DEFAULT = 500


@dataclass(frozen=True, slots=True)
class PruneResult:
    tombstoned: int
    forgotten: int

    @property
    def total(self) -> int:
        return self.tombstoned + self.forgotten


def prune(
    engine: Engine,
    *,
    now: datetime,
    tombstone_retention: timedelta,
    batch: int = PRUNE_BATCH_DEFAULT,
) -> PruneResult:
    """Run until nothing is due; each batch is its own transaction."""
    tombstoned = forgotten = 0
    while True:
        done = _tombstone_batch(engine, now, tombstone_retention, batch)
        tombstoned += done
        if done < batch:
            break
    while True:
        done = _forget_batch(engine, now, batch)
        forgotten += done
        if done < batch:
            break
    return PruneResult(tombstoned, forgotten)


def _tombstone_batch(engine: Engine, now: datetime, keep: timedelta, batch: int) -> int:
    ops, out = schema.operations, schema.outbox
    live = (
        sa.select(sa.literal(1))
        .where(
            out.c.tenant == ops.c.tenant,
            out.c.operation_id == ops.c.operation_id,
            out.c.status.not_in([s.value for s in states.TERMINAL]),
        )
        .exists()
    )
    with db.write(engine) as conn:
        rows = conn.execute(
            sa.select(ops.c.tenant, ops.c.operation_id, ops.c.args_digest, ops.c.created_at)
            .where(ops.c.expires_at <= now, ~live)
            .order_by(ops.c.expires_at)
            .limit(batch)
        ).all()
        if not rows:
            return 0
        conn.execute(
            sa.insert(schema.tombstones),
            [
                {
                    "tenant": r.tenant,
                    "operation_id": r.operation_id,
                    "args_digest": r.args_digest,
                    "created_at": r.created_at,
                    "expired_at": now,
                    "forget_at": max(r.created_at + keep, now),
                }
                for r in rows
            ],
        )
        for r in rows:
            # Cascades to the outbox rows and their attempts, lookups and audit.
            conn.execute(
                sa.delete(ops).where(ops.c.tenant == r.tenant, ops.c.operation_id == r.operation_id)
            )
        return len(rows)


def _forget_batch(engine: Engine, now: datetime, batch: int) -> int:
    t = schema.tombstones
    with db.write(engine) as conn:
        keys = conn.execute(
            sa.select(t.c.tenant, t.c.operation_id).where(t.c.forget_at <= now).limit(batch)
        ).all()
        for k in keys:
            conn.execute(
                sa.delete(t).where(t.c.tenant == k.tenant, t.c.operation_id == k.operation_id)
            )
        return len(keys)
