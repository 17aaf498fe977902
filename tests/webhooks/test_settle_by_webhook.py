"""Done when: ambiguous sends at a provider that ignores keys and cannot be looked up
are settled by its signed webhooks, and nothing is ever sent twice."""

from __future__ import annotations

import json
from datetime import timedelta

import httpx
import sqlalchemy as sa

from outbox import db, schema, states
from reconciler import review, sweeps
from tests.webhooks.conftest import ADAPTER, TENANT, MakeStack, Stack

S = states.EffectStatus
COUNT = 20


def _create(stack: Stack, count: int, prefix: str = "op") -> None:
    for i in range(count):
        stack.box.execute(TENANT, f"{prefix}-{i}", "create_support_task", {"subject": f"s{i}"})


def _effects(stack: Stack) -> list[sa.Row]:
    with db.read(stack.box.engine) as conn:
        return list(conn.execute(sa.select(schema.outbox).order_by(schema.outbox.c.id)))


def _events(stack: Stack) -> list[sa.Row]:
    with db.read(stack.box.engine) as conn:
        return list(conn.execute(sa.select(schema.webhook_events)))


def _flush(stack: Stack) -> None:
    assert stack.sender.flush(60), "the provider's webhooks did not drain"


def test_twenty_unknown_outcomes_settle_by_webhook_with_no_resend(
    make_stack: MakeStack, clock
) -> None:
    stack = make_stack(duplicate_rate=0.5, reorder_rate=0.3, bad_signature_rate=0.2, delay_ms=1)
    stack.sender.pause()  # the provider's webhooks are late: first, the outcomes are unknown
    _create(stack, COUNT)
    stack.provider.state.faults.replace(_script(["drop_after_commit"] * COUNT))
    assert stack.dispatcher.run_once(now=clock()) == COUNT
    rows = _effects(stack)
    assert [r.status for r in rows] == [S.OUTCOME_UNKNOWN] * COUNT
    # No lookup: the reconciler sends them to a person.
    registry = stack.registry
    lookups = sweeps.RunLookups(stack.box.engine, registry, stack.box.settings, clock=clock)
    assert lookups.run_once(clock()) == COUNT
    assert len(review.list_items(stack.box.engine, tenant=TENANT)) == COUNT

    stack.sender.resume()  # the webhooks arrive: duplicated, reordered, some badly signed
    _flush(stack)
    rows = _effects(stack)
    tickets = {t.client_reference: t.id for t in stack.tickets()}
    assert [r.status for r in rows] == [S.SUCCEEDED] * COUNT
    for r in rows:
        assert r.settled_by == states.SettleSource.WEBHOOK
        assert r.provider_ref == tickets[r.effect_key]
        assert not r.needs_review
        item = review.show(stack.box.engine, r.id, tenant=TENANT)
        assert [w["disposition"] for w in item["webhooks"]] == ["settled"]
    assert review.list_items(stack.box.engine, tenant=TENANT) == []
    # The provider's ledger: 20 tickets, no duplicate, one request per effect.
    stats = stack.stats()
    assert stats["tickets"] == COUNT
    assert stats["duplicates"] == {} and stats["duplicate_keys"] == {}
    sent = stack.sender.stats()
    assert sent["queued"] == COUNT and sent["failed"] == 0
    assert sent["delivered"] == COUNT + sent["duplicated"]
    assert sent["bad_signatures"] > 0 and sent["duplicated"] > 0 and sent["reordered"] > 0
    assert sent["statuses"].get("401", 0) == sent["bad_signatures"]
    events = _events(stack)
    assert len(events) == COUNT  # duplicates deduplicated, bad signatures never stored
    before = [(r.id, r.status, r.provider_ref, r.fence, r.updated_at) for r in rows]

    # Late: every event once more, and the processes run again: nothing changes.
    assert stack.sender.redeliver() == COUNT
    _flush(stack)
    clock.advance(timedelta(hours=1))
    stack.dispatcher.run_once(now=clock())
    for sweep in sweeps.build(stack.box.engine, registry, stack.box.settings, clock=clock):
        sweep.run_once(clock())
    after = [(r.id, r.status, r.provider_ref, r.fence, r.updated_at) for r in _effects(stack)]
    assert after == before
    assert len(_events(stack)) == COUNT
    assert stack.stats()["tickets"] == COUNT


