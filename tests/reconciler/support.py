"""Helpers for the reconciler tests: effects created through the real create path,
then put into the state a test needs.

``put_unknown`` and friends write rows directly. They stand for what the
dispatcher records (an attempt row, a status): the sweeps and the review queue
are tested on their own here, and together with the real dispatcher in
``test_flow.py`` and ``test_state_machine.py``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from adapters import Capabilities, Registry
from adapters.testing import FakeAdapter
from outbox import Outbox, db, schema, states

TENANT = "acme"
ADAPTER = "helpdesk"
S = states.EffectStatus

# A provider that ignores keys but can be asked, once 30 s have passed.
IGNORING_WITH_LOOKUP = Capabilities(
    honours_idempotency_keys=False, supports_lookup=True, lookup_settle_seconds=30.0
)
IGNORING_NO_LOOKUP = Capabilities(honours_idempotency_keys=False, supports_lookup=False)


def registry_with(adapter: FakeAdapter) -> Registry:
    return Registry([adapter])


def create_effect(box: Outbox, operation_id: str = "op-1", tenant: str = TENANT) -> int:
    """One support task with one helpdesk effect, through the real create path."""
    result = box.execute(tenant, operation_id, "create_support_task", {"subject": operation_id})
    assert result.created
    out = schema.outbox
    with db.read(box.engine) as conn:
        effect_id: int = conn.execute(
            sa.select(out.c.id).where(out.c.tenant == tenant, out.c.operation_id == operation_id)
        ).scalar_one()
    return effect_id


def row(engine: Engine, effect_id: int) -> Any:
    with db.read(engine) as conn:
        return conn.execute(sa.select(schema.outbox).where(schema.outbox.c.id == effect_id)).one()


def rows(engine: Engine, table: sa.Table, effect_id: int) -> list[Any]:
    with db.read(engine) as conn:
        return list(
            conn.execute(
                sa.select(table).where(table.c.effect_id == effect_id).order_by(table.c.id)
            ).all()
        )


def update(engine: Engine, effect_id: int, **values: Any) -> None:
    with db.write(engine) as conn:
        conn.execute(
            sa.update(schema.outbox).where(schema.outbox.c.id == effect_id).values(**values)
        )


def add_attempt(
    engine: Engine,
    effect_id: int,
    *,
    started_at: datetime,
    finished_at: datetime | None = None,
    outcome: states.AttemptOutcome | None = None,
    worker: str = "dispatcher-1",
    error: str | None = None,
) -> None:
    r = row(engine, effect_id)
    with db.write(engine) as conn:
        conn.execute(
            sa.insert(schema.attempts),
            {
                "effect_id": effect_id,
                "attempt_no": r.attempts + 1,
                "worker": worker,
                "fence": r.fence,
                "effect_key": r.effect_key,
                "started_at": started_at,
                "finished_at": finished_at,
                "outcome": outcome,
                "error": error,
            },
        )
        conn.execute(
            sa.update(schema.outbox)
            .where(schema.outbox.c.id == effect_id)
            .values(attempts=r.attempts + 1)
        )


def put_unknown(
    engine: Engine,
    effect_id: int,
    *,
    at: datetime,
    needs_review: bool = False,
    reason: states.Reason = states.Reason.AMBIGUOUS_NO_KEY_SUPPORT,
) -> None:
    """One ambiguous attempt at ``at`` (a 500 after the provider may have acted)."""
    add_attempt(
        engine,
        effect_id,
        started_at=at,
        finished_at=at + timedelta(seconds=1),
        outcome=states.AttemptOutcome.AMBIGUOUS,
        error="500 Internal Server Error",
    )
    update(
        engine,
        effect_id,
        status=S.OUTCOME_UNKNOWN,
        reason=reason,
        maybe_sent=True,
        needs_review=needs_review,
        review_since=at if needs_review else None,
        updated_at=at,
    )


def snapshot(engine: Engine, effect_id: int) -> dict[str, Any]:
    """Everything about one effect, to prove that an action changed nothing."""
    return {
        "row": row(engine, effect_id)._asdict(),
        "attempts": [r._asdict() for r in rows(engine, schema.attempts, effect_id)],
        "lookups": [r._asdict() for r in rows(engine, schema.lookups, effect_id)],
        "actions": [r._asdict() for r in rows(engine, schema.review_actions, effect_id)],
    }
