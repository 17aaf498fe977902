"""The dispatcher against scripted adapters: every outcome, retries, budget, breaker, stops."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

import adapters
from adapters import DeliveryRequest, DeliveryResult
from adapters.testing import FakeAdapter
from outbox import faults, metrics, schema
from outbox.delivery import store
from outbox.states import AttemptOutcome, EffectStatus, Reason
from tests.dispatcher.support import attempts, row, rows, seed, statuses
from tests.support.patience import PATIENCE_S

S = EffectStatus
HONOURS = adapters.Capabilities(True, True, 2.0)
IGNORES = adapters.Capabilities(False, True, 3.0)


def fake(*script, honours: bool = True, name: str = "helpdesk") -> FakeAdapter:
    return FakeAdapter(name=name, capabilities=HONOURS if honours else IGNORES, script=script)


def test_delivered_succeeds_with_the_stored_key_and_a_finished_attempt(
    engine, clock, make_dispatcher
) -> None:
    ids = seed(engine, 3, now=clock())
    adapter = fake()
    assert make_dispatcher(adapter).run_once(now=clock()) == 3
    assert make_dispatcher(adapter).run_once(now=clock()) == 0
    for effect_id in ids:
        r = row(engine, effect_id)
        assert (r.status, r.reason, r.provider_ref, r.finished_at, r.lease_owner) == (
            S.SUCCEEDED,
            Reason.DELIVERED,
            f"fake-{r.effect_key}",
            clock(),
            None,
        )
        (a,) = attempts(engine, effect_id)
        assert (a.outcome, a.status_code, a.finished_at, a.worker, a.late) == (
            AttemptOutcome.DELIVERED,
            201,
            clock(),
            "w1",
            False,
        )
    assert sorted(c.effect_key for c in adapter.calls) == sorted(
        row(engine, i).effect_key for i in ids
    )
    assert {c.attempt for c in adapter.calls} == {1}


def test_permanent_fails(engine, clock, make_dispatcher) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    make_dispatcher(fake(DeliveryResult.permanent("bad subject", status_code=422))).run_once(
        now=clock()
    )
    r = row(engine, effect_id)
    assert (r.status, r.reason, r.maybe_sent, r.last_error) == (
        S.FAILED,
        Reason.PERMANENT,
        False,
        "bad subject",
    )
    assert attempts(engine, effect_id)[0].status_code == 422


@pytest.mark.parametrize(
    ("result", "reason", "maybe_sent"),
    [
        (DeliveryResult.not_sent("connect refused"), Reason.NOT_SENT, False),
        (DeliveryResult.retryable(None, status_code=503), Reason.RETRYABLE, False),
        (DeliveryResult.ambiguous("read timeout"), Reason.AMBIGUOUS_KEYS_HONOURED, True),
    ],
)
def test_retryable_outcomes_reschedule_with_the_same_key(
    engine, clock, make_dispatcher, result, reason, maybe_sent
) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    adapter = fake(result)
    dispatcher = make_dispatcher(adapter)
    dispatcher.run_once(now=clock())
    r = row(engine, effect_id)
    assert (r.status, r.reason, r.maybe_sent, r.attempts) == (S.PENDING, reason, maybe_sent, 1)
    # First retry: full jitter within [0, backoff_initial].
    assert clock() <= r.next_attempt_at <= clock() + timedelta(seconds=1)
    clock.advance(1)
    dispatcher.run_once(now=clock())
    assert row(engine, effect_id).status == S.SUCCEEDED
    assert [c.effect_key for c in adapter.calls] == [r.effect_key] * 2
    assert [c.attempt for c in adapter.calls] == [1, 2]


def test_retry_after_is_honoured(engine, clock, make_dispatcher) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    adapter = fake(DeliveryResult.retryable(7.0, status_code=429))
    dispatcher = make_dispatcher(adapter)
    dispatcher.run_once(now=clock())
    assert row(engine, effect_id).next_attempt_at == clock() + timedelta(seconds=7)
    clock.advance(6.9)
    assert dispatcher.run_once(now=clock()) == 0
    clock.advance(0.1)
    assert dispatcher.run_once(now=clock()) == 1
    assert row(engine, effect_id).status == S.SUCCEEDED


def test_ambiguous_without_key_support_is_outcome_unknown_and_never_resent(
    engine, clock, make_dispatcher
) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    adapter = fake(DeliveryResult.ambiguous("connection reset"), honours=False)
    dispatcher = make_dispatcher(adapter)
    dispatcher.run_once(now=clock())
    r = row(engine, effect_id)
    assert (r.status, r.reason, r.maybe_sent, r.needs_review) == (
        S.OUTCOME_UNKNOWN,
        Reason.AMBIGUOUS_NO_KEY_SUPPORT,
        True,
        False,
    )
    assert r.next_lookup_at == clock() + timedelta(seconds=3)
    clock.advance(3600)
    assert dispatcher.run_once(now=clock()) == 0
    assert len(adapter.calls) == 1


def test_a_success_without_a_reference_gets_a_documented_marker(
    engine, clock, make_dispatcher
) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    make_dispatcher(fake(DeliveryResult.delivered(None, status_code=204))).run_once(now=clock())
    r = row(engine, effect_id)
    assert (r.status, r.provider_ref) == (S.SUCCEEDED, "http-204")
    assert "without a reference" in r.last_error
    assert attempts(engine, effect_id)[0].provider_ref is None


def test_an_adapter_that_breaks_its_contract_fails_only_its_row_and_counts_as_maybe_sent(
    engine, clock, make_dispatcher
) -> None:
    ids = seed(engine, 5, now=clock())

    def explode(request: DeliveryRequest) -> DeliveryResult:
        raise RuntimeError("bug after the socket write")

    adapter = fake(explode)
    make_dispatcher(adapter, concurrency=1).run_once(now=clock())
    assert statuses(engine) == {"succeeded": 4, "pending": 1}
    (bad,) = [r for r in rows(engine).values() if r.status == S.PENDING]
    assert bad.maybe_sent and bad.reason == Reason.AMBIGUOUS_KEYS_HONOURED
    assert "RuntimeError" in bad.last_error
    assert len(ids) == 5


def test_adapter_errors_are_isolated_counted_and_capped(engine, clock, make_dispatcher) -> None:
    poison = {"subject": "poison", "body": "", "priority": "normal"}
    good = {"subject": "fine", "body": "", "priority": "normal"}
    ids = seed(engine, 21, now=clock(), payloads=[poison] + [good] * 20)

    class Picky(FakeAdapter):
        def deliver(self, request: DeliveryRequest) -> DeliveryResult:
            if request.payload["subject"] == "poison":
                raise adapters.PayloadError("cannot encode", adapter=self.name)
            return super().deliver(request)

    dispatcher = make_dispatcher(Picky(name="helpdesk", capabilities=HONOURS), max_attempts=3)
    for _ in range(10):
        dispatcher.run_once(now=clock())
        clock.advance(30)
    assert statuses(engine) == {"succeeded": 20, "failed": 1}
    r = row(engine, ids[0])
    assert (r.reason, r.maybe_sent, r.attempts) == (Reason.MAX_ATTEMPTS, False, 3)
    assert [a.outcome for a in attempts(engine, ids[0])] == [AttemptOutcome.ADAPTER_ERROR] * 3


def test_an_unknown_adapter_fails_its_rows_only(engine, clock, make_dispatcher) -> None:
    lost = seed(engine, 1, now=clock(), adapter="nowhere", prefix="x")
    seed(engine, 2, now=clock())
    dispatcher = make_dispatcher(fake(), max_attempts=1)
    dispatcher.run_once(now=clock())
    assert statuses(engine) == {"succeeded": 2, "failed": 1}
    assert "nowhere" in row(engine, lost[0]).last_error


def test_retries_stop_at_the_deadline(engine, clock, make_dispatcher) -> None:
    (effect_id,) = seed(engine, 1, now=clock(), deadline=timedelta(seconds=20))
    adapter = fake(*[DeliveryResult.not_sent("refused")] * 100)
    dispatcher = make_dispatcher(adapter, max_attempts=100, backoff_initial=1, backoff_max=4)
    start = clock()
    for _ in range(100):
        dispatcher.run_once(now=clock())
        r = row(engine, effect_id)
        if r.status != S.PENDING:
            break
        assert r.next_attempt_at < start + timedelta(seconds=20)
        clock.now = r.next_attempt_at
    assert (r.status, r.reason) == (S.FAILED, Reason.DEADLINE_NOTHING_SENT)
    assert all(
        c_at < start + timedelta(seconds=20) for c_at in [a.started_at for a in attempts(engine)]
    )


def test_deadline_after_a_possible_send_is_outcome_unknown(engine, clock, make_dispatcher) -> None:
    (effect_id,) = seed(engine, 1, now=clock(), deadline=timedelta(seconds=5))
    adapter = fake(DeliveryResult.ambiguous("timeout"), DeliveryResult.retryable(60.0))
    dispatcher = make_dispatcher(adapter)
    dispatcher.run_once(now=clock())
    clock.advance(1)
    dispatcher.run_once(now=clock())
    r = row(engine, effect_id)
    assert (r.status, r.reason, r.maybe_sent) == (
        S.OUTCOME_UNKNOWN,
        Reason.DEADLINE_MAY_HAVE_SENT,
        True,
    )


def test_retry_budget_holds_failing_retries_back_and_recovers(
    engine, clock, make_dispatcher
) -> None:
    ids = seed(engine, 4, now=clock())
    # Four first attempts and the one retry they earn all fail: the outage goes on.
    adapter = fake(*[DeliveryResult.not_sent("refused")] * 5)
    dispatcher = make_dispatcher(
        adapter, retry_budget_ratio=0.25, retry_budget_min_per_window=0, retry_budget_window=60
    )
    before = metrics.RETRY_BUDGET_REFUSALS.labels("helpdesk")._value.get()
    dispatcher.run_once(now=clock())  # 4 first attempts: budget = 1 retry
    clock.advance(2)
    assert dispatcher.run_once(now=clock()) == 1
    assert dispatcher.run_once(now=clock()) == 0  # spent by a failing retry: not even selected
    assert statuses(engine) == {"pending": 4}
    assert metrics.RETRY_BUDGET_REFUSALS.labels("helpdesk")._value.get() > before
    clock.advance(61)  # the first attempts slid out of the window: no budget at all
    assert dispatcher.run_once(now=clock()) == 0
    seed(engine, 8, now=clock(), prefix="more")  # new traffic earns retries again
    assert dispatcher.run_once(now=clock()) == 8
    # 0.25 x 8 first attempts = 2 retries; the provider answers them, so they
    # give their tokens back and the next two go at once: no waiting for the window.
    assert dispatcher.run_once(now=clock()) == 2
    assert dispatcher.run_once(now=clock()) == 2
    assert dispatcher.run_once(now=clock()) == 0
    assert statuses(engine) == {"succeeded": 12}
    assert dispatcher.budget("helpdesk").refunded == 4
    assert len(ids) == 4


def test_after_an_outage_lost_replies_drain_at_the_rate_the_provider_answers(
    engine, clock, make_dispatcher
) -> None:
    """70 replies lost at a provider that honours keys: the backlog drains in seconds."""
    seed(engine, 70, now=clock())
    outage = [DeliveryResult.ambiguous("reply lost")] * 70
    adapter = fake(*outage)
    dispatcher = make_dispatcher(
        adapter,
        retry_budget_ratio=0.1,  # 7 retries per window from 70 first attempts...
        retry_budget_min_per_window=10,  # ...but at least 10
        retry_budget_window=60,
        backoff_initial=1,
        backoff_max=2,
        max_attempts=20,
    )
    dispatcher.run_once(now=clock())  # the burst: 70 sends, every reply lost
    assert statuses(engine) == {"pending": 70}
    cleared_at = clock()  # the fault clears now
    passes = 0
    while statuses(engine) != {"succeeded": 70} and passes < 200:
        clock.advance(1)
        dispatcher.run_once(now=clock())
        passes += 1
    assert statuses(engine) == {"succeeded": 70}
    assert (clock() - cleared_at) <= timedelta(seconds=30)
    # Each effect was sent with one key; the resends reused it (no second effect).
    keys = [call.effect_key for call in adapter.calls]
    assert len(set(keys)) == 70
    assert dispatcher.budget("helpdesk").refunded >= 60


def test_breaker_pauses_a_failing_adapter_without_blocking_others(
    engine, clock, make_dispatcher
) -> None:
    bad = seed(engine, 6, now=clock(), adapter="down", prefix="d")
    good = seed(engine, 2, now=clock(), adapter="up", prefix="u")
    down = fake(*[DeliveryResult.retryable(None, status_code=503)] * 4, name="down")
    dispatcher = make_dispatcher(
        down,
        fake(name="up"),
        breaker_failure_threshold=3,
        breaker_cooldown=10,
        breaker_cooldown_max=40,
        claim_batch_size=3,
        concurrency=1,
    )
    dispatcher.run_once(now=clock())  # 3 x 503: open
    assert dispatcher.breaker("down").state.value == "open"
    assert metrics.BREAKER_OPEN.labels("down")._value.get() == 1
    clock.advance(5)
    assert dispatcher.run_once(now=clock()) == 2  # only "up" rows: "down" is paused
    assert all(row(engine, i).status == S.SUCCEEDED for i in good)
    assert dispatcher.run_once(now=clock()) == 0
    assert len(down.calls) == 3
    clock.advance(5)  # cooldown over: one probe, which fails: paused for 20 s
    assert dispatcher.run_once(now=clock()) == 1
    assert len(down.calls) == 4 and dispatcher.breaker("down").cooldown == timedelta(seconds=20)
    clock.advance(19)
    assert dispatcher.run_once(now=clock()) == 0
    clock.advance(1)  # probe succeeds: closed, everything flows
    assert dispatcher.run_once(now=clock()) == 1
    assert dispatcher.breaker("down").state.value == "closed"
    for _ in range(5):
        dispatcher.run_once(now=clock())
        clock.advance(30)
    assert all(row(engine, i).status == S.SUCCEEDED for i in bad)


# --- crash windows ----------------------------------------------------------------------


def test_crash_after_the_attempt_commit_leaves_an_open_attempt_and_nothing_sent(
    engine, clock, make_dispatcher
) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    adapter = fake()
    with (
        faults.armed("dispatch.after_attempt_commit", faults.InjectedFault),
        pytest.raises(faults.InjectedFault),
    ):
        make_dispatcher(adapter).run_once(now=clock())
    assert adapter.calls == []
    assert row(engine, effect_id).status == S.IN_FLIGHT
    (a,) = attempts(engine, effect_id)
    assert a.started_at == clock() and a.finished_at is None


def _pause(seconds: float, during=None):
    """A worker frozen between its attempt commit and its send (SIGSTOP, a long GC)."""

    def pause() -> None:
        time.sleep(seconds / 2)
        if during is not None:
            during()
        time.sleep(seconds / 2)

    return pause


@pytest.mark.parametrize("honours", [True, False])
def test_a_worker_paused_past_its_lease_before_the_send_does_not_send(
    engine, make_dispatcher, honours
) -> None:
    (effect_id,) = seed(engine, 1, now=schema.utcnow())
    adapter = fake(honours=honours)
    dispatcher = make_dispatcher(adapter, lease_duration=1.2, lease_renew_interval=0.4)
    with faults.armed("dispatch.after_attempt_commit", _pause(1.3)):
        assert dispatcher.run_once() == 1
    # The lease may have run out and the row been decided by someone else:
    # whatever the provider, the request must not leave now.
    assert adapter.calls == []
    (a,) = attempts(engine, effect_id)
    assert a.outcome == AttemptOutcome.NOT_SENT and a.finished_at is not None
    assert "lease could have run out" in a.error
    # Nobody took the row meanwhile, so it is still ours to reschedule: same key, later.
    r = row(engine, effect_id)
    assert (r.status, r.reason, r.maybe_sent) == (S.PENDING, Reason.NOT_SENT, False)


def test_a_renewed_lease_lets_the_send_go_after_a_pause(engine, make_dispatcher) -> None:
    (effect_id,) = seed(engine, 1, now=schema.utcnow())
    adapter = fake()
    # The lease is longer here than in the test above: the renewal halfway through
    # the pause only counts if it began before the lease (read before the claim)
    # could have run out, and a claim slowed down by a loaded machine must not
    # push it past that.
    dispatcher = make_dispatcher(adapter, lease_duration=3, lease_renew_interval=1)
    # The renewal job ran while the runner waited: the lease never lapsed.
    with faults.armed("dispatch.after_attempt_commit", _pause(3.2, dispatcher.renew_leases)):
        assert dispatcher.run_once() == 1
    assert len(adapter.calls) == 1
    assert row(engine, effect_id).status == S.SUCCEEDED


@pytest.mark.parametrize("honours", [True, False])
def test_crash_between_send_and_record_then_lease_expiry(
    engine, clock, make_dispatcher, honours
) -> None:
    (effect_id,) = seed(engine, 1, now=clock())
    adapter = fake(honours=honours)
    with (
        faults.armed("dispatch.after_send_before_finish", faults.InjectedFault),
        pytest.raises(faults.InjectedFault),
    ):
        make_dispatcher(adapter, worker_id="crashed").run_once(now=clock())
    assert len(adapter.calls) == 1  # the provider acted; we recorded nothing
    (a,) = attempts(engine, effect_id)
    assert (a.worker, a.finished_at) == ("crashed", None)
    clock.advance(61)
    caps = adapter.capabilities
    assert (
        store.expire_leases(engine, capabilities_for=lambda _: caps, max_attempts=5, now=clock())
        == 1
    )
    make_dispatcher(adapter, worker_id="next").run_once(now=clock())
    r = row(engine, effect_id)
    if honours:
        assert r.status == S.SUCCEEDED
        assert [c.effect_key for c in adapter.calls] == [r.effect_key] * 2
    else:
        assert (r.status, r.reason) == (S.OUTCOME_UNKNOWN, Reason.LEASE_EXPIRED)
        assert len(adapter.calls) == 1


# --- leases, shutdown, wake-up (real clocks, bounded waits) --------------------------------


def blocking_step(started: threading.Event, release: threading.Event):
    def step(request: DeliveryRequest) -> DeliveryResult:
        started.set()
        release.wait(20)
        return DeliveryResult.delivered(f"slow-{request.effect_key}", status_code=201)

    return step


def test_leases_are_renewed_while_a_delivery_is_slow(engine, make_dispatcher) -> None:
    (effect_id,) = seed(engine, 1, now=schema.utcnow())
    started, release = threading.Event(), threading.Event()
    dispatcher = make_dispatcher(
        fake(blocking_step(started, release)),
        lease_duration=1.5,
        lease_renew_interval=0.2,
    )
    thread = threading.Thread(target=dispatcher.run, kwargs={"once": True})
    thread.start()
    try:
        assert started.wait(PATIENCE_S)
        first = row(engine, effect_id).lease_expires_at
        deadline = time.monotonic() + PATIENCE_S
        while row(engine, effect_id).lease_expires_at <= first + timedelta(seconds=0.3):
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
        # Past the original lease, the row is still ours: nobody else may take it.
        # (The sweep is given that moment, rather than waiting for the clock to reach it.)
        past_the_first = first + timedelta(seconds=0.2)
        assert (
            store.expire_leases(
                engine, capabilities_for=lambda _: HONOURS, max_attempts=5, now=past_the_first
            )
            == 0
        )
    finally:
        release.set()
        thread.join(10)
    assert row(engine, effect_id).status == S.SUCCEEDED


def test_stop_lets_in_flight_deliveries_finish_within_the_grace(engine, make_dispatcher) -> None:
    (effect_id,) = seed(engine, 1, now=schema.utcnow())
    started, release = threading.Event(), threading.Event()
    dispatcher = make_dispatcher(fake(blocking_step(started, release)), shutdown_grace=10)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert started.wait(PATIENCE_S)
        dispatcher.request_stop()
        time.sleep(0.1)
        release.set()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        release.set()
        dispatcher.request_stop()
        thread.join(10)
    assert row(engine, effect_id).status == S.SUCCEEDED
    assert dispatcher.released == 0


@pytest.mark.parametrize("honours", [True, False])
def test_stop_releases_what_the_grace_did_not_cover(engine, make_dispatcher, honours) -> None:
    ids = seed(engine, 3, now=schema.utcnow())
    started, release = threading.Event(), threading.Event()
    adapter = fake(blocking_step(started, release), honours=honours)
    dispatcher = make_dispatcher(adapter, concurrency=1, shutdown_grace=0.2)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert started.wait(PATIENCE_S)
        dispatcher.request_stop()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        release.set()
        thread.join(10)
    assert dispatcher.released == 3
    sent, *queued = (row(engine, i) for i in ids)
    # The one handed to the adapter may have been sent: never returned as unsent.
    assert sent.maybe_sent and sent.lease_owner is None
    if honours:
        assert (sent.status, sent.reason) == (S.PENDING, Reason.LEASE_EXPIRED)
    else:
        assert (sent.status, sent.reason) == (S.OUTCOME_UNKNOWN, Reason.LEASE_EXPIRED)
    assert attempts(engine, ids[0])[0].outcome == AttemptOutcome.ABANDONED
    # The ones never handed over go back as they were.
    for r in queued:
        assert (r.status, r.reason, r.maybe_sent, r.lease_owner) == (
            S.PENDING,
            Reason.RELEASED,
            False,
            None,
        )
        assert attempts(engine, r.id)[0].outcome == AttemptOutcome.NOT_SENT
    assert len(adapter.calls) == 1


# Longer than any wait below: a row delivered within the patience was woken by its
# NOTIFY, never by the poll, however slow the machine.
POLL_NEVER_S = PATIENCE_S * 10


def test_notify_wakes_the_dispatcher_without_waiting_for_the_poll(
    engine, backend, make_dispatcher
) -> None:
    if backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite polls")
    delivered = threading.Event()

    def step(request: DeliveryRequest) -> DeliveryResult:
        delivered.set()
        return DeliveryResult.delivered("ref", status_code=201)

    dispatcher = make_dispatcher(fake(step), poll_interval=POLL_NEVER_S)
    ready = threading.Event()
    thread = threading.Thread(target=dispatcher.run, kwargs={"ready": ready})
    thread.start()
    try:
        assert ready.wait(PATIENCE_S)
        time.sleep(0.3)  # the first pass found nothing; the next poll is a minute away
        seed(engine, 1, now=schema.utcnow())
        assert delivered.wait(PATIENCE_S), "the NOTIFY did not wake the dispatcher"
    finally:
        dispatcher.request_stop()
        thread.join(10)


def test_a_row_inserted_during_a_pass_is_claimed_without_waiting_for_the_poll(
    engine, backend, make_dispatcher
) -> None:
    """The NOTIFY of a row committed while a pass is delivering must not be
    lost with the pass: the loop claims it at once, not at the next poll."""
    if backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite polls")
    started, release, second = threading.Event(), threading.Event(), threading.Event()

    def later(request: DeliveryRequest) -> DeliveryResult:
        second.set()
        return DeliveryResult.delivered("ref-2", status_code=201)

    seed(engine, 1, now=schema.utcnow(), prefix="first")
    dispatcher = make_dispatcher(
        fake(blocking_step(started, release), later), poll_interval=POLL_NEVER_S
    )
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert started.wait(PATIENCE_S)
        # Committed while the pass that claimed the first row is still delivering.
        seed(engine, 1, now=schema.utcnow(), prefix="second")
        release.set()
        assert second.wait(PATIENCE_S), "the row's NOTIFY was lost; it waited for the poll"
    finally:
        release.set()
        dispatcher.request_stop()
        thread.join(10)
    assert statuses(engine) == {S.SUCCEEDED: 2}


def test_with_listen_up_a_short_pass_waits_for_the_next_notify(
    engine, backend, make_dispatcher, monkeypatch
) -> None:
    """A pass that found fewer rows than a batch does not run an empty select
    after it when LISTEN is up: a row committed meanwhile has woken the loop
    already (the test above), so the extra select would only cost a round trip."""
    if backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite polls")
    claims: list[int] = []
    real_claim = store.claim_due

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        claim = real_claim(*args, **kwargs)
        claims.append(len(claim.effects))
        return claim

    monkeypatch.setattr(store, "claim_due", counting)
    delivered = threading.Event()

    def step(request: DeliveryRequest) -> DeliveryResult:
        delivered.set()
        return DeliveryResult.delivered("ref", status_code=201)

    dispatcher = make_dispatcher(fake(step), poll_interval=POLL_NEVER_S)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert dispatcher._listening.wait(PATIENCE_S)
        time.sleep(0.3)  # the passes LISTEN's first wake-up asked for are over
        before = len(claims)
        seed(engine, 1, now=schema.utcnow())
        assert delivered.wait(PATIENCE_S)
        deadline = time.monotonic() + PATIENCE_S
        while statuses(engine) != {S.SUCCEEDED: 1} and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        after = claims[before:]
        # A late empty pass from LISTEN's first wake-up may come first; none after.
        assert after.count(1) == 1 and after[-1] == 1, f"claims after the seed: {after}"
    finally:
        dispatcher.request_stop()
        thread.join(10)


def test_with_listen_up_a_full_pass_goes_again_at_once(engine, backend, make_dispatcher) -> None:
    """A backlog deeper than a batch drains pass after pass, not one batch per poll."""
    if backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite polls")
    adapter = fake()
    dispatcher = make_dispatcher(adapter, poll_interval=POLL_NEVER_S, claim_batch_size=2)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert dispatcher._listening.wait(PATIENCE_S)
        time.sleep(0.3)
        seed(engine, 7, now=schema.utcnow())  # one commit, one NOTIFY, four batches
        deadline = time.monotonic() + PATIENCE_S
        while statuses(engine) != {S.SUCCEEDED: 7} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert statuses(engine) == {S.SUCCEEDED: 7}, "the loop waited for the poll"
        assert len(adapter.calls) == 7
    finally:
        dispatcher.request_stop()
        thread.join(10)


@pytest.mark.parametrize("record_behind", [True, False])
def test_a_full_pass_is_written_behind_only_on_postgres_and_when_asked(
    engine, backend, make_dispatcher, monkeypatch, record_behind
) -> None:
    """Under a backlog ``run()`` hands a full pass's results to the recorder thread on
    PostgreSQL (``OUTBOX_RECORD_BEHIND``, on by default); SQLite, or the setting off,
    records on the loop's own thread. Either way every row ends recorded."""
    writers: list[str] = []
    real_finish = store.finish_attempts

    def finish_attempts(*args, **kwargs):  # type: ignore[no-untyped-def]
        writers.append(threading.current_thread().name)
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(store, "finish_attempts", finish_attempts)
    seed(engine, 6, now=schema.utcnow())
    step = DeliveryResult.delivered("ref", status_code=201)
    dispatcher = make_dispatcher(fake(*[step] * 6), claim_batch_size=3, record_behind=record_behind)
    loop = threading.current_thread().name
    assert dispatcher.run(once=True) == 6
    behind = backend == "postgres" and record_behind
    assert writers == (["outbox-record_0"] * 2 if behind else [loop] * 2)
    assert statuses(engine) == {EffectStatus.SUCCEEDED: 6}
