"""The dispatcher against the fake helpdesk, in-process (ASGI) and over a real socket.

Duplicates are counted from the provider's side (its ledger), and the key of
every request is read off the wire.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from outbox.states import AttemptOutcome, EffectStatus, Reason
from tests.dispatcher.support import attempts, row, rows, seed, statuses

S = EffectStatus


@pytest.mark.parametrize("restart", [False, True], ids=["same", "restart"])
def test_honour_mode_drop_after_commit_ends_with_one_ticket_per_effect(
    engine, clock, make_dispatcher, make_provider, restart
) -> None:
    provider = make_provider(mode="honour")
    ids = seed(engine, 5, now=clock())
    provider.faults(["drop_after_commit"] * 5)
    adapter = provider.adapter(honours=True)
    first = make_dispatcher(adapter, worker_id="first")
    assert first.run_once(now=clock()) == 5
    for effect_id in ids:
        r = row(engine, effect_id)
        assert (r.status, r.reason, r.maybe_sent) == (
            S.PENDING,
            Reason.AMBIGUOUS_KEYS_HONOURED,
            True,
        )
    assert provider.stats()["tickets"] == 5  # the provider acted; we did not hear
    if restart:
        first.close()
        second = make_dispatcher(provider.adapter(honours=True), worker_id="second", seed=99)
    else:
        second = first
    clock.advance(1)
    assert second.run_once(now=clock()) == 5
    stats = provider.stats()
    assert stats["tickets"] == 5 and stats["duplicates"] == {} and stats["duplicate_keys"] == {}
    tickets = {t["idempotency_key"]: t["id"] for t in provider.tickets()}
    keys = provider.keys_sent()
    for effect_id in ids:
        r = row(engine, effect_id)
        assert r.status == S.SUCCEEDED
        assert r.provider_ref == tickets[r.effect_key]  # the replayed reply names the ticket
        assert keys.count(r.effect_key) == 2  # the same key on both attempts
        first_try, second_try = attempts(engine, effect_id)
        assert first_try.outcome == AttemptOutcome.AMBIGUOUS
        assert second_try.outcome == AttemptOutcome.DELIVERED
        if restart:
            assert (first_try.worker, second_try.worker) == ("first", "second")
    assert {b["client_reference"] for b in provider.bodies_sent()} == set(keys)


def test_ignore_mode_drop_after_commit_is_outcome_unknown_with_no_resend(
    engine, clock, make_dispatcher, make_provider
) -> None:
    provider = make_provider(mode="ignore")
    ids = seed(engine, 3, now=clock())
    provider.faults(["drop_after_commit"] * 3)
    dispatcher = make_dispatcher(provider.adapter(honours=False, settle=2.0))
    dispatcher.run_once(now=clock())
    for effect_id in ids:
        r = row(engine, effect_id)
        assert (r.status, r.reason, r.needs_review) == (
            S.OUTCOME_UNKNOWN,
            Reason.AMBIGUOUS_NO_KEY_SUPPORT,
            False,
        )
        assert r.next_lookup_at == clock() + timedelta(seconds=2)
    for _ in range(3):
        clock.advance(600)
        assert dispatcher.run_once(now=clock()) == 0
    assert provider.stats()["tickets"] == 3
    assert len(provider.keys_sent()) == 3  # nothing was sent twice


def test_rate_limit_retry_after_is_respected(engine, clock, make_dispatcher, make_provider) -> None:
    provider = make_provider(mode="honour", retry_after_seconds=7)
    (effect_id,) = seed(engine, 1, now=clock())
    provider.faults(["rate_limit", "unavailable"])
    dispatcher = make_dispatcher(provider.adapter())
    dispatcher.run_once(now=clock())
    r = row(engine, effect_id)
    assert (r.status, r.reason, r.next_attempt_at) == (
        S.PENDING,
        Reason.RETRYABLE,
        clock() + timedelta(seconds=7),
    )
    assert attempts(engine, effect_id)[0].status_code == 429
    clock.advance(6.5)
    assert dispatcher.run_once(now=clock()) == 0  # not before the provider said
    clock.advance(0.5)
    assert dispatcher.run_once(now=clock()) == 1  # 503, Retry-After 7 again
    assert row(engine, effect_id).next_attempt_at == clock() + timedelta(seconds=7)
    clock.advance(7)
    dispatcher.run_once(now=clock())
    assert row(engine, effect_id).status == S.SUCCEEDED
    assert provider.stats()["tickets"] == 1
    assert len(set(provider.keys_sent())) == 1


def test_a_poison_row_fails_on_its_own_while_the_others_deliver(
    engine, clock, make_dispatcher, make_provider
) -> None:
    provider = make_provider(mode="honour")
    good = [{"subject": f"t{i}", "body": "", "priority": "normal"} for i in range(100)]
    # The adapter refuses to overwrite the reserved client_reference: PayloadError.
    poison = {"subject": "p", "body": "", "priority": "normal", "client_reference": "not-mine"}
    ids = seed(engine, 101, now=clock(), payloads=[*good[:50], poison, *good[50:]])
    dispatcher = make_dispatcher(provider.adapter(), max_attempts=2, concurrency=8)
    dispatcher.run_once(now=clock())
    clock.advance(5)
    dispatcher.run_once(now=clock())
    assert statuses(engine) == {"succeeded": 100, "failed": 1}
    bad = row(engine, ids[50])
    assert (bad.reason, bad.maybe_sent) == (Reason.MAX_ATTEMPTS, False)
    assert "client_reference" in bad.last_error
    assert [a.outcome for a in attempts(engine, ids[50])] == [AttemptOutcome.ADAPTER_ERROR] * 2
    assert provider.stats()["tickets"] == 100
    assert len(provider.keys_sent()) == 100  # the poison row never reached the wire
    assert all(r.attempts == 1 for i, r in rows(engine).items() if i != ids[50])
