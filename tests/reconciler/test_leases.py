"""The lease-expiry sweep: a row whose worker died is decided as the dispatcher
would have decided it, with the same key, and never resent blind at a provider
that ignores keys."""

from __future__ import annotations

import threading
from datetime import timedelta

from adapters import Capabilities, Registry
from adapters.testing import FakeAdapter
from outbox import Outbox, schema, states
from outbox.delivery import store
from reconciler import sweeps
from tests.conftest import Clock
from tests.reconciler.support import ADAPTER, IGNORING_WITH_LOOKUP, create_effect, row, rows

S = states.EffectStatus
R = states.Reason
LEASE = timedelta(seconds=60)
HONOURING = Capabilities(honours_idempotency_keys=True, supports_lookup=True)


def claim(box: Outbox, clock: Clock, owner: str = "dispatcher-1") -> list[store.Claimed]:
    return store.claim_due(
        box.engine, store.ClaimParams(owner=owner, lease=LEASE, limit=100, now=clock())
    ).effects


def expire(box: Outbox, caps: Capabilities, worker: str = "r1") -> sweeps.ExpireLeases:
    return sweeps.ExpireLeases(
        box.engine, Registry([FakeAdapter(ADAPTER, caps)]), box.settings, worker=worker
    )


def test_in_flight_to_pending_same_key_when_the_provider_honours_keys(
    box: Outbox, clock: Clock
) -> None:
    effect = create_effect(box)
    key = row(box.engine, effect).effect_key
    [claimed] = claim(box, clock)
    sweep = expire(box, HONOURING)
    assert sweep.run_once(clock.advance(LEASE - timedelta(seconds=1))) == 0
    assert row(box.engine, effect).status == S.IN_FLIGHT

    now = clock.advance(2)
    assert sweep.run_once(now) == 1
    r = row(box.engine, effect)
    assert (r.status, r.reason, r.effect_key, r.maybe_sent, r.lease_owner, r.fence) == (
        S.PENDING,
        R.LEASE_EXPIRED,
        key,
        True,
        None,
        claimed.fence,
    )
    [attempt] = rows(box.engine, schema.attempts, effect)
    assert (attempt.outcome, attempt.finished_at, attempt.effect_key) == (
        "abandoned",
        now,
        key,
    )


def test_in_flight_to_outcome_unknown_when_the_provider_ignores_keys(
    box: Outbox, clock: Clock
) -> None:
    effect = create_effect(box)
    claim(box, clock)
    now = clock.advance(LEASE + timedelta(seconds=1))
    assert expire(box, IGNORING_WITH_LOOKUP).run_once(now) == 1
    r = row(box.engine, effect)
    assert (r.status, r.reason, r.maybe_sent, r.needs_review) == (
        S.OUTCOME_UNKNOWN,
        R.LEASE_EXPIRED,
        True,
        False,
    )
    # The first lookup waits for the adapter's settle time.
    assert r.next_lookup_at == now + timedelta(seconds=IGNORING_WITH_LOOKUP.lookup_settle_seconds)


def test_an_adapter_nobody_configured_is_treated_as_ignoring_keys(
    box: Outbox, clock: Clock
) -> None:
    effect = create_effect(box)
    claim(box, clock)
    sweep = sweeps.ExpireLeases(box.engine, Registry(), box.settings)
    assert sweep.run_once(clock.advance(LEASE + timedelta(seconds=1))) == 1
    assert row(box.engine, effect).status == S.OUTCOME_UNKNOWN


def test_two_reconcilers_expire_each_lease_once(box: Outbox, clock: Clock) -> None:
    effects = [create_effect(box, f"op-{n}") for n in range(20)]
    claim(box, clock)
    now = clock.advance(LEASE + timedelta(seconds=1))
    gate = threading.Barrier(2, timeout=10)
    handled: list[int] = []

    def run(worker: str) -> None:
        sweep = expire(box, HONOURING, worker)
        sweep.batch = 3  # many small rounds, so the two interleave
        gate.wait()
        handled.append(sweep.run_once(now))

    threads = [threading.Thread(target=run, args=(f"r{n}",)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(handled) == len(effects)
    for effect in effects:
        assert row(box.engine, effect).status == S.PENDING
        [attempt] = rows(box.engine, schema.attempts, effect)
        assert attempt.outcome == "abandoned"
