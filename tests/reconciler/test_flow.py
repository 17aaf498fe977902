"""The whole path over real HTTP: dispatcher, reconciler and an operator against the
bundled fake provider (ignoring idempotency keys, the hard case), on one test clock
shared with the provider so its lookup lag is moved, not slept through."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import httpx

from adapters import Capabilities, Registry
from adapters.helpdesk import helpdesk_adapter
from fake_provider.app import create_app
from fake_provider.config import Mode, ProviderConfig
from fake_provider.faults import FaultSpec, Outcome
from outbox import Outbox, states
from outbox.delivery.dispatcher import Dispatcher
from reconciler import review, sweeps
from tests.conftest import Clock
from tests.reconciler.support import ADAPTER, create_effect, row
from tests.support.servers import serve_in_thread

S = states.EffectStatus
LAG = timedelta(seconds=20)
SETTLE = timedelta(seconds=30)  # longer than the provider's lag, as it must be


@contextmanager
def provider(clock: Clock, **config: Any) -> Iterator[str]:
    app = create_app(ProviderConfig(mode=Mode.IGNORE, seed=7, **config), clock=clock)
    try:
        with serve_in_thread(app) as base_url:
            yield base_url
    finally:
        app.state.ledger.close()


def registry(base_url: str, caps: Capabilities) -> Registry:
    return Registry([helpdesk_adapter(base_url, name=ADAPTER, capabilities=caps)])


def tickets(base_url: str) -> list[dict[str, Any]]:
    effects: list[dict[str, Any]] = httpx.get(f"{base_url}/_admin/effects").json()["effects"]
    return effects


def test_a_lost_reply_is_found_by_lookup_after_the_lag_never_resent(
    box: Outbox, clock: Clock
) -> None:
    caps = Capabilities(
        honours_idempotency_keys=False,
        supports_lookup=True,
        lookup_settle_seconds=SETTLE.total_seconds(),
    )
    # The ticket is committed, then the reply is a 500: ambiguous.
    faults = FaultSpec(script=(Outcome.FAIL_AFTER_COMMIT,))
    with (
        provider(clock, faults=faults, lookup_lag_ms=int(LAG.total_seconds() * 1000)) as url,
        registry(url, caps) as adapters_,
    ):
        effect = create_effect(box)
        key = row(box.engine, effect).effect_key
        dispatcher = Dispatcher(box.engine, adapters_, box.settings, worker_id="d1")
        try:
            assert dispatcher.run_once(clock()) == 1
            assert row(box.engine, effect).status == S.OUTCOME_UNKNOWN
            lookups = sweeps.RunLookups(box.engine, adapters_, box.settings, worker="r1")

            # Inside the lag the provider would say "not found" for a ticket it has...
            clock.advance(10)
            assert adapters_.get(ADAPTER).lookup(key, None).status.value == "not_found"
            # ...so the reconciler does not ask yet, and nothing is resent.
            assert lookups.run_once(clock()) == 0
            assert dispatcher.run_once(clock.advance(1)) == 0
            assert row(box.engine, effect).status == S.OUTCOME_UNKNOWN

            clock.advance(SETTLE)
            assert lookups.run_once(clock()) == 1
            r = row(box.engine, effect)
            [ticket] = tickets(url)
            assert (r.status, r.provider_ref, r.effect_key) == (S.SUCCEEDED, ticket["id"], key)
            assert ticket["idempotency_key"] == key
            assert dispatcher.run_once(clock.advance(60)) == 0
            assert len(tickets(url)) == 1
        finally:
            dispatcher.close()


def test_requeue_delivers_with_the_same_key(box: Outbox, clock: Clock) -> None:
    caps = Capabilities(honours_idempotency_keys=False, supports_lookup=False)
    # A 500 before anything was stored: from our side, indistinguishable from a lost reply.
    faults = FaultSpec(script=(Outcome.FAIL_BEFORE_COMMIT,))
    with provider(clock, faults=faults, lookup_enabled=False) as url, registry(url, caps) as reg:
        effect = create_effect(box)
        key = row(box.engine, effect).effect_key
        dispatcher = Dispatcher(box.engine, reg, box.settings, worker_id="d1")
        try:
            dispatcher.run_once(clock())
            assert sweeps.RunLookups(box.engine, reg, box.settings).run_once(clock()) == 1
            r = row(box.engine, effect)
            assert (r.status, r.needs_review) == (S.OUTCOME_UNKNOWN, True)
            assert dispatcher.run_once(clock.advance(60)) == 0  # never resent on its own
            assert tickets(url) == []

            # A person checked the helpdesk: no such ticket. Deliver it again.
            review.resolve(
                box.engine,
                effect,
                choice=states.ReviewChoice.NOT_HAPPENED_REQUEUE,
                reason="no ticket with this reference in the helpdesk",
                actor="alice",
                action_id="a-1",
                now=clock(),
                effect_deadline=box.settings.effect_deadline,
            )
            assert dispatcher.run_once(clock.advance(1)) == 1
            r = row(box.engine, effect)
            [ticket] = tickets(url)
            assert (r.status, r.provider_ref, r.effect_key, r.attempts) == (
                S.SUCCEEDED,
                ticket["id"],
                key,
                2,
            )
            assert ticket["idempotency_key"] == ticket["client_reference"] == key
        finally:
            dispatcher.close()
