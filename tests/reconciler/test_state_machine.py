"""The effect state machine as a whole, driven at random through the real code.

Hypothesis draws sequences of: create, a dispatcher pass with one delivery
outcome, a worker that claims and dies (its request reaching the provider or
not), time passing, a reconciler pass (lease expiry, deadlines, lookups that
are truthful, inconclusive or raise), and operator actions on the review queue
(fresh or stale). The provider is a model: it counts tickets per key,
deduplicating only when it honours keys, and its lookups see a ticket only
``LAG`` after it was created (shorter than the adapter's settle time).

After every step:

- every row is in a state of DESIGN.md (and the database's CHECKs held, or the
  step would have raised);
- it moved only along a drawn edge (a dispatcher pass may pass through
  ``in_flight`` within one step);
- its key is the one it was created with, on the row, on every attempt and in
  every request the provider received;
- at a provider that ignores keys, no request for an effect is sent after an
  ambiguous attempt (a 500, a timeout, a crash mid-send) unless a lookup said
  "not found" or an operator said "did not happen" since;
- the record agrees with the provider: "failed" means it holds nothing for the
  key, "succeeded" names the ticket it holds;
- so, with truthful lookups and operators, no provider ever holds two tickets
  for one effect.

One run per provider kind (honours keys or not, lookup or not), each of
``EXAMPLES`` derandomised examples: the same sequences every time, about ten
seconds in all. SQLite only: each example copies a migrated database file; the
PostgreSQL paths of the same code are covered by the example tests beside this.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import shutil
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from adapters import (
    Capabilities,
    DeliveryRequest,
    DeliveryResult,
    LookupResult,
    PayloadError,
    Registry,
)
from adapters.testing import FakeAdapter
from outbox import Outbox, db, errors, schema, states, tools
from outbox import settings as outbox_settings
from outbox.delivery import store
from outbox.delivery.dispatcher import Dispatcher
from reconciler import review, sweeps
from tests.conftest import Clock
from tests.reconciler.support import ADAPTER, TENANT

S = states.EffectStatus
T = states.TRANSITIONS
LEASE = timedelta(seconds=60)
SETTLE_SECONDS = 30.0
LAG = timedelta(seconds=20)  # the provider's lookup lag: shorter than the settle time
EXAMPLES = 25
STEPS = 30
MAX_EFFECTS = 3
# Time passes before a step: not at all, past a retry, the settle time, a lease, the deadline.
LATER = st.sampled_from([31, 0, 61, 1, 600, 3600])

# Hypothesis leans towards the first elements of a list: the interesting ones go first.
DELIVERIES = (
    "ambiguous_happened",  # the provider acted, then the reply was lost
    "ambiguous_nothing",  # a timeout before the provider acted: we cannot tell
    "delivered",
    "adapter_bug",  # an exception outside the protocol: may have been sent
    "not_sent",
    "retryable",
    "permanent",
    "payload_error",  # refused before sending
)
MAY_HAVE_SENT = {"ambiguous_happened", "ambiguous_nothing", "adapter_bug"}
PROVIDER_ACTS = {"delivered", "ambiguous_happened"}
# The bundled tool, asking for an operator's approval: its effect is created held.
HELD_TOOL = dataclasses.replace(tools.SUPPORT_TASK, name="approve_first", requires_approval=True)
SUCCEEDED_REASONS = {
    states.Reason.DELIVERED,
    states.Reason.LOOKUP_FOUND,
    states.Reason.OPERATOR_HAPPENED,
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("machine") / "template.db"
    engine = db.create_engine(outbox_settings.load(), url=f"sqlite:///{path}")
    db.upgrade(engine)
    engine.dispose()
    return path


class EffectMachine(RuleBasedStateMachine):
    # Set per run on a subclass: the migrated database to copy, the provider's promises.
    template: ClassVar[Path]
    caps: ClassVar[Capabilities]

    def __init__(self) -> None:
        super().__init__()
        caps = self.caps
        self.path = self.template.with_name(f"run-{uuid.uuid4().hex}.db")
        shutil.copy(self.template, self.path)
        self.clock = Clock()
        self.config = outbox_settings.load(
            sqlite_synchronous="NORMAL",
            concurrency=1,
            max_attempts=4,
            lease_duration=LEASE,
            lease_renew_interval=timedelta(seconds=20),
            lookup_max_tries=2,
            lookup_backoff=timedelta(seconds=10),
            effect_deadline=timedelta(minutes=15),
            # The breaker and the retry budget are the dispatcher's to test; here
            # they would only hold deliveries back and hide the interesting paths.
            breaker_failure_threshold=1_000_000,
            retry_budget_min_per_window=1_000_000,
        )
        engine = db.create_engine(self.config, url=f"sqlite:///{self.path}")
        registry = tools.default_registry()
        registry.register(HELD_TOOL)
        self.box = Outbox(
            engine=engine,
            config=self.config,
            clock=self.clock,
            registry=registry,
            check_schema=False,
        )
        self.box.create_tenant(TENANT)
        self.ops = itertools.count()
        self.actions = itertools.count()
        # The model of the world outside.
        self.keys: dict[int, str] = {}  # effect id -> the key it was created with
        self.status: dict[int, S] = {}  # as last observed
        self.reviewed: set[int] = set()  # effects that have been in the review queue
        self.tickets: Counter[str] = Counter()  # tickets at the provider, per key
        self.refs: dict[str, str] = {}
        self.created_at: dict[str, datetime] = {}
        self.blocked: set[str] = set()  # keys that must not be sent (ignoring provider)
        self.violations: list[str] = []
        self.approval_ops: dict[str, int] = {}  # operation id -> its (one) effect
        self.unsendable: set[str] = set()  # keys held or rejected: never to be sent
        self.delivery = "delivered"
        self.lookup_mode = "truthful"
        self.lock = threading.Lock()
        many = 100_000  # the script never runs out: every call asks the model
        self.adapter = FakeAdapter(
            ADAPTER, caps, script=[self._deliver] * many, lookup_script=[self._lookup] * many
        )
        self.registry = Registry([self.adapter])
        engine, reg, cfg = self.box.engine, self.registry, self.config
        self.dispatcher = Dispatcher(engine, reg, cfg, worker_id="d1", rng=random.Random(0))
        self.expire = sweeps.ExpireLeases(engine, reg, cfg, worker="r1")
        self.deadlines = sweeps.EnforceDeadlines(engine, cfg, worker="r1")
        self.lookups = sweeps.RunLookups(engine, reg, cfg, worker="r1")

    # --- the provider model (called from the dispatcher's delivery thread) ---------

    def _act_at_provider(self, key: str) -> str:
        if self.caps.honours_idempotency_keys and self.tickets[key]:
            return self.refs[key]
        self.tickets[key] += 1
        self.refs.setdefault(key, f"T-{key[-6:]}-{self.tickets[key]}")
        self.created_at.setdefault(key, self.clock())
        return self.refs[key]

    def _deliver(self, request: DeliveryRequest) -> DeliveryResult:
        key, outcome = request.effect_key, self.delivery
        with self.lock:
            if key in self.unsendable:
                self.violations.append(f"sent {key}, which is held or was rejected")
            if key in self.blocked:
                self.violations.append(f"sent {key} again after an ambiguous attempt")
            if outcome == "payload_error":
                raise PayloadError("bad field", adapter=ADAPTER, effect_key=key)
            if outcome == "adapter_bug":
                self._may_have_sent(key)
                raise RuntimeError("adapter bug after the request left")
            if outcome in PROVIDER_ACTS:
                ref = self._act_at_provider(key)
            if outcome in MAY_HAVE_SENT:
                self._may_have_sent(key)
        return {
            "delivered": lambda: DeliveryResult.delivered(ref, status_code=201),
            "not_sent": lambda: DeliveryResult.not_sent("connection refused"),
            "retryable": lambda: DeliveryResult.retryable(5.0, status_code=503),
            "permanent": lambda: DeliveryResult.permanent("bad subject", status_code=400),
            "ambiguous_happened": lambda: DeliveryResult.ambiguous("500", status_code=500),
            "ambiguous_nothing": lambda: DeliveryResult.ambiguous("read timeout"),
        }[outcome]()

    def _may_have_sent(self, key: str) -> None:
        if not self.caps.honours_idempotency_keys:
            self.blocked.add(key)

    def _lookup(self, key: str, reference: str | None) -> LookupResult:
        with self.lock:
            if self.lookup_mode == "raises":
                raise RuntimeError("lookup bug")
            if self.lookup_mode == "inconclusive":
                return LookupResult.inconclusive("503 from the lookup endpoint")
            # The provider indexes late: a ticket is invisible to lookups for LAG.
            if self.tickets[key] and self.clock() >= self.created_at[key] + LAG:
                return LookupResult.found(self.refs[key])
            # An authoritative "not found" is the one answer that allows a resend.
            self.blocked.discard(key)
            return LookupResult.not_found()

    def teardown(self) -> None:
        self.dispatcher.close()
        self.box.close()
        self.path.unlink(missing_ok=True)
        for suffix in ("-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    # --- rules -----------------------------------------------------------------------

    @precondition(lambda self: len(self.keys) < MAX_EFFECTS)
    @rule()
    def create(self) -> None:
        op = f"op-{next(self.ops)}"
        self.box.execute(TENANT, op, "create_support_task", {"subject": op})
        out = schema.outbox
        with db.read(self.box.engine) as conn:
            r = conn.execute(
                sa.select(out.c.id, out.c.effect_key).where(out.c.operation_id == op)
            ).one()
        self.keys[r.id] = r.effect_key
        self.status[r.id] = S.PENDING

    @precondition(lambda self: len(self.keys) < MAX_EFFECTS)
    @rule()
    def create_held(self) -> None:
        """A call to a tool that requires approval: its effect is held."""
        op = f"op-{next(self.ops)}"
        self.box.execute(TENANT, op, HELD_TOOL.name, {"subject": op})
        out = schema.outbox
        with db.read(self.box.engine) as conn:
            r = conn.execute(
                sa.select(out.c.id, out.c.effect_key).where(out.c.operation_id == op)
            ).one()
        self.keys[r.id] = r.effect_key
        self.status[r.id] = S.HELD
        self.approval_ops[op] = r.id
        with self.lock:
            self.unsendable.add(r.effect_key)

    @precondition(lambda self: self.approval_ops)
    @rule(data=st.data(), decision=st.sampled_from(list(states.ApprovalDecision)))
    def operator_decides(self, data: st.DataObject, decision: states.ApprovalDecision) -> None:
        """An operator approves or rejects: fresh, repeated, or the other way (a conflict)."""
        op = data.draw(st.sampled_from(sorted(self.approval_ops)), label="operation")
        effect = self.approval_ops[op]
        before = self._row(effect)
        try:
            result = self.box.decide_approval(TENANT, op, decision, actor="bob", reason="ok")
        except errors.ApprovalConflict:
            # Decided the other way already: nothing may have changed.
            assert before.status != S.HELD
            assert self._row(effect) == before
            return
        if not result.changed:
            assert self._row(effect) == before
            return
        assert before.status == S.HELD
        if decision is states.ApprovalDecision.APPROVE:
            with self.lock:
                self.unsendable.discard(self.keys[effect])
        self._observe()

    @rule(outcome=st.sampled_from(DELIVERIES), later=LATER)
    def dispatch(self, outcome: str, later: int) -> None:
        self.delivery = outcome
        self.dispatcher.run_once(self.clock.advance(later))
        self._observe(through_in_flight=True)

    @rule(reached_provider=st.booleans(), later=LATER)
    def worker_dies_mid_send(self, reached_provider: bool, later: int) -> None:
        claimed = store.claim_due(
            self.box.engine,
            store.ClaimParams(
                owner="doomed", lease=LEASE, limit=100, now=self.clock.advance(later)
            ),
        ).effects
        with self.lock:
            for effect in claimed:
                if effect.effect_key in self.blocked:
                    self.violations.append(f"claimed blocked {effect.effect_key} and sent it")
                if effect.effect_key in self.unsendable:
                    self.violations.append(f"claimed {effect.effect_key}, held or rejected")
                if reached_provider:
                    self._act_at_provider(effect.effect_key)
                self._may_have_sent(effect.effect_key)
        self._observe()

    @rule(lookups=st.sampled_from(["inconclusive", "truthful", "raises"]), later=LATER)
    def reconcile(self, lookups: str, later: int) -> None:
        """A reconciler pass: lease expiry, deadlines, lookups, in the scheduler's order."""
        self.lookup_mode = lookups
        now = self.clock.advance(later)
        for sweep in (self.expire, self.deadlines, self.lookups):
            sweep.run_once(now)
            self._observe()  # after each sweep: each one moves a row along one edge

    @precondition(lambda self: self.reviewed)
    @rule(data=st.data(), choice=st.sampled_from(["requeue", "abandon"]))
    def operator_acts(self, data: st.DataObject, choice: str) -> None:
        """An operator works the review queue: on an item there now, or one that
        was there when they looked (a stale action)."""
        effect = data.draw(st.sampled_from(sorted(self.reviewed)), label="effect")
        key = self.keys[effect]
        # A truthful operator: "happened" when the provider has it, else the drawn choice.
        if self.tickets[key]:
            kind, ref = states.ReviewChoice.HAPPENED, self.refs[key]
        elif choice == "requeue":
            kind, ref = states.ReviewChoice.NOT_HAPPENED_REQUEUE, None
        else:
            kind, ref = states.ReviewChoice.NOT_HAPPENED_ABANDON, None
        before = self._row(effect)
        try:
            review.resolve(
                self.box.engine,
                effect,
                choice=kind,
                reason="checked by hand",
                actor="alice",
                action_id=f"act-{next(self.actions)}",
                provider_ref=ref,
                now=self.clock(),
                effect_deadline=self.config.effect_deadline,
            )
        except errors.ReviewConflict:
            # Stale: the item is not awaiting a decision. Nothing may have changed.
            assert before.status != S.OUTCOME_UNKNOWN
            assert self._row(effect) == before
            return
        assert before.status == S.OUTCOME_UNKNOWN
        if kind is states.ReviewChoice.NOT_HAPPENED_REQUEUE:
            with self.lock:
                self.blocked.discard(key)
        self._observe()

    # --- checks ----------------------------------------------------------------------

    def _row(self, effect: int) -> Any:
        with db.read(self.box.engine) as conn:
            return conn.execute(sa.select(schema.outbox).where(schema.outbox.c.id == effect)).one()

    def _rows(self) -> Iterator[Any]:
        with db.read(self.box.engine) as conn:
            yield from conn.execute(sa.select(schema.outbox)).all()

    def _observe(self, *, through_in_flight: bool = False) -> None:
        for r in self._rows():
            before, after = self.status[r.id], S(r.status)
            allowed = {before} | T[before]
            if through_in_flight and before is S.PENDING:
                allowed |= T[S.IN_FLIGHT]
            assert after in allowed, f"effect {r.id}: {before} -> {after} is not an edge"
            self.status[r.id] = after
            if r.needs_review:
                self.reviewed.add(r.id)

    @invariant()
    def check(self) -> None:
        with db.read(self.box.engine) as conn:
            rows = conn.execute(sa.select(schema.outbox)).all()
            attempt_keys = conn.execute(
                sa.select(schema.attempts.c.effect_id, schema.attempts.c.effect_key)
            ).all()
        for r in rows:
            # Every row is in a state of the design.
            status = S(r.status)
            if status in states.TERMINAL:
                assert r.finished_at is not None
            if status is S.SUCCEEDED:
                assert r.provider_ref and r.reason in SUCCEEDED_REASONS
            if status is S.IN_FLIGHT:
                assert r.lease_owner and r.lease_expires_at
            if r.needs_review:
                assert status is S.OUTCOME_UNKNOWN
            if status is S.OUTCOME_UNKNOWN:
                assert r.maybe_sent, "unknown means a send may have happened"
            if status is S.HELD:
                assert r.attempts == 0 and not r.maybe_sent and r.lease_owner is None
            # The record agrees with the provider: "failed" means nothing happened
            # there, "succeeded" names what did.
            key = self.keys[r.id]
            if status is S.FAILED:
                assert self.tickets[key] == 0, f"effect {r.id} failed but the provider has it"
            if status is S.SUCCEEDED:
                assert r.provider_ref == self.refs[key]
            # The key never changes: on the row, on every attempt, in every request.
            assert r.effect_key == self.keys[r.id]
        for effect_id, key in attempt_keys:
            assert key == self.keys[effect_id]
        for call in self.adapter.calls:
            assert call.effect_key == self.keys[call.effect_id]
        # Never resent after ambiguity without a lookup or a person saying so; and a
        # held or rejected effect is never claimed or sent (``_deliver`` records it).
        assert self.violations == []
        # So no provider holds two tickets for one effect.
        assert all(count <= 1 for count in self.tickets.values()), self.tickets


