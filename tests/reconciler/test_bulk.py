"""Done when: 200 review items resolved by one filtered action, idempotent on its bulk id,
with one audit entry per item."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from outbox import Outbox, db, errors, schema, states
from reconciler import bulk, review
from tests.conftest import Clock
from tests.reconciler.support import TENANT, create_effect, row, update

S = states.EffectStatus
R = states.Reason
COUNT = 200


def _unknown(box: Outbox, clock: Clock, count: int, prefix: str, tenant: str = TENANT, **values):
    ids = [create_effect(box, f"{prefix}-{i}", tenant=tenant) for i in range(count)]
    out = schema.outbox
    with db.write(box.engine) as conn:
        conn.execute(
            sa.update(out)
            .where(out.c.id.in_(ids))
            .values(
                status=S.OUTCOME_UNKNOWN,
                reason=values.get("reason", R.REVIEW_NO_LOOKUP),
                maybe_sent=True,
                needs_review=True,
                review_since=values.get("since", clock()),
                updated_at=clock(),
            )
        )
    return ids


def _count(box: Outbox, table: sa.Table, **where) -> int:
    with db.read(box.engine) as conn:
        query = sa.select(sa.func.count()).select_from(table)
        for name, value in where.items():
            query = query.where(table.c[name] == value)
        return int(conn.execute(query).scalar_one())


def test_two_hundred_items_resolved_by_one_filtered_action(box: Outbox, clock: Clock) -> None:
    old = _unknown(box, clock, COUNT, "old", since=clock() - timedelta(hours=3))
    # Not selected: too recent, another problem, another adapter's, another tenant's.
    recent = _unknown(box, clock, 3, "recent")
    exhausted = _unknown(
        box, clock, 2, "exh", reason=R.REVIEW_LOOKUP_EXHAUSTED, since=clock() - timedelta(hours=3)
    )
    other_tenant = _unknown(box, clock, 2, "g", tenant="globex", since=clock() - timedelta(hours=3))
    where = bulk.Filter(
        TENANT, adapter="helpdesk", problem="review_no_lookup", older_than=timedelta(hours=1)
    )
    kwargs = {
        "action": "resolve",
        "resolution": "happened",
        "reason": "provider outage: all created",
        "actor": "ops",
        "now": clock(),
    }

    dry = bulk.run(box.engine, where, dry_run=True, **kwargs)
    assert (dry.dry_run, dry.selected, dry.applied) == (True, COUNT, 0)
    assert dry.sample == old[:20]
    assert _count(box, schema.bulk_actions) == 0 and _count(box, schema.review_actions) == 0

    done = bulk.run(box.engine, where, bulk_id="outage-1", **kwargs)
    assert (done.selected, done.applied, done.skipped, done.replayed) == (COUNT, COUNT, 0, False)
    for effect_id in old:
        r = row(box.engine, effect_id)
        assert (r.status, r.reason, r.settled_by, r.provider_ref) == (
            S.SUCCEEDED,
            R.OPERATOR_HAPPENED,
            states.SettleSource.OPERATOR,
            "operator-bulk:outage-1",
        )
    for effect_id in recent + exhausted + other_tenant:
        assert row(box.engine, effect_id).status == S.OUTCOME_UNKNOWN
    assert _count(box, schema.bulk_action_items, bulk_id="outage-1") == COUNT
    assert _count(box, schema.review_actions) == COUNT
    audit = bulk.items(box.engine, "outage-1")
    assert {(a["outcome"], a["status_before"], a["status_after"]) for a in audit} == {
        ("applied", "outcome_unknown", "succeeded")
    }
    item = review.show(box.engine, old[0], tenant=TENANT)
    assert item["audit"][0]["action_id"] == f"outage-1:{old[0]}"

    # The same bulk id again, even later and with new matching items: nothing changes.
    more = _unknown(box, clock, 2, "more", since=clock() - timedelta(hours=3))
    clock.advance(60)
    again = bulk.run(box.engine, where, bulk_id="outage-1", **{**kwargs, "now": clock()})
    assert (again.selected, again.applied, again.replayed) == (COUNT, COUNT, True)
    assert _count(box, schema.bulk_action_items) == COUNT
    assert _count(box, schema.review_actions) == COUNT
    assert [row(box.engine, i).status for i in more] == [S.OUTCOME_UNKNOWN] * 2
    # The same id for another action is refused, and changes nothing.
    with pytest.raises(errors.ReviewConflict):
        bulk.run(box.engine, where, bulk_id="outage-1", **{**kwargs, "resolution": "requeue"})
    assert _count(box, schema.bulk_action_items) == COUNT


def test_an_item_that_moved_on_is_skipped_and_an_interrupted_run_resumes(
    box: Outbox, clock: Clock
) -> None:
    ids = _unknown(box, clock, 5, "op")
    where = bulk.Filter(TENANT)
    # First run interrupted after freezing the selection: simulate by freezing, then
    # resolving one item in between (a person, or a lookup, got there first).
    from reconciler.bulk import _freeze

    frozen = {"action": "abandon", "resolution": None, "filter": where.to_json(), "reason": "gone"}
    _freeze(box.engine, "b-2", where, frozen, "ops", clock())
    review.resolve(
        box.engine,
        ids[0],
        choice="happened",
        reason="seen",
        actor="x",
        action_id="single",
        provider_ref="T-1",
        now=clock(),
    )
    result = bulk.run(
        box.engine, where, action="abandon", reason="gone", actor="ops", bulk_id="b-2", now=clock()
    )
    assert (result.selected, result.applied, result.skipped) == (5, 4, 1)
    assert row(box.engine, ids[0]).status == S.SUCCEEDED  # not reopened
    assert [row(box.engine, i).status for i in ids[1:]] == [S.FAILED] * 4
    (skipped,) = [a for a in bulk.items(box.engine, "b-2") if a["outcome"] == "skipped"]
    assert skipped["effect_id"] == ids[0] and "no longer" in skipped["detail"]


def test_retry_lookup_sends_items_back_to_the_lookup_sweep(box: Outbox, clock: Clock) -> None:
    ids = _unknown(box, clock, 3, "op", reason=R.REVIEW_LOOKUP_EXHAUSTED)
    update(box.engine, ids[0], lookup_attempts=3)
    result = bulk.run(
        box.engine,
        bulk.Filter(TENANT, problem="review_lookup_exhausted"),
        action="retry-lookup",
        reason="lookup fixed",
        actor="ops",
        bulk_id="b-3",
        now=clock(),
    )
    assert result.applied == 3
    for effect_id in ids:
        r = row(box.engine, effect_id)
        assert (r.status, r.needs_review, r.lookup_attempts, r.next_lookup_at) == (
            S.OUTCOME_UNKNOWN,
            False,
            0,
            clock(),
        )
    assert review.list_items(box.engine, group="awaiting_review") == []


def test_bad_bulk_requests_change_nothing(box: Outbox, clock: Clock) -> None:
    _unknown(box, clock, 1, "op")
    where = bulk.Filter(TENANT)
    with pytest.raises(errors.InvalidArguments):
        bulk.run(box.engine, where, action="resolve", reason="x", actor="ops", bulk_id="b")
    with pytest.raises(errors.InvalidArguments):
        bulk.run(
            box.engine,
            bulk.Filter(TENANT, problem="nonsense"),
            action="abandon",
            reason="x",
            actor="ops",
            bulk_id="b",
        )
    with pytest.raises(errors.InvalidArguments):
        bulk.run(box.engine, where, action="abandon", reason=" ", actor="ops", bulk_id="b")
    assert _count(box, schema.bulk_actions) == 0
