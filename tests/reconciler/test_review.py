"""The review queue: the items, their evidence, and audited, guarded, repeatable actions."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from outbox import Outbox, errors, schema, states
from reconciler import review
from tests.conftest import Clock
from tests.reconciler.support import (
    create_effect,
    put_unknown,
    row,
    rows,
    snapshot,
    update,
)

S = states.EffectStatus
R = states.Reason
C = states.ReviewChoice


@pytest.fixture
def in_review(box: Outbox, clock: Clock) -> int:
    effect = create_effect(box)
    put_unknown(box.engine, effect, at=clock(), needs_review=True, reason=R.REVIEW_NO_LOOKUP)
    return effect


def act(box: Outbox, effect: int, choice: C, **kw: Any) -> review.ActionResult:
    kw.setdefault("reason", "checked the helpdesk by hand")
    kw.setdefault("actor", "alice")
    kw.setdefault("action_id", f"act-{choice}")
    if choice is C.HAPPENED:
        kw.setdefault("provider_ref", "T-100")
    kw.setdefault("now", box.clock())
    return review.resolve(box.engine, effect, choice=choice, **kw)


# --- the queue -------------------------------------------------------------------


def test_list_shows_both_groups_with_filters(box: Outbox, clock: Clock, in_review: int) -> None:
    awaiting_lookup = create_effect(box, "op-2")
    put_unknown(box.engine, awaiting_lookup, at=clock())
    other_tenant = create_effect(box, "op-3", tenant="globex")
    put_unknown(box.engine, other_tenant, at=clock(), needs_review=True)
    create_effect(box, "op-4")  # pending: not in the queue

    items = review.list_items(box.engine)
    assert [(i["id"], i["group"]) for i in items] == [
        (in_review, "awaiting_review"),
        (other_tenant, "awaiting_review"),
        (awaiting_lookup, "awaiting_lookup"),
    ]
    assert [i["id"] for i in review.list_items(box.engine, tenant="acme")] == [
        in_review,
        awaiting_lookup,
    ]
    assert [i["id"] for i in review.list_items(box.engine, group="awaiting_lookup")] == [
        awaiting_lookup
    ]
    assert review.list_items(box.engine, adapter="crm") == []
    first = items[0]
    assert first["effect_key"] == row(box.engine, in_review).effect_key
    assert (first["tenant"], first["operation_id"], first["attempts"]) == ("acme", "op-1", 1)


def test_show_has_all_the_evidence(box: Outbox, clock: Clock, in_review: int) -> None:
    item = review.show(box.engine, in_review)
    assert item["tenant"] == "acme"
    assert item["group"] == "awaiting_review"
    assert item["payload"] == {"subject": "op-1", "body": "", "priority": "normal"}
    assert item["operation"]["tool"] == "create_support_task"
    assert item["task"]["subject"] == "op-1"
    [attempt] = item["attempts_detail"]
    assert attempt["worker"] == "dispatcher-1"
    assert attempt["outcome"] == "ambiguous"
    assert attempt["error"] == "500 Internal Server Error"
    assert attempt["effect_key"] == item["effect_key"]
    assert item["lookups"] == [] and item["audit"] == []

    act(box, in_review, C.NOT_HAPPENED_ABANDON)
    after = review.show(box.engine, in_review)
    assert after["status"] == "failed" and after["group"] is None
    [entry] = after["audit"]
    assert (entry["actor"], entry["status_before"], entry["status_after"]) == (
        "alice",
        "outcome_unknown",
        "failed",
    )


def test_show_is_scoped_to_a_tenant(box: Outbox, in_review: int) -> None:
    with pytest.raises(errors.EffectNotFound):
        review.show(box.engine, in_review, tenant="globex")
    with pytest.raises(errors.EffectNotFound):
        review.show(box.engine, 999_999)


# --- each action -----------------------------------------------------------------


def test_happened_succeeds_with_the_provider_reference(
    box: Outbox, clock: Clock, in_review: int
) -> None:
    key = row(box.engine, in_review).effect_key
    now = clock.advance(60)
    result = act(box, in_review, C.HAPPENED, provider_ref="T-100")
    r = row(box.engine, in_review)
    assert (r.status, r.reason, r.provider_ref, r.finished_at, r.needs_review, r.effect_key) == (
        S.SUCCEEDED,
        R.OPERATOR_HAPPENED,
        "T-100",
        now,
        False,
        key,
    )
    assert (result.status_before, result.status_after, result.replayed) == (
        "outcome_unknown",
        "succeeded",
        False,
    )


def test_happened_needs_a_provider_reference(box: Outbox, in_review: int) -> None:
    before = snapshot(box.engine, in_review)
    with pytest.raises(errors.InvalidArguments) as info:
        act(box, in_review, C.HAPPENED, provider_ref=None)
    assert info.value.errors[0]["field"] == "provider_ref"
    assert snapshot(box.engine, in_review) == before


@pytest.mark.parametrize("reason", ["", "   "])
def test_every_action_needs_a_reason(box: Outbox, in_review: int, reason: str) -> None:
    before = snapshot(box.engine, in_review)
    with pytest.raises(errors.InvalidArguments):
        act(box, in_review, C.NOT_HAPPENED_ABANDON, reason=reason)
    assert snapshot(box.engine, in_review) == before


def test_requeue_keeps_the_key_and_sets_a_new_deadline(
    box: Outbox, clock: Clock, in_review: int
) -> None:
    before = row(box.engine, in_review)
    now = clock.advance(timedelta(hours=2))  # long past the first deadline
    act(box, in_review, C.NOT_HAPPENED_REQUEUE)
    r = row(box.engine, in_review)
    assert (r.status, r.reason, r.effect_key, r.maybe_sent, r.needs_review) == (
        S.PENDING,
        R.OPERATOR_REQUEUE,
        before.effect_key,
        False,
        False,
    )
    assert (r.next_attempt_at, r.deadline_at) == (now, now + box.settings.effect_deadline)
    assert r.attempts == before.attempts == 1  # the history stays
    assert len(rows(box.engine, schema.attempts, in_review)) == 1


def test_abandon_fails_it(box: Outbox, clock: Clock, in_review: int) -> None:
    now = clock.advance(5)
    act(box, in_review, C.NOT_HAPPENED_ABANDON)
    r = row(box.engine, in_review)
    assert (r.status, r.reason, r.finished_at) == (S.FAILED, R.OPERATOR_ABANDON, now)


def test_an_item_still_awaiting_lookup_can_be_resolved(box: Outbox, clock: Clock) -> None:
    effect = create_effect(box)
    put_unknown(box.engine, effect, at=clock())
    act(box, effect, C.HAPPENED)
    assert row(box.engine, effect).status == S.SUCCEEDED


# --- the audit trail --------------------------------------------------------------


@pytest.mark.parametrize("choice", list(C))
def test_every_action_is_in_the_audit_trail(
    box: Outbox, clock: Clock, in_review: int, choice: C
) -> None:
    now = clock.advance(30)
    result = act(box, in_review, choice, actor="bob", action_id="a-1", reason="phoned them")
    [audit] = rows(box.engine, schema.review_actions, in_review)
    expected_after = {
        C.HAPPENED: "succeeded",
        C.NOT_HAPPENED_REQUEUE: "pending",
        C.NOT_HAPPENED_ABANDON: "failed",
    }[choice]
    assert (
        audit.action_id,
        audit.actor,
        audit.at,
        audit.choice,
        audit.reason,
        audit.provider_ref,
        audit.status_before,
        audit.status_after,
    ) == (
        "a-1",
        "bob",
        now,
        choice.value,
        "phoned them",
        "T-100" if choice is C.HAPPENED else None,
        "outcome_unknown",
        expected_after,
    )
    assert result.to_dict() == review.show(box.engine, in_review)["audit"][0]


# --- guarded, repeatable ------------------------------------------------------------


def test_a_stale_action_is_a_conflict_and_changes_nothing(
    box: Outbox, clock: Clock, in_review: int
) -> None:
    act(box, in_review, C.HAPPENED, action_id="alice-1", actor="alice")
    before = snapshot(box.engine, in_review)
    clock.advance(10)
    with pytest.raises(errors.ReviewConflict) as info:
        act(box, in_review, C.NOT_HAPPENED_REQUEUE, action_id="bob-1", actor="bob")
    assert (info.value.status, info.value.expected, info.value.actual) == (
        409,
        "outcome_unknown",
        "succeeded",
    )
    assert snapshot(box.engine, in_review) == before


def test_an_action_on_an_effect_that_moved_on_is_a_conflict(
    box: Outbox, clock: Clock, in_review: int
) -> None:
    """The operator looked after one attempt; a lookup and a resend happened since."""
    update(box.engine, in_review, attempts=2)
    before = snapshot(box.engine, in_review)
    with pytest.raises(errors.ReviewConflict):
        act(box, in_review, C.NOT_HAPPENED_REQUEUE, expected_attempts=1)
    assert snapshot(box.engine, in_review) == before
    act(box, in_review, C.NOT_HAPPENED_REQUEUE, expected_attempts=2)


def test_pending_effects_cannot_be_resolved(box: Outbox) -> None:
    effect = create_effect(box)
    before = snapshot(box.engine, effect)
    with pytest.raises(errors.ReviewConflict) as info:
        act(box, effect, C.NOT_HAPPENED_ABANDON)
    assert info.value.actual == "pending"
    assert snapshot(box.engine, effect) == before


def test_repeating_an_action_returns_the_recorded_result(
    box: Outbox, clock: Clock, in_review: int
) -> None:
    first = act(box, in_review, C.NOT_HAPPENED_REQUEUE, action_id="a-1")
    after = snapshot(box.engine, in_review)
    clock.advance(60)
    again = act(box, in_review, C.NOT_HAPPENED_REQUEUE, action_id="a-1")
    assert again.replayed and not first.replayed
    assert again.to_dict() | {"replayed": False} == first.to_dict()
    assert snapshot(box.engine, in_review) == after


def test_reusing_an_action_id_for_another_action_is_a_conflict(box: Outbox, in_review: int) -> None:
    act(box, in_review, C.NOT_HAPPENED_REQUEUE, action_id="a-1")
    after = snapshot(box.engine, in_review)
    with pytest.raises(errors.ReviewConflict):
        act(box, in_review, C.NOT_HAPPENED_ABANDON, action_id="a-1")
    with pytest.raises(errors.ReviewConflict):
        act(box, in_review, C.NOT_HAPPENED_REQUEUE, action_id="a-1", reason="other words")
    assert snapshot(box.engine, in_review) == after


def test_two_operators_at_once_one_wins(box: Outbox, clock: Clock, in_review: int) -> None:
    gate = threading.Barrier(2, timeout=10)
    outcomes: list[object] = []

    def operator(name: str, choice: C) -> None:
        gate.wait()
        try:
            outcomes.append(act(box, in_review, choice, actor=name, action_id=name))
        except errors.ReviewConflict as exc:
            outcomes.append(exc)

    threads = [
        threading.Thread(target=operator, args=("alice", C.HAPPENED)),
        threading.Thread(target=operator, args=("bob", C.NOT_HAPPENED_REQUEUE)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [o for o in outcomes if isinstance(o, review.ActionResult)]
    lost = [o for o in outcomes if isinstance(o, errors.ReviewConflict)]
    assert len(won) == len(lost) == 1
    [audit] = rows(box.engine, schema.review_actions, in_review)
    assert audit.actor == won[0].actor
    assert row(box.engine, in_review).status == won[0].status_after


def test_the_same_action_sent_twice_at_once_is_recorded_once(box: Outbox, in_review: int) -> None:
    gate = threading.Barrier(2, timeout=10)
    results: list[review.ActionResult] = []

    def send() -> None:
        gate.wait()
        results.append(act(box, in_review, C.HAPPENED, action_id="same"))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r.replayed for r in results) == [False, True]
    assert len(rows(box.engine, schema.review_actions, in_review)) == 1