def _script(outcomes: list[str]):
    from fake_provider import FaultSpec

    return FaultSpec.from_json({"script": outcomes})


def test_a_bad_or_missing_signature_is_401_and_stores_nothing(make_stack: MakeStack, clock) -> None:
    stack = make_stack()
    body = json.dumps({"type": "ticket.created", "data": {"id": "tkt_1"}}).encode()
    stamp = str(int(clock().timestamp()))
    url = f"{stack.api_url}/v1/webhooks/{ADAPTER}"
    cases = [
        {},  # no signature at all
        {"webhook-id": "evt_1", "webhook-timestamp": stamp, "webhook-signature": "v1,AAAA"},
        {  # a real signature of other bytes
            "webhook-id": "evt_1",
            "webhook-timestamp": stamp,
            "webhook-signature": _standard(stack.secret, "evt_1", clock(), b"{}"),
        },
        {  # the right bytes, signed too long ago
            "webhook-id": "evt_1",
            "webhook-timestamp": str(int(clock().timestamp()) - 3600),
            "webhook-signature": _standard(
                stack.secret, "evt_1", clock() - timedelta(hours=1), body
            ),
        },
    ]
    for headers in cases:
        reply = httpx.post(url, content=body, headers=headers)
        assert reply.status_code == 401, reply.text
        assert reply.headers["content-type"] == "application/problem+json"
        assert reply.json()["type"].endswith("invalid-signature")
    assert _events(stack) == []


def _standard(secret: str, msg_id: str, at, body: bytes) -> str:
    import standardwebhooks

    return standardwebhooks.Webhook(secret).sign(msg_id, at, body)


def test_stripe_format_and_secret_rotation(make_stack: MakeStack, clock) -> None:
    stack = make_stack(fmt="stripe")
    # Held until the dispatcher has recorded its replies: an event that overtakes the
    # reply settles the effect itself ("settled"), a race this test is not about.
    stack.sender.pause()
    _create(stack, 2)
    assert stack.dispatcher.run_once(now=clock()) == 2  # delivered normally
    stack.sender.resume()
    _flush(stack)
    events = _events(stack)
    assert sorted(e.disposition for e in events) == ["confirmed", "confirmed"]
    # Rotation: an event signed by the previous secret still verifies.
    rotated = type(stack.config)(
        format="stripe",
        secrets=("sk_new_secret", stack.secret),
        succeeded_types=stack.config.succeeded_types,
    )
    body = b'{"id":"evt_x","type":"ticket.updated","data":{"id":"tkt_9"}}'
    from adapters.webhooks import stripe_signature

    stamp = str(int(clock().timestamp()))
    headers = {"Stripe-Signature": f"t={stamp},v1={stripe_signature(stack.secret, stamp, body)}"}
    assert rotated.verify(headers, body, clock()) is not None


def test_an_event_before_its_effect_is_kept_and_matched_when_it_appears(
    make_stack: MakeStack, clock
) -> None:
    stack = make_stack(mode="honour", honours=True)
    stack.sender.pause()
    _create(stack, 1)
    (effect,) = _effects(stack)
    body = json.dumps(
        {
            "id": "evt_early",
            "type": "ticket.created",
            "data": {"id": "tkt_early", "client_reference": "obx_not_yet_known"},
        }
    ).encode()
    reply = _post(stack, clock, "evt_early", body)
    assert reply.status_code == 202, reply.text
    assert reply.json()["disposition"] == "unmatched"
    # The effect appears: say the key was ours all along (a replica caught up).
    with db.write(stack.box.engine) as conn:
        conn.execute(sa.update(schema.webhook_events).values(effect_key=effect.effect_key))
    sweep = sweeps.MatchWebhooks(stack.box.engine, stack.box.settings, clock=clock)
    assert sweep.run_once(clock()) == 1
    (row,) = _effects(stack)
    assert (row.status, row.provider_ref, row.settled_by) == (
        S.SUCCEEDED,
        "tkt_early",
        states.SettleSource.WEBHOOK,
    )
    # It was pending and never sent: the dispatcher has nothing left to do.
    assert stack.dispatcher.run_once(now=clock()) == 0
    assert stack.stats()["tickets"] == 0
    assert sweep.run_once(clock()) == 0


