"""PostgreSQL's one-statement claim of first attempts (``ClaimParams.unsettled_adapters``).

The common pass claims the first attempts of adapters whose breaker is closed
among the due rows in one statement that commits alone (one round trip, where
the two steps take four); if other due rows were among them, the two steps
run for those. Same rows, same state, same evidence. These run on the
database's clock, which the fixed-clock claim tests never reach.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import adapters
from outbox import db, schema, settings
from outbox.delivery import store
from outbox.states import AttemptOutcome, EffectStatus, Reason
from tests.dispatcher.support import (
    attempts,
    bulk,
    claim_concurrently,
    row,
    seed,
    terminate_backends,
)

S = EffectStatus
LEASE = timedelta(seconds=60)
HONOURS = adapters.Capabilities(True, True, 2.0)


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    """PostgreSQL only: SQLite takes the two steps, which the other claim tests cover."""
    engine = db.create_engine(settings.load(), url=postgres_url)
    yield engine
    engine.dispose()


class Admission:
    """An ``admit`` that records what it was asked and refuses the named adapters."""

    def __init__(self, refuse: frozenset[str] = frozenset(), *, retries: bool = True) -> None:
        self.refuse = refuse
        self.retries = retries
        self.asked: list[store.Candidate] = []

    def __call__(self, candidate: store.Candidate, now: datetime) -> bool:
        self.asked.append(candidate)
        if candidate.adapter in self.refuse:
            return False
        return candidate.attempts == 0 or self.retries


def claim(
    engine: Engine, admit: Admission, unsettled: frozenset[str] = frozenset(), limit: int = 10
) -> store.Claim:
    params = store.ClaimParams(owner="w1", lease=LEASE, limit=limit, unsettled_adapters=unsettled)
    return store.claim_due(engine, params, admit)


def test_first_attempts_are_claimed_with_their_attempt_rows(engine) -> None:
    ids = seed(engine, 3, now=schema.utcnow() - timedelta(seconds=1))
    admit = Admission()
    got = claim(engine, admit, limit=2)
    assert [c.id for c in got.effects] == ids[:2]
    assert (got.expired, got.skipped) == (0, 0)
    for c in got.effects:
        r = row(engine, c.id)
        assert (r.status, r.reason, r.lease_owner) == (S.IN_FLIGHT, Reason.CLAIMED, "w1")
        assert r.lease_expires_at == c.started_at + LEASE == c.lease_expires_at
        assert (r.fence, r.attempts, c.fence, c.attempt_no) == (1, 1, 1, 1)
        assert (c.effect_key, c.adapter, c.maybe_sent) == (r.effect_key, "helpdesk", False)
        assert c.deadline_at == r.deadline_at and c.payload == r.payload
        (a,) = attempts(engine, c.id)
        assert (a.worker, a.fence, a.attempt_no, a.effect_key) == ("w1", 1, 1, r.effect_key)
        assert a.started_at == c.started_at and a.finished_at is None and a.outcome is None
    # admit still counts every first attempt it let through (the retry budget's window).
    assert [(a.id, a.attempts) for a in admit.asked] == [(ids[0], 0), (ids[1], 0)]
    assert row(engine, ids[2]).status == S.PENDING and not attempts(engine, ids[2])


def test_the_other_due_rows_go_through_admission_in_the_same_transaction(engine) -> None:
    now = schema.utcnow() - timedelta(seconds=1)
    first = seed(engine, 1, now=now, prefix="first")[0]
    retry = seed(engine, 1, now=now, prefix="retry")[0]
    expired = seed(engine, 1, now=now, prefix="late", deadline=timedelta(seconds=-5))[0]
    unsettled = seed(engine, 1, now=now, adapter="crm", prefix="crm")[0]
    refused_retry = seed(engine, 1, now=now, adapter="billing", prefix="bill")[0]
    with db.write(engine) as conn:
        conn.execute(
            sa.update(schema.outbox)
            .where(schema.outbox.c.id.in_([retry, refused_retry]))
            .values(attempts=1, fence=1)
        )
    admit = Admission(refuse=frozenset({"crm", "billing"}))
    got = claim(engine, admit, unsettled=frozenset({"crm"}))
    assert [c.id for c in got.effects] == [first, retry]  # in id order, as the two steps
    assert (got.expired, got.skipped) == (1, 2)
    assert {(a.id, a.attempts) for a in admit.asked} == {
        (first, 0),
        (retry, 1),
        (unsettled, 0),
        (refused_retry, 1),
    }
    r = row(engine, retry)
    assert (r.status, r.fence, r.attempts) == (S.IN_FLIGHT, 2, 2)
    assert [a.attempt_no for a in attempts(engine, retry)] == [2]
    # Past its deadline: settled, never sent, no attempt opened.
    assert row(engine, expired).status in (S.FAILED, S.OUTCOME_UNKNOWN)
    assert not attempts(engine, expired)
    # Refused: left as they were.
    for i in (unsettled, refused_retry):
        assert row(engine, i).status == S.PENDING and not attempts(engine, i)
        assert row(engine, i).lease_owner is None


def test_a_first_attempt_admission_refuses_after_all_goes_back_unsent(engine) -> None:
    """The statement commits before admit() is asked; a refusal then gives the row
    back as it was (pending, due now), its attempt finished ``not_sent``."""
    ids = seed(engine, 2, now=schema.utcnow() - timedelta(seconds=1))
    admit = Admission(refuse=frozenset({"helpdesk"}))
    got = claim(engine, admit)
    assert got.effects == []
    assert got.skipped == 2  # offered again by the two steps, and refused again
    for i in ids:
        r = row(engine, i)
        assert (r.status, r.reason, r.lease_owner, r.maybe_sent) == (
            S.PENDING,
            Reason.NOT_SENT,
            None,
            False,
        )
        (a,) = attempts(engine, i)
        assert (a.outcome, a.late) == (AttemptOutcome.NOT_SENT, False)


def test_a_claim_on_a_terminated_connection_runs_again(engine) -> None:
    ids = seed(engine, 4, now=schema.utcnow() - timedelta(seconds=1))
    assert [c.id for c in claim(engine, Admission(), limit=2).effects] == ids[:2]
    assert terminate_backends(engine) >= 1  # the pooled connection is now dead
    assert [c.id for c in claim(engine, Admission(), limit=2).effects] == ids[2:]
    assert all(len(attempts(engine, i)) == 1 for i in ids)


def test_a_claim_whose_reply_was_lost_comes_back_at_lease_expiry_with_its_key(engine) -> None:
    """The statement committed, then the reply was lost (or the process died): the
    rows stay claimed, sent by nobody, until their lease runs out; the reconciler's
    lease expiry then returns them (honouring adapter) with the key they had."""
    ids = seed(engine, 2, now=schema.utcnow() - timedelta(seconds=1))
    lost = claim(engine, Admission())  # what it returned never reaches anyone
    keys = {c.id: c.effect_key for c in lost.effects}
    assert sorted(keys) == ids
    # Until the lease ends nobody takes them again, and no key is minted.
    assert claim(engine, Admission()).effects == []
    after_lease = schema.utcnow() + LEASE + timedelta(seconds=1)
    settled = store.expire_leases(
        engine,
        capabilities_for=lambda _: HONOURS,
        max_attempts=5,
        now=after_lease,  # the sweep's clock, a lease later ...
        retry_at=lambda _at, _n: schema.utcnow(),  # ... due again on the database's clock
    )
    assert settled == 2
    again = claim(engine, Admission())
    assert {c.id: c.effect_key for c in again.effects} == keys
    for i in ids:
        first_try, second_try = attempts(engine, i)
        assert first_try.outcome is AttemptOutcome.ABANDONED  # it may have been sent
        assert second_try.effect_key == first_try.effect_key and second_try.attempt_no == 2


def test_concurrent_one_statement_claimers_never_share_a_row(engine) -> None:
    ids = seed(engine, 120, now=schema.utcnow() - timedelta(seconds=1))

    def claim_batch(owner: str) -> list[int]:
        params = store.ClaimParams(
            owner=owner, lease=LEASE, limit=7, unsettled_adapters=frozenset()
        )
        return [c.id for c in store.claim_due(engine, params, Admission()).effects]

    assert sorted(claim_concurrently(claim_batch)) == ids  # every row once, none twice
    assert all(len(attempts(engine, i)) == 1 for i in ids)


def test_the_claim_settles_on_one_plan_instead_of_planning_every_pass(postgres_url) -> None:
    """Prepared by the driver, the claim keeps its generic plan instead of being planned
    afresh on every pass under a backlog (a claim of 100 about 9% slower)."""
    engine = db.create_engine(settings.load(), url=postgres_url, pool_size=1, max_overflow=0)
    try:
        # With statistics that know a backlog of thousands, a generic plan's guess
        # for "LIMIT $n" (a tenth of the rows) lost to every custom plan.
        bulk(engine, 2_000, prefix="due", analyse=True)
        claimed = []
        for _ in range(15):  # prepared after 5 runs; PostgreSQL weighs 5 custom plans first
            claimed += claim(engine, Admission(), limit=100).effects
        assert len(claimed) == 1_500  # the statement did its work on every pass
        # The claims' connection (parked for the next one-statement call): its prepared
        # statements.
        plans = db.autocommit(
            engine,
            lambda conn: db.driver_execute(
                conn,
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE %(claim)s",
                {"claim": "%WITH due AS%claimed AS%"},
            ).fetchall(),
        )
        assert len(plans) == 1, plans
        generic, custom = plans[0]
        assert generic >= 3 and custom <= 5, plans
    finally:
        engine.dispose()
