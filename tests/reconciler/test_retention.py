"""Retention on the reconciler's schedule: never a live or unknown row, and a late
retry of a pruned operation meets its tombstone ("expired: reconcile")."""

from __future__ import annotations

from datetime import timedelta

import pytest

from outbox import Outbox, errors, states
from reconciler import review, sweeps
from tests.conftest import Clock
from tests.reconciler.support import create_effect, put_unknown, row, update

S = states.EffectStatus


def test_prune_never_touches_a_non_terminal_or_unknown_row(box: Outbox, clock: Clock) -> None:
    pending = create_effect(box, "op-pending")
    in_flight = create_effect(box, "op-in-flight")
    update(box.engine, in_flight, status=S.IN_FLIGHT, lease_owner="w", lease_expires_at=clock())
    unknown = create_effect(box, "op-unknown")
    put_unknown(box.engine, unknown, at=clock())
    in_review = create_effect(box, "op-review")
    put_unknown(box.engine, in_review, at=clock(), needs_review=True)
    done = create_effect(box, "op-done")
    update(box.engine, done, status=S.FAILED, finished_at=clock())

    sweep = sweeps.ApplyRetention(box.engine, box.settings)
    assert sweep.run_once(clock.advance(box.settings.retention + timedelta(days=1))) == 1
    for effect in (pending, in_flight, unknown, in_review):
        assert row(box.engine, effect).status != S.SUCCEEDED  # still there, untouched
    with pytest.raises(errors.OperationExpired):
        box.get_operation("acme", "op-done")

    # Once a person resolves the unknown one, the next pass may prune it.
    review.resolve(
        box.engine,
        in_review,
        choice=states.ReviewChoice.NOT_HAPPENED_ABANDON,
        reason="withdrawn",
        actor="alice",
        action_id="a-1",
        now=clock(),
    )
    assert sweep.run_once(clock()) == 1
    with pytest.raises(errors.OperationExpired):
        box.get_operation("acme", "op-review")
    assert box.get_operation("acme", "op-unknown")["effects"][0]["status"] == "outcome_unknown"


def test_a_tombstone_answers_expired_to_a_late_retry(box: Outbox, clock: Clock) -> None:
    effect = create_effect(box)
    update(box.engine, effect, status=S.SUCCEEDED, provider_ref="T-1", finished_at=clock())
    sweeps.ApplyRetention(box.engine, box.settings).run_once(
        clock.advance(box.settings.retention + timedelta(seconds=1))
    )
    with pytest.raises(errors.OperationExpired) as info:
        box.execute("acme", "op-1", "create_support_task", {"subject": "op-1"})
    assert info.value.same_arguments is True
    # Not a fresh task under a fresh key: the tombstone stands until it is forgotten.
    with pytest.raises(errors.OperationExpired):
        box.execute("acme", "op-1", "create_support_task", {"subject": "other"})
