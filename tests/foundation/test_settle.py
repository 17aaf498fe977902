"""The one settle step: compare-and-set, fence raised, terminal never reopened."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox import Outbox, db, schema, states
from outbox.settling import settle

S = states.EffectStatus


def _effect(box: Outbox) -> sa.Row:
    box.execute("acme", "op-1", "create_support_task", {"subject": "s"})
    with db.read(box.engine) as conn:
        return conn.execute(sa.select(schema.outbox)).one()


def _settlement(row: sa.Row, clock, **changes) -> settle.Settlement:
    fields = {
        "effect_id": row.id,
        "expected_status": S(row.status),
        "expected_fence": row.fence,
        "to": S.SUCCEEDED,
        "reason": states.Reason.DELIVERED,
        "source": states.SettleSource.WEBHOOK,
        "at": clock(),
        "provider_ref": "T-1",
        **changes,
    }
    return settle.Settlement(**fields)


def test_settles_once_raises_the_fence_and_never_again(box: Outbox, clock) -> None:
    row = _effect(box)
    with db.write(box.engine) as conn:
        assert settle.settle(conn, _settlement(row, clock))
        # The same read again: the row moved on, nothing is written.
        assert not settle.settle(conn, _settlement(row, clock, to=S.FAILED, provider_ref=None))
    with db.read(box.engine) as conn:
        after = conn.execute(sa.select(schema.outbox)).one()
    assert (after.status, after.provider_ref, after.fence, after.settled_by) == (
        S.SUCCEEDED,
        "T-1",
        row.fence + 1,
        "webhook",
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"expected_status": S.SUCCEEDED},  # never out of a terminal state
        {"expected_status": S.FAILED, "to": S.FAILED},
        {"to": S.PENDING},  # only into a terminal state
        {"to": S.OUTCOME_UNKNOWN},
        {"provider_ref": None},  # succeeded needs a reference
    ],
)
def test_edges_it_does_not_own_are_refused(box: Outbox, clock, changes) -> None:
    row = _effect(box)
    with pytest.raises((states.IllegalTransition, ValueError)), db.write(box.engine) as conn:
        settle.settle(conn, _settlement(row, clock, **changes))
