"""The persistence port of delivery, on SQLite and PostgreSQL: claims, fences, leases."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.engine import Engine

import adapters
from outbox.delivery import policy, store
from outbox.states import AttemptOutcome, EffectStatus, Reason
from tests.conftest import Clock
from tests.dispatcher.support import attempts, claim_concurrently, row, rows, seed

S = EffectStatus
LEASE = timedelta(seconds=60)
HONOURS = adapters.Capabilities(True, True, 2.0)
IGNORES = adapters.Capabilities(False, False, 3.0)


def claim(
    engine: Engine, clock: Clock, owner: str = "w1", limit: int = 10, **kw: Any
) -> store.Claim:
    return store.claim_due(
        engine, store.ClaimParams(owner=owner, lease=LEASE, limit=limit, now=clock(), **kw)
    )


def delivered(c: store.Claimed, at: Any, fence: int | None = None) -> store.Finish:
    return store.Finish(
        c.id,
        c.fence if fence is None else fence,
        c.attempt_no,
        at,
        AttemptOutcome.DELIVERED,
        policy.Decision(S.SUCCEEDED, Reason.DELIVERED, True),
        status_code=201,
        provider_ref=f"T-{c.id}",
        attempt_provider_ref=f"T-{c.id}",
    )


def test_claim_leases_raises_the_fence_and_opens_an_attempt_in_one_go(engine, clock) -> None:
    ids = seed(engine, 3, now=clock())
    got = claim(engine, clock, limit=2)
    assert [c.id for c in got.effects] == ids[:2]
    for c in got.effects:
        r = row(engine, c.id)
        assert (r.status, r.reason, r.lease_owner) == (S.IN_FLIGHT, Reason.CLAIMED, "w1")
        assert r.lease_expires_at == clock() + LEASE
        assert (r.fence, r.attempts, c.fence, c.attempt_no) == (1, 1, 1, 1)
        (a,) = attempts(engine, c.id)
        assert (a.worker, a.fence, a.attempt_no, a.effect_key) == ("w1", 1, 1, r.effect_key)
        assert a.started_at == clock() and a.finished_at is None and a.outcome is None
    assert row(engine, ids[2]).status == S.PENDING


def test_claim_takes_only_due_rows_in_due_order(engine, clock) -> None:
    early, late = (
        seed(engine, 1, now=clock(), prefix="a"),
        seed(engine, 1, now=clock() + timedelta(seconds=5), prefix="b"),
    )
    assert [c.id for c in claim(engine, clock).effects] == early
    clock.advance(5)
    assert [c.id for c in claim(engine, clock).effects] == late
    assert claim(engine, clock).effects == []


def test_a_claimed_row_is_not_claimed_again(engine, clock) -> None:
    seed(engine, 4, now=clock())
    first = claim(engine, clock, owner="w1", limit=3)
    second = claim(engine, clock, owner="w2", limit=3)
    assert len(first.effects) == 3 and len(second.effects) == 1
    assert not {c.id for c in first.effects} & {c.id for c in second.effects}


def test_concurrent_claimers_never_share_a_row(engine, clock) -> None:
    ids = seed(engine, 120, now=clock())

    def claim_batch(owner: str) -> list[int]:
        return [c.id for c in claim(engine, clock, owner=owner, limit=7).effects]

    assert sorted(claim_concurrently(claim_batch)) == ids  # every row once, none twice
    assert all(len(attempts(engine, i)) == 1 for i in ids[:10])


def test_finish_writes_state_only_while_the_fence_holds(engine, clock) -> None:
    seed(engine, 2, now=clock())
    a, b = claim(engine, clock).effects
    clock.advance(1)
    result = store.finish_attempts(engine, [delivered(a, clock()), delivered(b, clock(), fence=99)])
    assert result.recorded == {a.id} and result.late == {b.id}
    ra, rb = row(engine, a.id), row(engine, b.id)
    assert (ra.status, ra.provider_ref, ra.finished_at, ra.lease_owner) == (
        S.SUCCEEDED,
        f"T-{a.id}",
        clock(),
        None,
    )
    assert rb.status == S.IN_FLIGHT  # untouched


def test_a_late_result_lands_on_its_attempt_row_only(engine, clock) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    (old,) = claim(engine, clock, owner="paused").effects
    clock.advance(61)
    assert (
        store.expire_leases(engine, capabilities_for=lambda _: HONOURS, max_attempts=5, now=clock())
        == 1
    )
    (new,) = claim(engine, clock, owner="healthy").effects
    assert new.fence == old.fence + 1 and new.effect_key == old.effect_key
    result = store.finish_attempts(engine, [delivered(old, clock())])
    assert result.late == {effect_id}
    r = row(engine, effect_id)
    assert (r.status, r.lease_owner, r.fence) == (S.IN_FLIGHT, "healthy", new.fence)
    first, second = attempts(engine, effect_id)
    assert (first.worker, first.late, first.outcome, first.provider_ref) == (
        "paused",
        True,
        AttemptOutcome.DELIVERED,
        f"T-{effect_id}",
    )
    assert (second.worker, second.finished_at, second.late) == ("healthy", None, False)
    store.finish_attempts(engine, [delivered(new, clock())])
    assert row(engine, effect_id).status == S.SUCCEEDED
    assert attempts(engine, effect_id)[1].late is False


def test_renewal_extends_only_this_workers_live_leases(engine, clock) -> None:
    seed(engine, 3, now=clock())
    mine = claim(engine, clock, owner="me", limit=2).effects
    theirs = claim(engine, clock, owner="them", limit=1).effects
    clock.advance(20)
    assert store.renew_leases(engine, "me", LEASE, now=clock()) == 2
    for c in mine:
        assert row(engine, c.id).lease_expires_at == clock() + LEASE
    assert row(engine, theirs[0].id).lease_expires_at == clock() - timedelta(seconds=20) + LEASE
    # A lease that already ran out is not revived.
    clock.advance(61)
    assert store.renew_leases(engine, "me", LEASE, now=clock()) == 0


def test_renewal_on_the_database_clock(engine) -> None:
    from outbox import schema

    seed(engine, 1, now=schema.utcnow())
    (c,) = store.claim_due(engine, store.ClaimParams("me", LEASE, 1)).effects
    before = row(engine, c.id).lease_expires_at
    assert before > schema.utcnow() + timedelta(seconds=50)
    assert store.renew_leases(engine, "me", LEASE) == 1
    assert row(engine, c.id).lease_expires_at >= before


@pytest.mark.parametrize(
    ("caps", "status", "reason"),
    [
        (HONOURS, S.PENDING, Reason.LEASE_EXPIRED),
        (IGNORES, S.OUTCOME_UNKNOWN, Reason.LEASE_EXPIRED),
        (None, S.OUTCOME_UNKNOWN, Reason.LEASE_EXPIRED),
    ],
)
def test_expire_leases_applies_policy_and_abandons_the_open_attempt(
    engine, clock, caps, status, reason
) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    (c,) = claim(engine, clock).effects
    clock.advance(59)
    assert (
        store.expire_leases(engine, capabilities_for=lambda _: caps, max_attempts=5, now=clock())
        == 0
    )
    clock.advance(2)
    assert (
        store.expire_leases(engine, capabilities_for=lambda _: caps, max_attempts=5, now=clock())
        == 1
    )
    r = row(engine, effect_id)
    assert (r.status, r.reason, r.maybe_sent, r.lease_owner, r.needs_review) == (
        status,
        reason,
        True,
        None,
        False,
    )
    assert r.effect_key == c.effect_key
    if status is S.PENDING:
        assert r.next_attempt_at == clock() and r.next_lookup_at is None
    else:
        settle = caps.lookup_settle_seconds if caps else 0.0
        assert r.next_lookup_at == clock() + timedelta(seconds=settle)
    (a,) = attempts(engine, effect_id)
    assert (a.outcome, a.finished_at, a.late) == (AttemptOutcome.ABANDONED, clock(), False)


def test_expire_leases_treats_an_unknown_adapter_as_ignoring_keys(engine, clock) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    claim(engine, clock)
    clock.advance(61)

    def unknown(name: str) -> adapters.Capabilities:
        raise adapters.UnknownAdapter(name)

    assert store.expire_leases(engine, capabilities_for=unknown, max_attempts=5, now=clock()) == 1
    assert row(engine, effect_id).status == S.OUTCOME_UNKNOWN


def test_claim_settles_rows_past_their_deadline_without_sending(engine, clock) -> None:
    fresh = seed(engine, 1, now=clock(), prefix="a", deadline=timedelta(minutes=5))
    stale = seed(engine, 1, now=clock(), prefix="b", deadline=timedelta(seconds=1))
    clock.advance(2)
    got = claim(engine, clock)
    assert [c.id for c in got.effects] == fresh and got.expired == 1
    r = row(engine, stale[0])
    assert (r.status, r.reason, r.finished_at, r.attempts) == (
        S.FAILED,
        Reason.DEADLINE_NOTHING_SENT,
        clock(),
        0,
    )
    assert attempts(engine, stale[0]) == []


def test_claim_leaves_paused_adapters_and_spent_retry_budgets_alone(engine, clock) -> None:
    a = seed(engine, 2, now=clock(), adapter="a", prefix="a")
    b = seed(engine, 1, now=clock(), adapter="b", prefix="b")
    assert claim(engine, clock, paused_adapters=frozenset({"a"})).effects[0].id == b[0]
    # Make a[0] a retry (attempts > 0), then spend a's retry budget.
    (c,) = claim(engine, clock, limit=1).effects
    retry = store.Finish(
        c.id,
        c.fence,
        1,
        clock(),
        AttemptOutcome.RETRYABLE,
        policy.Decision(S.PENDING, Reason.RETRYABLE, False, clock()),
    )
    store.finish_attempts(engine, [retry])
    got = claim(engine, clock, no_retry_adapters=frozenset({"a"}))
    assert [x.id for x in got.effects] == [a[1]]


def test_admission_refusal_leaves_the_row_untouched(engine, clock) -> None:
    ids = seed(engine, 3, now=clock())
    got = store.claim_due(
        engine,
        store.ClaimParams("w1", LEASE, 10, now=clock()),
        admit=lambda cand, now: cand.id != ids[1],
    )
    assert [c.id for c in got.effects] == [ids[0], ids[2]] and got.skipped == 1
    r = row(engine, ids[1])
    assert (r.status, r.fence, r.attempts) == (S.PENDING, 0, 0)


def test_release_never_returns_a_possibly_sent_row_as_unsent(engine, clock) -> None:
    ids = seed(engine, 3, now=clock())
    a, b, c = claim(engine, clock).effects
    result = store.release(
        engine,
        [
            store.Release(a, handed_to_adapter=False, honours_keys=False),
            store.Release(b, handed_to_adapter=True, honours_keys=True),
            store.Release(c, handed_to_adapter=True, honours_keys=False, lookup_settle_seconds=4),
        ],
        now=clock(),
        max_attempts=5,
    )
    assert result.recorded == set(ids)
    ra, rb, rc = (row(engine, i) for i in ids)
    assert (ra.status, ra.reason, ra.maybe_sent) == (S.PENDING, Reason.RELEASED, False)
    assert (rb.status, rb.reason, rb.maybe_sent) == (S.PENDING, Reason.LEASE_EXPIRED, True)
    assert (rc.status, rc.maybe_sent) == (S.OUTCOME_UNKNOWN, True)
    assert rc.next_lookup_at == clock() + timedelta(seconds=4)
    outcomes = [attempts(engine, i)[0].outcome for i in ids]
    assert outcomes == [AttemptOutcome.NOT_SENT, AttemptOutcome.ABANDONED, AttemptOutcome.ABANDONED]
    assert all(r.lease_owner is None for r in rows(engine).values())


def test_the_effect_key_never_changes(engine, clock) -> None:
    ids = seed(engine, 1, now=clock())
    key = row(engine, ids[0]).effect_key
    for _ in range(3):
        (c,) = claim(engine, clock).effects
        assert c.effect_key == key
        store.finish_attempts(
            engine,
            [
                store.Finish(
                    c.id,
                    c.fence,
                    c.attempt_no,
                    clock(),
                    AttemptOutcome.NOT_SENT,
                    policy.Decision(S.PENDING, Reason.NOT_SENT, False, clock()),
                )
            ],
        )
    assert {a.effect_key for a in attempts(engine, ids[0])} == {key}


def test_the_driver_level_select_finds_what_the_built_select_finds(db_url: str) -> None:
    """The common claim's select is written twice (a fixed statement for speed,
    the SQLAlchemy one for the other cases): both must pick the same rows."""
    import sqlalchemy as sa

    from outbox import db, schema, settings

    engine = db.create_engine(settings.load(), url=db_url)
    try:
        now = schema.utcnow()
        ids = seed(engine, 8, now=now - timedelta(seconds=30))
        with db.write(engine) as conn:
            out = schema.outbox
            # Not due yet, and not pending: neither select may pick them.
            later = sa.update(out).where(out.c.id.in_(ids[:2]))
            conn.execute(later.values(next_attempt_at=now + timedelta(hours=1)))
            conn.execute(
                sa.update(out)
                .where(out.c.id == ids[2])
                .values(status=S.FAILED, reason=Reason.PERMANENT, finished_at=now)
            )
            # Due in another order than the ids.
            conn.execute(
                sa.update(out)
                .where(out.c.id == ids[7])
                .values(next_attempt_at=now - timedelta(minutes=5))
            )
        params = store.ClaimParams(owner="w1", lease=LEASE, limit=4)
        with db.write(engine) as conn:
            built = [tuple(r)[:5] for r in store._select_due(conn, params)]
        with db.write(engine) as conn:
            direct = [tuple(r)[:5] for r in store._due_direct(conn, params.limit)]
        assert [r[0] for r in built] == [ids[7], ids[3], ids[4], ids[5]]
        assert direct == built
    finally:
        engine.dispose()
