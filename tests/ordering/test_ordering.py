"""Done when: effects of one ordering group reach the provider in creation order, even
with retries; an unknown outcome holds back its own group and no other."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

import adapters
from fake_provider import FaultSpec, ProviderConfig, create_app
from outbox import Outbox, db, schema, settings, states, tools
from outbox.delivery import ordering
from outbox.delivery.dispatcher import Dispatcher
from reconciler import review, sweeps
from tests.conftest import Clock
from tests.dispatcher.conftest import TEST_SETTINGS
from tests.dispatcher.support import Provider, provider_on

S = states.EffectStatus
TENANT = "acme"
GROUPS = ("alice", "bob", "carol")


class StepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    customer: str | None = None  # None: an ungrouped effect
    step: int


def _step(ctx: tools.ToolContext, args: StepArgs) -> tools.ToolOutput:
    name = args.customer or "free"
    return tools.ToolOutput(
        receipt={"step": args.step},
        effects=[
            tools.EffectSpec(
                effect="open_ticket",
                adapter="helpdesk",
                payload={"subject": f"{name}-{args.step:03d}", "body": "", "priority": "normal"},
                ordering_key=args.customer,
            )
        ],
    )


STEP = tools.Tool("ticket_step", 1, StepArgs, _step)


@pytest.fixture
def box(db_url: str, clock: Clock) -> Iterator[Outbox]:
    registry = tools.default_registry()
    registry.register(STEP)
    config = settings.load(database_url=db_url, effect_deadline=timedelta(days=1))
    b = Outbox(db_url, config=config, clock=clock, registry=registry)
    b.create_tenant(TENANT)
    yield b
    b.close()


@pytest.fixture
def provider_factory() -> Iterator[Any]:
    contexts: list[Any] = []

    def make(**fields: Any) -> Provider:
        app = create_app(ProviderConfig(seed=3, **fields))
        context = provider_on(app, "asgi")
        contexts.append(context)
        return context.__enter__()

    yield make
    for context in reversed(contexts):
        context.__exit__(None, None, None)


def _dispatcher(box: Outbox, adapter: adapters.Adapter) -> Dispatcher:
    return Dispatcher(
        box.engine,
        adapters.Registry([adapter]),
        settings.load(**{**TEST_SETTINGS, "max_attempts": 50}),
        worker_id="w1",
        rng=random.Random(11),
    )


def _rows(box: Outbox) -> list[Any]:
    with db.read(box.engine) as conn:
        return list(conn.execute(sa.select(schema.outbox).order_by(schema.outbox.c.id)))


def _subjects(provider: Provider, prefix: str) -> list[str]:
    tickets = sorted(provider.app.state.ledger.tickets(), key=lambda t: t.seq)
    return [t.subject for t in tickets if t.subject.startswith(prefix + "-")]


def test_three_groups_of_fifty_arrive_in_creation_order_despite_retries(
    box: Outbox, clock: Clock, provider_factory: Any
) -> None:
    per_group = 50
    for step in range(per_group):  # interleaved: creation order crosses groups
        for customer in GROUPS:
            box.execute(
                TENANT, f"{customer}-{step}", "ticket_step", {"customer": customer, "step": step}
            )
    provider = provider_factory(mode="honour")
    # Retries injected: refusals, lost replies after commit, failures before it.
    provider.app.state.faults.replace(
        FaultSpec.from_json(
            {
                "rates": {
                    "rate_limit": 0.15,
                    "unavailable": 0.1,
                    "fail_before_commit": 0.05,
                    "drop_after_commit": 0.05,
                }
            }
        )
    )
    dispatcher = _dispatcher(box, provider.adapter(honours=True))
    try:
        for _ in range(2000):  # bounded: each pass moves every group by at most one
            if dispatcher.run_once(now=clock()) == 0:
                if all(r.status == S.SUCCEEDED for r in _rows(box)):
                    break
                clock.advance(31)  # past any backoff or Retry-After
        else:
            pytest.fail(f"not all delivered: {[r.status for r in _rows(box)]}")
    finally:
        dispatcher.close()
    rows = _rows(box)
    assert len(rows) == per_group * len(GROUPS)
    assert max(r.attempts for r in rows) > 1  # retries did happen
    assert sum(r.attempts > 1 for r in rows) >= 10
    for customer in GROUPS:
        assert _subjects(provider, customer) == [f"{customer}-{i:03d}" for i in range(per_group)]
    stats = provider.stats()
    assert stats["tickets"] == per_group * len(GROUPS) and stats["duplicates"] == {}
    assert ordering.blocked_groups(box.engine, include_queued=True) == []


def test_an_unknown_outcome_holds_back_its_group_only(
    box: Outbox, clock: Clock, provider_factory: Any
) -> None:
    for step in range(3):
        for customer in GROUPS:
            box.execute(
                TENANT, f"{customer}-{step}", "ticket_step", {"customer": customer, "step": step}
            )
        box.execute(TENANT, f"free-{step}", "ticket_step", {"step": step})
    provider = provider_factory(mode="ignore", lookup_enabled=False)
    # The very first request (alice's first step) commits, and its reply is lost.
    provider.app.state.faults.replace(FaultSpec.from_json({"script": ["drop_after_commit"]}))
    adapter = provider.adapter(honours=False, lookup=False, settle=0.0)
    dispatcher = _dispatcher(box, adapter)
    try:
        for _ in range(10):
            dispatcher.run_once(now=clock())
            clock.advance(1)
        rows = {r.operation_id: r for r in _rows(box)}
        assert rows["alice-0"].status == S.OUTCOME_UNKNOWN
        assert [rows[f"alice-{i}"].status for i in (1, 2)] == [S.PENDING, S.PENDING]
        assert [rows[f"alice-{i}"].attempts for i in (1, 2)] == [0, 0]  # never sent
        for other in ("bob", "carol", "free"):
            assert [rows[f"{other}-{i}"].status for i in range(3)] == [S.SUCCEEDED] * 3
        (blocked,) = ordering.blocked_groups(box.engine, tenant=TENANT)
        assert (blocked["ordering_key"], blocked["waiting"], blocked["blocked_by"]) == (
            "alice",
            2,
            "outcome_unknown",
        )
        assert blocked["head"]["id"] == rows["alice-0"].id
        # No lookup: a person decides; still only alice waits.
        sweeps.RunLookups(
            box.engine, adapters.Registry([adapter]), box.settings, clock=clock
        ).run_once(clock())
        (blocked,) = ordering.blocked_groups(box.engine, tenant=TENANT)
        assert blocked["blocked_by"] == "review"
        ticket = _subjects(provider, "alice")
        assert ticket == ["alice-000"]
        ref = provider.app.state.ledger.tickets()[0].id
        review.resolve(
            box.engine,
            rows["alice-0"].id,
            choice="happened",
            reason="found it at the provider",
            actor="ops",
            action_id="a1",
            provider_ref=ref,
            now=clock(),
        )
        for _ in range(5):
            dispatcher.run_once(now=clock())
            clock.advance(1)
    finally:
        dispatcher.close()
    assert _subjects(provider, "alice") == ["alice-000", "alice-001", "alice-002"]
    assert all(r.status == S.SUCCEEDED for r in _rows(box))
    assert ordering.blocked_groups(box.engine) == []


def test_a_retry_holds_back_its_group_and_a_failure_lets_it_go(
    box: Outbox, clock: Clock, provider_factory: Any
) -> None:
    for step in range(2):
        box.execute(TENANT, f"alice-{step}", "ticket_step", {"customer": "alice", "step": step})
    provider = provider_factory(mode="honour", retry_after_seconds=60)
    provider.app.state.faults.replace(FaultSpec.from_json({"script": ["rate_limit", "reject"]}))
    dispatcher = _dispatcher(box, provider.adapter(honours=True))
    try:
        dispatcher.run_once(now=clock())
        (blocked,) = ordering.blocked_groups(box.engine)
        assert blocked["blocked_by"] == "retry" and blocked["head"]["next_attempt_at"]
        clock.advance(10)
        assert dispatcher.run_once(now=clock()) == 0  # the second waits for the first
        clock.advance(60)
        dispatcher.run_once(now=clock())  # the first is refused for good: failed
        dispatcher.run_once(now=clock())  # so the second goes
    finally:
        dispatcher.close()
    first, second = _rows(box)
    assert (first.status, second.status) == (S.FAILED, S.SUCCEEDED)
