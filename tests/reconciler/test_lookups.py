"""The lookup sweep: ask the provider about outcome_unknown rows, after the
adapter's settle time, and act on the answer (or hand the row to a person)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from adapters import Capabilities, LookupResult, Registry
from adapters.testing import FakeAdapter
from outbox import Outbox, schema, states
from reconciler import sweeps
from tests.conftest import Clock
from tests.reconciler.conftest import LOOKUP_BACKOFF, LOOKUP_MAX_TRIES
from tests.reconciler.support import (
    ADAPTER,
    IGNORING_NO_LOOKUP,
    IGNORING_WITH_LOOKUP,
    create_effect,
    put_unknown,
    row,
    rows,
)

S = states.EffectStatus
R = states.Reason
SETTLE = timedelta(seconds=IGNORING_WITH_LOOKUP.lookup_settle_seconds)


def lookups_for(box: Outbox, adapter: FakeAdapter, worker: str = "r1") -> sweeps.RunLookups:
    return sweeps.RunLookups(box.engine, Registry([adapter]), box.settings, worker=worker)


@pytest.fixture
def unknown(box: Outbox, clock: Clock) -> int:
    """An effect whose one attempt (at the clock's start) may have been sent."""
    effect = create_effect(box)
    put_unknown(box.engine, effect, at=clock())
    return effect


def test_outcome_unknown_to_succeeded_when_lookup_finds_it(
    box: Outbox, clock: Clock, unknown: int
) -> None:
    adapter = FakeAdapter(ADAPTER, IGNORING_WITH_LOOKUP, lookup_script=[LookupResult.found("T-42")])
    now = clock.advance(SETTLE + timedelta(seconds=1))
    assert lookups_for(box, adapter).run_once(now) == 1
    r = row(box.engine, unknown)
    assert (r.status, r.reason, r.provider_ref, r.finished_at) == (
        S.SUCCEEDED,
        R.LOOKUP_FOUND,
        "T-42",
        now,
    )
    assert adapter.lookups == [(r.effect_key, None)]
    [lookup] = rows(box.engine, schema.lookups, unknown)
    assert (lookup.outcome, lookup.provider_ref, lookup.worker, lookup.at) == (
        "found",
        "T-42",
        "r1",
        now,
    )


def test_outcome_unknown_to_pending_same_key_when_lookup_says_not_found(
    box: Outbox, clock: Clock, unknown: int
) -> None:
    before = row(box.engine, unknown)
    adapter = FakeAdapter(ADAPTER, IGNORING_WITH_LOOKUP)  # unscripted: not_found
    now = clock.advance(SETTLE + timedelta(seconds=1))
    assert lookups_for(box, adapter).run_once(now) == 1
    r = row(box.engine, unknown)
    assert (r.status, r.reason, r.maybe_sent, r.next_attempt_at, r.effect_key) == (
        S.PENDING,
        R.LOOKUP_NOT_FOUND,
        False,  # an authoritative "not found" clears the may-have-been-sent evidence
        now,
        before.effect_key,
    )
    assert r.attempts == before.attempts  # the history stays
    assert [x.outcome for x in rows(box.engine, schema.lookups, unknown)] == ["not_found"]


def test_outcome_unknown_to_failed_when_not_found_past_deadline(
    box: Outbox, clock: Clock, unknown: int
) -> None:
    adapter = FakeAdapter(ADAPTER, IGNORING_WITH_LOOKUP)
    now = clock.advance(timedelta(hours=1))
    assert lookups_for(box, adapter).run_once(now) == 1
    r = row(box.engine, unknown)
    assert (r.status, r.reason, r.finished_at) == (S.FAILED, R.DEADLINE_NOTHING_SENT, now)


def test_no_lookup_before_the_settle_time(box: Outbox, clock: Clock, unknown: int) -> None:
    """A provider that indexes late says "not found" for a ticket it is about to
    show: asking early would resend a ticket that exists."""
    adapter = FakeAdapter(ADAPTER, IGNORING_WITH_LOOKUP)
    sweep = lookups_for(box, adapter)
    # The attempt finished one second after it started: settle counts from then.
    settled = clock() + timedelta(seconds=1) + SETTLE
    assert sweep.run_once(clock.advance(10)) == 0
    assert row(box.engine, unknown).next_lookup_at == settled
    assert sweep.run_once(settled - timedelta(microseconds=1)) == 0
    assert adapter.lookups == []
    assert row(box.engine, unknown).status == S.OUTCOME_UNKNOWN
    assert rows(box.engine, schema.lookups, unknown) == []

    assert sweep.run_once(settled) == 1
    assert len(adapter.lookups) == 1
    assert row(box.engine, unknown).status == S.PENDING


def test_inconclusive_backs_off_then_goes_to_review(
    box: Outbox, clock: Clock, unknown: int
) -> None:
    adapter = FakeAdapter(
        ADAPTER,
        IGNORING_WITH_LOOKUP,
        lookup_script=[LookupResult.inconclusive("503 from lookup")] * LOOKUP_MAX_TRIES,
    )
    sweep = lookups_for(box, adapter)
    now = clock.advance(SETTLE + timedelta(seconds=1))
    for tries in range(1, LOOKUP_MAX_TRIES):
        assert sweep.run_once(now) == 1
        r = row(box.engine, unknown)
        wait = LOOKUP_BACKOFF * 2 ** (tries - 1)
        assert (r.status, r.needs_review, r.lookup_attempts, r.next_lookup_at) == (
            S.OUTCOME_UNKNOWN,
            False,
            tries,
            now + wait,
        )
        assert r.last_error == "503 from lookup"
        # Not again before the backoff has passed.
        assert sweep.run_once(now + wait - timedelta(microseconds=1)) == 0
        assert len(adapter.lookups) == tries
        now = clock.advance(wait)
    assert sweep.run_once(now) == 1
    r = row(box.engine, unknown)
    assert (r.status, r.needs_review, r.reason, r.review_since, r.next_lookup_at) == (
        S.OUTCOME_UNKNOWN,
        True,
        R.REVIEW_LOOKUP_EXHAUSTED,
        now,
        None,
    )
    assert [x.outcome for x in rows(box.engine, schema.lookups, unknown)] == [
        "inconclusive"
    ] * LOOKUP_MAX_TRIES
    # In review, the sweep leaves it alone.
    assert sweep.run_once(clock.advance(86400)) == 0
    assert len(adapter.lookups) == LOOKUP_MAX_TRIES


def test_a_lookup_that_raises_is_recorded_as_an_error_and_retried(
    box: Outbox, clock: Clock, unknown: int
) -> None:
    adapter = FakeAdapter(
        ADAPTER, IGNORING_WITH_LOOKUP, lookup_script=[RuntimeError("adapter bug")]
    )
    sweep = lookups_for(box, adapter)
    now = clock.advance(SETTLE + timedelta(seconds=1))
    assert sweep.run_once(now) == 1
    r = row(box.engine, unknown)
    assert (r.status, r.needs_review, r.next_lookup_at) == (
        S.OUTCOME_UNKNOWN,
        False,
        now + LOOKUP_BACKOFF,
    )
    [lookup] = rows(box.engine, schema.lookups, unknown)
    assert (lookup.outcome, lookup.error) == ("error", "RuntimeError: adapter bug")
    assert sweep.run_once(clock.advance(LOOKUP_BACKOFF)) == 1  # unscripted now: not found
    assert row(box.engine, unknown).status == S.PENDING


def test_outcome_unknown_to_review_when_the_adapter_has_no_lookup(
    box: Outbox, clock: Clock, unknown: int
) -> None:
    adapter = FakeAdapter(ADAPTER, IGNORING_NO_LOOKUP)
    assert lookups_for(box, adapter).run_once(clock.advance(1)) == 1
    r = row(box.engine, unknown)
    assert (r.status, r.needs_review, r.reason, r.review_since) == (
        S.OUTCOME_UNKNOWN,
        True,
        R.REVIEW_NO_LOOKUP,
        clock(),
    )
    assert adapter.lookups == []


def test_an_adapter_this_reconciler_does_not_know_goes_to_review(
    box: Outbox, clock: Clock, unknown: int
) -> None:
    other = FakeAdapter("crm", IGNORING_WITH_LOOKUP)
    assert lookups_for(box, other).run_once(clock.advance(3600)) == 1
    r = row(box.engine, unknown)
    assert (r.needs_review, r.reason) == (True, R.REVIEW_NO_LOOKUP)
    assert "not configured" in r.last_error


def test_a_row_resolved_during_its_lookup_keeps_the_answer_as_evidence_only(
    box: Outbox, clock: Clock, unknown: int
) -> None:
    from reconciler import review

    def operator_acts_first(effect_key: str, reference: str | None) -> LookupResult:
        review.resolve(
            box.engine,
            unknown,
            choice=states.ReviewChoice.NOT_HAPPENED_ABANDON,
            reason="customer cancelled",
            actor="alice",
            action_id="a-1",
            now=clock(),
        )
        return LookupResult.found("T-1")

    adapter = FakeAdapter(ADAPTER, IGNORING_WITH_LOOKUP, lookup_script=[operator_acts_first])
    lookups_for(box, adapter).run_once(clock.advance(SETTLE + timedelta(seconds=1)))
    r = row(box.engine, unknown)
    assert (r.status, r.reason, r.provider_ref) == (S.FAILED, R.OPERATOR_ABANDON, None)
    assert [x.outcome for x in rows(box.engine, schema.lookups, unknown)] == ["found"]


def test_two_reconcilers_never_look_up_the_same_row_twice(box: Outbox, clock: Clock) -> None:
    """Both sweeps run at once over the same due rows; each row is asked about once."""
    effects = [create_effect(box, f"op-{n}") for n in range(12)]
    for effect in effects:
        put_unknown(box.engine, effect, at=clock())
    now = clock.advance(SETTLE + timedelta(seconds=5))
    gate = threading.Barrier(2, timeout=10)
    adapter = FakeAdapter(ADAPTER, IGNORING_WITH_LOOKUP)
    sweeps_ = [lookups_for(box, adapter, worker=f"r{n}") for n in range(2)]
    handled: list[int] = []

    def run(sweep: sweeps.RunLookups) -> None:
        gate.wait()
        handled.append(sweep.run_once(now))

    threads = [threading.Thread(target=run, args=(s,)) for s in sweeps_]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(handled) == len(effects)
    keys = [key for key, _ in adapter.lookups]
    assert len(keys) == len(set(keys)) == len(effects)
    for effect in effects:
        assert len(rows(box.engine, schema.lookups, effect)) == 1
        assert row(box.engine, effect).status == S.PENDING


def test_capabilities_decide_per_adapter(box: Outbox, clock: Clock, unknown: int) -> None:
    """Settle time is the adapter's own: zero means ask at once."""
    quick = Capabilities(honours_idempotency_keys=False, supports_lookup=True)
    adapter = FakeAdapter(ADAPTER, quick, lookup_script=[LookupResult.found("T-9")])
    assert lookups_for(box, adapter).run_once(clock.advance(2)) == 1
    assert row(box.engine, unknown).provider_ref == "T-9"