def test_a_contradicting_event_on_a_terminal_effect_is_a_conflict_and_reopens_nothing(
    make_stack: MakeStack, clock
) -> None:
    stack = make_stack(mode="honour", honours=True)
    _create(stack, 1)
    stack.dispatcher.run_once(now=clock())
    _flush(stack)
    (effect,) = _effects(stack)
    assert effect.status == S.SUCCEEDED
    body = json.dumps(
        {
            "id": "evt_failed",
            "type": "ticket.failed",
            "data": {"id": effect.provider_ref, "client_reference": effect.effect_key},
        }
    ).encode()
    reply = _post(stack, clock, "evt_failed", body)
    assert reply.status_code == 200
    assert reply.json()["disposition"] == "conflict"
    (after,) = _effects(stack)
    assert (after.status, after.fence, after.updated_at) == (
        effect.status,
        effect.fence,
        effect.updated_at,
    )
    from outbox.settling import webhooks

    (conflict,) = webhooks.conflicts(stack.box.engine, tenant=TENANT)
    assert conflict["effect_id"] == effect.id and conflict["event_id"] == "evt_failed"
    # The same event again: a duplicate, still nothing changes.
    again = _post(stack, clock, "evt_failed", body)
    assert again.json() == {**reply.json(), "duplicate": True}


def test_a_dispatcher_settled_under_loses_its_fence_and_only_records_its_attempt(
    make_stack: MakeStack, clock
) -> None:
    stack = make_stack(mode="honour", honours=True)
    _create(stack, 1)
    from outbox.delivery import store

    claim = store.claim_due(
        stack.box.engine,
        store.ClaimParams(owner="slow", lease=timedelta(minutes=1), limit=1, now=clock()),
    )
    (held,) = claim.effects
    body = json.dumps(
        {
            "id": "evt_fast",
            "type": "ticket.created",
            "data": {"id": "tkt_fast", "client_reference": held.effect_key},
        }
    ).encode()
    assert _post(stack, clock, "evt_fast", body).json()["disposition"] == "settled"
    from outbox.delivery import policy

    recorded = store.finish_attempts(
        stack.box.engine,
        [
            store.Finish(
                held.id,
                held.fence,
                held.attempt_no,
                clock(),
                states.AttemptOutcome.AMBIGUOUS,
                policy.Decision(S.PENDING, states.Reason.AMBIGUOUS_KEYS_HONOURED, True, clock()),
            )
        ],
    )
    assert recorded.late == {held.id}
    (row,) = _effects(stack)
    assert (row.status, row.provider_ref) == (S.SUCCEEDED, "tkt_fast")
    with db.read(stack.box.engine) as conn:
        (attempt,) = conn.execute(sa.select(schema.attempts)).all()
    assert attempt.late and attempt.outcome == states.AttemptOutcome.AMBIGUOUS


def _post(stack: Stack, clock, event_id: str, body: bytes) -> httpx.Response:
    headers = {
        "webhook-id": event_id,
        "webhook-timestamp": str(int(clock().timestamp())),
        "webhook-signature": _standard(stack.secret, event_id, clock(), body),
    }
    return httpx.post(f"{stack.api_url}/v1/webhooks/{ADAPTER}", content=body, headers=headers)
