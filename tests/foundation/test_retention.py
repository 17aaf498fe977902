"""Retention: receipts become tombstones; tombstones answer "expired: reconcile"; then go."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from outbox import Outbox, db, errors, schema
from tests.foundation.conftest import counts

TOOL = "create_support_task"


def _set_effects(box: Outbox, **values) -> None:
    with db.write(box.engine) as conn:
        conn.execute(sa.update(schema.outbox).values(**values))


def test_terminal_operation_past_retention_becomes_a_tombstone(box: Outbox, clock):
    box.execute("acme", "op-1", TOOL, {"subject": "s"})
    _set_effects(box, status="succeeded", provider_ref="T-1", finished_at=clock())
    assert box.prune(clock.now + timedelta(days=29)).tombstoned == 0
    result = box.prune(clock.now + timedelta(days=30, seconds=1))
    assert result.tombstoned == 1
    assert counts(box) == {"tasks": 1, "operations": 0, "outbox": 0}  # the task stays

    clock.advance(timedelta(days=31))
    with pytest.raises(errors.OperationExpired) as caught:
        box.execute("acme", "op-1", TOOL, {"subject": "s"})
    assert caught.value.retry == "reconcile" and caught.value.same_arguments
    with pytest.raises(errors.OperationExpired) as caught:
        box.execute("acme", "op-1", TOOL, {"subject": "other"})
    assert not caught.value.same_arguments
    with pytest.raises(errors.OperationExpired):
        box.get_operation("acme", "op-1")
    assert counts(box)["tasks"] == 1  # no second task under the old key


@pytest.mark.parametrize("status", ["pending", "in_flight", "outcome_unknown"])
def test_non_terminal_effects_are_never_pruned(box: Outbox, clock, status):
    box.execute("acme", "op-1", TOOL, {"subject": "s"})
    values = {"status": status}
    if status == "in_flight":
        values |= {"lease_owner": "w", "lease_expires_at": clock.now}
    _set_effects(box, **values)
    assert box.prune(clock.now + timedelta(days=400)).tombstoned == 0
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}


def test_operation_without_effects_is_pruned(box: Outbox, clock):
    box.execute("acme", "op-1", TOOL, {"subject": "s", "helpdesk": False})
    assert box.prune(clock.now + timedelta(days=31)).tombstoned == 1


def test_tombstones_are_forgotten_after_their_own_retention(box: Outbox, clock):
    box.execute("acme", "op-1", TOOL, {"subject": "s", "helpdesk": False})
    box.prune(clock.now + timedelta(days=31))
    assert box.prune(clock.now + timedelta(days=364)).forgotten == 0
    assert box.prune(clock.now + timedelta(days=366)).forgotten == 1
    clock.advance(timedelta(days=367))
    # Past both windows the key is free again: that is the documented limit.
    assert box.execute("acme", "op-1", TOOL, {"subject": "s"}).created


def test_prune_works_in_batches(box: Outbox, clock):
    for i in range(7):
        box.execute("acme", f"op-{i}", TOOL, {"subject": "s", "helpdesk": False})
    from outbox.creating import retention

    result = retention.prune(
        box.engine,
        now=clock.now + timedelta(days=31),
        tombstone_retention=timedelta(days=365),
        batch=3,
    )
    assert result.tombstoned == 7
