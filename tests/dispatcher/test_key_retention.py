"""Key retention: past the provider's window, a resend with the same key is not safe.

The fake provider forgets keys after ``key_retention_seconds`` (the CLI's
``--key-retention-seconds``); both it and Outbox run on one test clock. Outbox
must never resend past the window: the effect goes to ``outcome_unknown`` and
the reconciler's lookup settles it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy.engine import Engine

import adapters
from adapters import helpdesk
from fake_provider import ProviderConfig, create_app
from outbox import settings
from outbox.delivery import policy, store
from outbox.states import AttemptOutcome, EffectStatus, Reason
from reconciler import sweeps
from tests.conftest import Clock
from tests.dispatcher.support import Provider, attempts, provider_on, row, seed

S = EffectStatus
RETENTION = 60.0


@pytest.fixture
def provider(clock: Clock) -> Iterator[Provider]:
    app = create_app(ProviderConfig(seed=0, key_retention_seconds=RETENTION), clock=clock)
    with provider_on(app, "asgi") as provider:
        yield provider


def retaining_adapter(provider: Provider, retention: float | None = RETENTION) -> adapters.Adapter:
    adapter = helpdesk.helpdesk_adapter(
        provider.base_url,
        transport=provider.transport,
        capabilities=adapters.Capabilities(
            honours_idempotency_keys=True,
            supports_lookup=True,
            lookup_settle_seconds=1.0,
            key_retention_seconds=retention,
        ),
    )
    provider.made.append(adapter)
    return adapter


def test_the_fake_provider_forgets_keys_after_the_window(clock: Clock, provider: Provider) -> None:
    adapter = retaining_adapter(provider)
    request = adapters.DeliveryRequest(1, "k-1", "acme", "op", "open_ticket", {"subject": "s"}, 1)
    first = adapter.deliver(request)
    clock.advance(RETENTION / 2)
    assert adapter.deliver(request).provider_ref == first.provider_ref  # replayed
    clock.advance(RETENTION)
    assert adapter.deliver(request).provider_ref != first.provider_ref  # a second ticket
    assert provider.stats()["tickets"] == 2


def test_outbox_never_resends_past_the_window_and_the_lookup_settles_it(
    engine: Engine, clock: Clock, provider: Provider, make_dispatcher
) -> None:
    adapter = retaining_adapter(provider)
    (effect,) = seed(engine, 1, now=clock(), deadline=timedelta(hours=1))
    # The provider commits the ticket and the reply is lost: ambiguous.
    provider.faults(["drop_after_commit"])
    dispatcher = make_dispatcher(adapter, backoff_initial=120, backoff_max=120)
    assert dispatcher.run_once(now=clock()) == 1
    r = row(engine, effect)
    assert (r.status, r.maybe_sent) == (S.PENDING, True)  # inside the window: same key later
    assert provider.stats()["tickets"] == 1

    # The retry falls due after the provider has forgotten the key.
    clock.advance(RETENTION + 1)
    assert r.next_attempt_at <= clock()
    dispatcher.run_once(now=clock())
    r = row(engine, effect)
    assert (r.status, r.reason, r.needs_review) == (
        S.OUTCOME_UNKNOWN,
        Reason.AMBIGUOUS_NO_KEY_SUPPORT,
        False,
    )
    assert "key retention" in r.last_error
    assert len(provider.transport.requests) == 1  # never sent again
    assert [a.outcome for a in attempts(engine, effect)] == [AttemptOutcome.AMBIGUOUS]
    for _ in range(3):  # and never on a later pass either
        clock.advance(300)
        dispatcher.run_once(now=clock())
    assert len(provider.transport.requests) == 1

    # The reconciler looks it up: the one ticket is found, no second one made.
    registry = adapters.Registry([retaining_adapter(provider)])
    lookups = sweeps.RunLookups(engine, registry, settings.load(), worker="r1", clock=clock)
    assert lookups.run_once(clock()) == 1
    r = row(engine, effect)
    ticket = provider.tickets()[0]
    assert (r.status, r.reason, r.provider_ref) == (S.SUCCEEDED, Reason.LOOKUP_FOUND, ticket["id"])
    assert provider.stats()["tickets"] == 1


def test_without_a_lookup_it_waits_for_a_person(
    engine: Engine, clock: Clock, provider: Provider, make_dispatcher
) -> None:
    adapter = retaining_adapter(provider)
    (effect,) = seed(engine, 1, now=clock(), deadline=timedelta(hours=1))
    provider.faults(["drop_after_commit"])
    dispatcher = make_dispatcher(adapter, backoff_initial=120, backoff_max=120)
    dispatcher.run_once(now=clock())
    clock.advance(RETENTION * 3)
    dispatcher.run_once(now=clock())
    no_lookup = helpdesk.helpdesk_adapter(
        provider.base_url,
        name="helpdesk",
        transport=provider.transport,
        capabilities=adapters.Capabilities(True, False, key_retention_seconds=RETENTION),
        lookup_url=None,
    )
    provider.made.append(no_lookup)
    registry = adapters.Registry([no_lookup])
    sweeps.RunLookups(engine, registry, settings.load(), clock=clock).run_once(clock())
    r = row(engine, effect)
    assert (r.status, r.needs_review, r.reason) == (
        S.OUTCOME_UNKNOWN,
        True,
        Reason.REVIEW_NO_LOOKUP,
    )
    assert len(provider.transport.requests) == 1


def test_inside_the_window_the_same_key_is_resent(
    engine: Engine, clock: Clock, provider: Provider, make_dispatcher
) -> None:
    adapter = retaining_adapter(provider)
    (effect,) = seed(engine, 1, now=clock())
    provider.faults(["drop_after_commit"])
    dispatcher = make_dispatcher(adapter, backoff_initial=1, backoff_max=1)
    dispatcher.run_once(now=clock())
    clock.advance(2)
    dispatcher.run_once(now=clock())
    r = row(engine, effect)
    assert r.status == S.SUCCEEDED
    assert provider.stats()["tickets"] == 1
    assert len({req.headers["Idempotency-Key"] for req in provider.transport.requests}) == 1


def test_an_ambiguous_reply_whose_retry_would_fall_past_the_window(
    engine: Engine, clock: Clock, provider: Provider, make_dispatcher
) -> None:
    adapter = retaining_adapter(provider)
    (effect,) = seed(engine, 1, now=clock(), deadline=timedelta(hours=1))
    provider.faults(["drop_after_commit"])
    # The backoff alone carries the retry past the window: decided at once, not at the claim.
    dispatcher = make_dispatcher(adapter, backoff_initial=600, backoff_max=600)
    dispatcher.run_once(now=clock())
    r = row(engine, effect)  # the dispatcher's rng is seeded: its jitter lands past the window
    assert (r.status, r.maybe_sent) == (S.OUTCOME_UNKNOWN, True)
    assert "key retention" in r.last_error


def test_an_expired_lease_past_the_window_is_not_rescheduled(
    engine: Engine, clock: Clock, provider: Provider
) -> None:
    (effect,) = seed(engine, 1, now=clock())
    claim = store.claim_due(
        engine,
        store.ClaimParams(owner="dead", lease=timedelta(seconds=30), limit=10, now=clock()),
    )
    assert [c.id for c in claim.effects] == [effect]
    caps = adapters.Capabilities(True, True, 1.0, key_retention_seconds=RETENTION)
    # Lease expired inside the window: rescheduled with the same key.
    clock.advance(31)
    assert store.expire_leases(engine, capabilities_for=lambda _: caps, max_attempts=5, now=clock())
    assert row(engine, effect).status == S.PENDING
    # Claimed again, and this worker dies too; now the window has passed.
    store.claim_due(
        engine,
        store.ClaimParams(
            owner="dead-2",
            lease=timedelta(seconds=120),
            limit=10,
            now=clock(),
            key_retention={"helpdesk": RETENTION},
        ),
    )
    clock.advance(121)
    assert store.expire_leases(engine, capabilities_for=lambda _: caps, max_attempts=5, now=clock())
    r = row(engine, effect)
    assert (r.status, r.reason) == (S.OUTCOME_UNKNOWN, Reason.LEASE_EXPIRED)


def test_the_window_has_a_safety_margin() -> None:
    start = Clock()()
    day = policy.key_expires_at(start, 24 * 3600)
    assert day == start + timedelta(hours=24) - policy.KEY_RETENTION_MARGIN_MAX
    short = policy.key_expires_at(start, 60)
    assert short == start + timedelta(seconds=54)
    assert policy.key_expires_at(None, 60) is None
    assert policy.key_expires_at(start, None) is None


def test_policy_reads_the_window() -> None:
    now = Clock()()
    common = {
        "outcome": AttemptOutcome.AMBIGUOUS,
        "may_have_happened": True,
        "honours_keys": True,
        "maybe_sent_before": False,
        "attempts": 1,
        "max_attempts": 5,
        "deadline_at": now + timedelta(hours=2),
    }
    inside = policy.after_attempt(
        **common, retry_at=now + timedelta(seconds=10), key_expires_at=now + timedelta(seconds=60)
    )
    assert inside.status is S.PENDING
    past = policy.after_attempt(
        **common, retry_at=now + timedelta(seconds=61), key_expires_at=now + timedelta(seconds=60)
    )
    assert past.status is S.OUTCOME_UNKNOWN
    # A 429 (nothing happened) may be retried past the window: no earlier send to duplicate.
    fresh = policy.after_attempt(
        **{**common, "outcome": AttemptOutcome.RETRYABLE, "may_have_happened": False},
        retry_at=now + timedelta(seconds=61),
        key_expires_at=now + timedelta(seconds=60),
    )
    assert fresh.status is S.PENDING
    assert policy.before_resend(now=now, maybe_sent=True, key_expires_at=now) is not None
    assert policy.before_resend(now=now, maybe_sent=False, key_expires_at=now) is None
