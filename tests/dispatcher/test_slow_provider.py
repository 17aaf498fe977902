"""A slow provider does not hold up another adapter's deliveries (``run()``).

The slow adapter's sends block until the test lets them go, so what is shown
does not depend on the machine's speed: while as many sends as the dispatcher's
concurrency are blocked at the slow adapter, deliveries to the other adapter go
on (through the reserve runners) to the end, and the slow one never has more
sends out than that. Then the slow sends finish and are recorded by the
collector, under their fences, exactly once each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import adapters
from adapters import DeliveryRequest, DeliveryResult
from adapters.testing import FakeAdapter
from outbox import schema
from outbox.delivery.dispatcher import Dispatcher
from outbox.states import EffectStatus
from tests.dispatcher.support import attempts, row, seed
from tests.support.patience import PATIENCE_S

S = EffectStatus
HONOURS = adapters.Capabilities(True, True, 2.0)
CONCURRENCY = 4
SHARE = CONCURRENCY  # a slow adapter's sends take at most the dispatcher's concurrency


class Blocking:
    """An adapter whose sends wait until ``release``; counts the sends out at once."""

    name = "slow"
    capabilities = HONOURS

    def __init__(self) -> None:
        self.release = threading.Event()
        self.out = 0
        self.most_out = 0
        self.calls = 0
        self._lock = threading.Condition()

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        with self._lock:
            self.out += 1
            self.calls += 1
            self.most_out = max(self.most_out, self.out)
            self._lock.notify_all()
        self.release.wait(PATIENCE_S)
        with self._lock:
            self.out -= 1
        return DeliveryResult.delivered(f"slow-{request.effect_key}", status_code=201)

    def wait_out(self, count: int) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.out >= count, PATIENCE_S)

    def lookup(self, effect_key: str, client_reference: str | None = None) -> adapters.Lookup:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _eventually(check: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_a_slow_provider_leaves_the_other_adapters_deliveries_alone(
    engine, make_dispatcher
) -> None:
    slow, fast = Blocking(), FakeAdapter(name="fast", capabilities=HONOURS)
    slow_ids = seed(engine, 10, now=schema.utcnow(), adapter="slow", prefix="slow")
    dispatcher: Dispatcher = make_dispatcher(
        slow,
        fast,
        concurrency=CONCURRENCY,
        slow_send_after=0.05,
        poll_interval=0.05,
        shutdown_grace=PATIENCE_S,
    )
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert slow.wait_out(SHARE), "the slow adapter's sends did not start"
        # Every runner the slow adapter may hold is blocked. New work for another
        # adapter arrives, and is delivered while the slow sends are still out.
        fast_ids = seed(engine, 20, now=schema.utcnow(), adapter="fast", prefix="fast")
        dispatcher.wake()
        assert _eventually(lambda: all(row(engine, i).status == S.SUCCEEDED for i in fast_ids))
        assert slow.out == SHARE and slow.most_out == SHARE
        # All ten were claimed by the first pass: four out, six waiting their turn.
        assert [row(engine, i).status for i in slow_ids] == [S.IN_FLIGHT] * 10
        # The provider answers again: every slow effect is delivered, once.
        slow.release.set()
        assert _eventually(lambda: all(row(engine, i).status == S.SUCCEEDED for i in slow_ids))
    finally:
        slow.release.set()
        dispatcher.request_stop()
        thread.join(PATIENCE_S)
    assert not thread.is_alive()
    assert slow.calls == 10 and slow.most_out <= SHARE
    for effect_id in slow_ids:
        (attempt,) = attempts(engine, effect_id)
        assert (attempt.outcome.value, attempt.late) == ("delivered", False)
    assert len(fast.calls) == 20


def test_stopping_while_slow_sends_are_out_releases_them_after_the_grace(
    engine, make_dispatcher
) -> None:
    slow = Blocking()
    slow_ids = seed(engine, 6, now=schema.utcnow(), adapter="slow", prefix="slow")
    dispatcher: Dispatcher = make_dispatcher(
        slow, concurrency=CONCURRENCY, slow_send_after=0.05, shutdown_grace=0.2
    )
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert slow.wait_out(SHARE)
        # Left to a collector once nothing else moved for slow_send_after.
        assert _eventually(lambda: bool(dispatcher._detached))
        dispatcher.request_stop()
        thread.join(PATIENCE_S)
        assert not thread.is_alive()
    finally:
        slow.release.set()
        thread.join(PATIENCE_S)
    # The sends that went out may have happened: kept as such, with their key; the
    # ones never handed to the adapter go back as they were.
    statuses = [row(engine, i).status for i in slow_ids]
    assert statuses.count(S.PENDING) == 6
    assert dispatcher.abandoned_sends == SHARE
    assert sum(row(engine, i).maybe_sent for i in slow_ids) == SHARE


def test_a_collector_that_cannot_record_leaves_the_rows_to_their_leases(
    engine, make_dispatcher, monkeypatch
) -> None:
    """The database fails while a collector records slow results: as after a failed pass,
    the rows stay in flight under their leases (the reconciler's to expire), nothing is
    written half, and the loop goes on serving the other adapters."""
    from outbox.delivery import store

    slow, fast = Blocking(), FakeAdapter(name="fast", capabilities=HONOURS)
    slow_ids = seed(engine, SHARE, now=schema.utcnow(), adapter="slow", prefix="slow")
    dispatcher: Dispatcher = make_dispatcher(
        slow, fast, concurrency=CONCURRENCY, slow_send_after=0.05, poll_interval=0.05
    )
    real_finish = store.finish_attempts

    def failing(engine_, finishes):  # type: ignore[no-untyped-def]
        if any(f.effect_id in slow_ids for f in finishes):
            raise RuntimeError("the database is gone")
        return real_finish(engine_, finishes)

    monkeypatch.setattr(store, "finish_attempts", failing)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert slow.wait_out(SHARE)
        assert _eventually(lambda: bool(dispatcher._detached))
        slow.release.set()  # the results come back; recording them fails
        assert _eventually(lambda: not dispatcher._detached and dispatcher._in_flight == 0)
        fast_ids = seed(engine, 3, now=schema.utcnow(), adapter="fast", prefix="fast")
        dispatcher.wake()
        assert _eventually(lambda: all(row(engine, i).status == S.SUCCEEDED for i in fast_ids))
    finally:
        slow.release.set()
        dispatcher.request_stop()
        thread.join(PATIENCE_S)
    assert not thread.is_alive()
    for effect_id in slow_ids:
        r = row(engine, effect_id)
        assert (r.status, r.lease_owner) == (S.IN_FLIGHT, "w1")
        (attempt,) = attempts(engine, effect_id)
        assert attempt.finished_at is None  # open: the evidence that it may have been sent
