"""The deadline sweep: a pending row past its deadline fails if nothing may have
reached the provider, else becomes outcome_unknown (never a resend)."""

from __future__ import annotations

import threading
from datetime import timedelta

from outbox import Outbox, states
from reconciler import sweeps
from tests.conftest import Clock
from tests.reconciler.support import create_effect, row, update

S = states.EffectStatus
R = states.Reason


def test_pending_to_failed_past_deadline_when_nothing_was_sent(box: Outbox, clock: Clock) -> None:
    effect = create_effect(box)
    key = row(box.engine, effect).effect_key
    sweep = sweeps.EnforceDeadlines(box.engine, box.settings)

    assert sweep.run_once(clock.advance(timedelta(minutes=15) - timedelta(seconds=1))) == 0
    assert row(box.engine, effect).status == S.PENDING

    now = clock.advance(1)
    assert sweep.run_once(now) == 1
    r = row(box.engine, effect)
    assert (r.status, r.reason, r.finished_at, r.effect_key) == (
        S.FAILED,
        R.DEADLINE_NOTHING_SENT,
        now,
        key,
    )


def test_pending_to_outcome_unknown_past_deadline_when_it_may_have_been_sent(
    box: Outbox, clock: Clock
) -> None:
    effect = create_effect(box)
    update(box.engine, effect, maybe_sent=True)
    now = clock.advance(timedelta(hours=1))
    assert sweeps.EnforceDeadlines(box.engine, box.settings).run_once(now) == 1
    r = row(box.engine, effect)
    assert (r.status, r.reason, r.maybe_sent, r.needs_review, r.finished_at) == (
        S.OUTCOME_UNKNOWN,
        R.DEADLINE_MAY_HAVE_SENT,
        True,
        False,  # the lookup sweep decides between a lookup and a person
        None,
    )


def test_only_pending_rows_are_touched(box: Outbox, clock: Clock) -> None:
    in_flight, unknown = create_effect(box, "op-1"), create_effect(box, "op-2")
    update(box.engine, in_flight, status=S.IN_FLIGHT, lease_owner="w", lease_expires_at=clock())
    update(box.engine, unknown, status=S.OUTCOME_UNKNOWN, maybe_sent=True)
    assert sweeps.EnforceDeadlines(box.engine, box.settings).run_once(clock.advance(86400)) == 0
    assert row(box.engine, in_flight).status == S.IN_FLIGHT
    assert row(box.engine, unknown).status == S.OUTCOME_UNKNOWN


def test_every_due_row_in_one_pass_across_batches(box: Outbox, clock: Clock) -> None:
    effects = [create_effect(box, f"op-{n}") for n in range(5)]
    sweep = sweeps.EnforceDeadlines(box.engine, box.settings, batch=2)
    assert sweep.run_once(clock.advance(86400)) == 5
    assert {row(box.engine, e).status for e in effects} == {S.FAILED}
    assert sweep.run_once(clock()) == 0


def test_two_reconcilers_settle_each_row_once(box: Outbox, clock: Clock) -> None:
    effects = [create_effect(box, f"op-{n}") for n in range(20)]
    now = clock.advance(86400)
    gate = threading.Barrier(2, timeout=10)
    handled: list[int] = []

    def run() -> None:
        sweep = sweeps.EnforceDeadlines(box.engine, box.settings, batch=3)
        gate.wait()
        handled.append(sweep.run_once(now))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(handled) == len(effects)
    assert {row(box.engine, e).status for e in effects} == {S.FAILED}