@pytest.mark.parametrize(
    "caps",
    [
        Capabilities(honours, lookup, SETTLE_SECONDS)
        for honours in (False, True)
        for lookup in (True, False)
    ],
    ids=lambda c: (
        f"{'honours' if c.honours_idempotency_keys else 'ignores'}-keys-"
        f"{'with' if c.supports_lookup else 'no'}-lookup"
    ),
)
def test_the_effect_state_machine(template: Path, caps: Capabilities) -> None:
    machine = type("Machine", (EffectMachine,), {"template": template, "caps": caps})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,  # the same runs every time: a failure reproduces
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# --- the approval edges, one test each ------------------------------------------------


@pytest.fixture
def held_box(tmp_path: Path, template: Path) -> Iterator[Outbox]:
    path = tmp_path / "held.db"
    shutil.copy(template, path)
    registry = tools.default_registry()
    registry.register(HELD_TOOL)
    box = Outbox(f"sqlite:///{path}", registry=registry, clock=Clock())
    box.create_tenant(TENANT)
    box.execute(TENANT, "op-held", HELD_TOOL.name, {"subject": "wait"})
    yield box
    box.close()


def _only(box: Outbox) -> Any:
    with db.read(box.engine) as conn:
        return conn.execute(sa.select(schema.outbox)).one()


def test_created_held_when_the_tool_requires_approval_and_never_claimed(held_box: Outbox):
    row = _only(held_box)
    assert (row.status, row.reason) == (S.HELD, states.Reason.AWAITING_APPROVAL)
    later = held_box.clock() + timedelta(days=30)
    params = store.ClaimParams(owner="w", lease=LEASE, limit=10, now=later)
    assert store.claim_due(held_box.engine, params).effects == []
    assert _only(held_box).status == S.HELD


def test_held_to_pending_when_approved(held_box: Outbox):
    held_box.decide_approval(TENANT, "op-held", "approve", actor="alice")
    row = _only(held_box)
    assert S.PENDING in T[S.HELD]
    assert (row.status, row.reason) == (S.PENDING, states.Reason.APPROVED)
    params = store.ClaimParams(owner="w", lease=LEASE, limit=10, now=held_box.clock())
    assert [e.id for e in store.claim_due(held_box.engine, params).effects] == [row.id]


def test_held_to_failed_when_rejected(held_box: Outbox):
    held_box.decide_approval(TENANT, "op-held", "reject", actor="alice", reason="no")
    row = _only(held_box)
    assert S.FAILED in T[S.HELD]
    assert (row.status, row.reason) == (S.FAILED, states.Reason.REJECTED)
    assert row.finished_at is not None and row.attempts == 0


def test_no_other_edge_leaves_held():
    assert T[S.HELD] == frozenset({S.PENDING, S.FAILED})
    assert all(S.HELD not in T[s] for s in S)  # only a create makes a held effect
    with pytest.raises(states.IllegalTransition):
        states.check_transition(S.HELD, S.IN_FLIGHT)


def test_the_database_refuses_a_held_row_that_was_attempted(held_box: Outbox):
    with (
        pytest.raises(sa.exc.IntegrityError, match="held_never_sent"),
        db.write(held_box.engine) as conn,
    ):
        conn.execute(sa.update(schema.outbox).values(attempts=1))
