"""Write-behind (PostgreSQL, ``run()``): a pass's last batch of results is written by
the recorder thread while the loop claims the next batch.

What must hold: at most one batch is behind (a claim never runs two batches
ahead of the records); its rows keep their leases, renewed, until it commits;
``run()`` returns only after it committed; a failed write loses no row (the
lease settles it, as after a failed pass); and a process that dies with a batch
behind leaves rows the lease expiry settles with the same key, as any crash
between a send and its record does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.engine import Engine

import adapters
from adapters import DeliveryRequest, DeliveryResult
from adapters.testing import FakeAdapter
from outbox import db, schema, settings
from outbox.delivery import store
from outbox.delivery.dispatcher import Dispatcher
from outbox.states import EffectStatus as S
from tests.dispatcher.conftest import TEST_SETTINGS
from tests.dispatcher.support import attempts, rows, seed, statuses
from tests.support.patience import PATIENCE_S, until

pytestmark = pytest.mark.postgres

HONOURS = adapters.Capabilities(True, True, 2.0)
BATCH = 3


class _Crash(BaseException):
    """The process dies here (not an ``Exception``: nothing may catch it as a blip)."""


@pytest.fixture
def pg_engine(postgres_url: str) -> Iterator[Engine]:
    engine = db.create_engine(settings.load(), url=postgres_url)
    yield engine
    engine.dispose()


def _dispatcher(engine: Engine, **overrides: Any) -> Dispatcher:
    def step(request: DeliveryRequest) -> DeliveryResult:
        return DeliveryResult.delivered(f"T-{request.effect_id}", status_code=201)

    adapter = FakeAdapter(name="helpdesk", capabilities=HONOURS, script=[step] * 100)
    config = settings.load(
        **{**TEST_SETTINGS, "claim_batch_size": BATCH, "poll_interval": PATIENCE_S * 10} | overrides
    )
    return Dispatcher(engine, adapters.Registry([adapter]), config, worker_id="w1")


class _Held:
    """``store.finish_attempts`` with its first call held until ``release``; counts
    the claims begun and the finishes done, and checks the one-behind bound at
    every claim."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, first: Callable[[], None] | None = None):
        self.holding = threading.Event()
        self.release = threading.Event()
        self.claims = 0
        self.finished = 0
        self.running = 0
        self.most_running = 0
        self.bound_broken: list[str] = []
        self._lock = threading.Lock()
        self._first = first
        real_claim, real_finish = store.claim_due, store.finish_attempts

        def claim_due(*args: Any, **kwargs: Any) -> store.Claim:
            with self._lock:
                # Claim k may begin only once the records of passes up to k - 2 are in.
                if self.claims - self.finished > 1:
                    self.bound_broken.append(f"claim {self.claims + 1}, {self.finished} recorded")
                self.claims += 1
            return real_claim(*args, **kwargs)

        def finish_attempts(*args: Any, **kwargs: Any) -> store.Recorded:
            with self._lock:
                self.running += 1
                self.most_running = max(self.most_running, self.running)
                first = self.finished == 0 and not self.holding.is_set()
            try:
                if first:
                    self.holding.set()
                    assert self.release.wait(PATIENCE_S)
                    if self._first is not None:
                        self._first()
                return real_finish(*args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1
                    self.finished += 1

        monkeypatch.setattr(store, "claim_due", claim_due)
        monkeypatch.setattr(store, "finish_attempts", finish_attempts)


def _start(dispatcher: Dispatcher, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(dispatcher.run(**kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the test
            out.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


@contextlib.contextmanager
def _running(
    dispatcher: Dispatcher, held: _Held, **kwargs: Any
) -> Iterator[tuple[threading.Thread, list[Any]]]:
    """``run(**kwargs)`` on a thread while the first record is held; then let it go."""
    thread, out = _start(dispatcher, **kwargs)
    try:
        assert held.holding.wait(PATIENCE_S)
        yield thread, out
    finally:
        held.release.set()
        thread.join(PATIENCE_S)
        dispatcher.close()


def test_the_next_claim_runs_while_the_batch_before_is_written(pg_engine, monkeypatch) -> None:
    seed(pg_engine, BATCH * 4, now=schema.utcnow())
    held = _Held(monkeypatch)
    dispatcher = _dispatcher(pg_engine)
    with _running(dispatcher, held, once=True) as (_, out):
        # The first batch is being written; the loop has claimed the second already.
        until(lambda: held.claims >= 2, "the loop claims again before the record is in")
        # ... and leases are renewed for the rows behind as for rows being sent.
        assert dispatcher.renew_leases() >= BATCH
    assert out == [BATCH * 4]
    assert statuses(pg_engine) == {S.SUCCEEDED: BATCH * 4}
    assert held.bound_broken == [] and held.most_running == 1
    assert all(a.finished_at is not None and not a.late for a in attempts(pg_engine))


def test_at_most_one_batch_is_behind(pg_engine, monkeypatch) -> None:
    """With the first record held, the second pass delivers but does not hand its
    batch over (nor claim a third) until the first is in."""
    seed(pg_engine, BATCH * 4, now=schema.utcnow())
    held = _Held(monkeypatch)
    dispatcher = _dispatcher(pg_engine)
    with _running(dispatcher, held, once=True):
        until(lambda: held.claims >= 2, "the second pass claims")
        # Bounded by count, not time: a third claim now would break the bound,
        # and the check inside claim_due records it if it ever happens.
        assert held.claims == 2
    assert held.bound_broken == []
    assert statuses(pg_engine) == {S.SUCCEEDED: BATCH * 4}


def test_run_returns_only_after_the_batch_behind_is_written(pg_engine, monkeypatch) -> None:
    seed(pg_engine, BATCH * 4, now=schema.utcnow())
    held = _Held(monkeypatch)
    dispatcher = _dispatcher(pg_engine)
    with _running(dispatcher, held) as (thread, out):
        dispatcher.request_stop()
        thread.join(0.2)
        assert thread.is_alive(), "run() returned with a batch not yet written"
    assert not thread.is_alive() and isinstance(out[0], int)
    # Every row claimed was recorded before run() returned: none is left in flight.
    assert S.IN_FLIGHT not in statuses(pg_engine)
    assert all(a.finished_at is not None for a in attempts(pg_engine))


def test_a_failed_write_behind_loses_no_row(pg_engine, monkeypatch, caplog) -> None:
    """The database refuses the batch behind: logged, the loop goes on, and its rows
    stay in flight under their leases, for the lease expiry to settle."""

    def refuse() -> None:
        raise RuntimeError("the server went away")

    seed(pg_engine, BATCH * 2, now=schema.utcnow())
    held = _Held(monkeypatch, first=refuse)
    held.release.set()
    dispatcher = _dispatcher(pg_engine)
    thread, out = _start(dispatcher, once=True)
    thread.join(PATIENCE_S)
    dispatcher.close()
    assert out == [BATCH * 2]
    assert "recording results failed" in caplog.text
    assert statuses(pg_engine) == {S.IN_FLIGHT: BATCH, S.SUCCEEDED: BATCH}
    assert dispatcher._in_flight == 0  # the pass's rows are no longer counted as held
    settled = store.expire_leases(
        pg_engine,
        capabilities_for=lambda name: HONOURS,
        max_attempts=5,
        now=schema.utcnow() + timedelta(minutes=2),
    )
    assert settled == BATCH
    assert statuses(pg_engine) == {S.PENDING: BATCH, S.SUCCEEDED: BATCH}


def test_a_crash_with_a_batch_behind_is_settled_by_the_lease(pg_engine, monkeypatch) -> None:
    """The process dies while its batch behind is being written: nothing is lost or
    invented; the rows go back with their keys once the lease ends."""

    def die() -> None:
        raise _Crash()

    ids = seed(pg_engine, BATCH * 2, now=schema.utcnow())
    keys = {i: r.effect_key for i, r in rows(pg_engine).items()}
    held = _Held(monkeypatch, first=die)
    dispatcher = _dispatcher(pg_engine)
    thread, out = _start(dispatcher, once=True)
    assert held.holding.wait(PATIENCE_S)
    held.release.set()
    thread.join(PATIENCE_S)
    dispatcher.close()
    assert len(out) == 1 and isinstance(out[0], _Crash)
    # The batch behind and the pass that found the crash: both in flight, as a
    # dead process leaves whatever it held.
    dead = {i: r for i, r in rows(pg_engine).items() if r.status == S.IN_FLIGHT}
    assert set(dead) == set(ids)
    assert all(attempts(pg_engine, i)[-1].finished_at is None for i in dead)  # the evidence
    settled = store.expire_leases(
        pg_engine,
        capabilities_for=lambda name: HONOURS,
        max_attempts=5,
        now=schema.utcnow() + timedelta(minutes=2),
    )
    assert settled == BATCH * 2
    after = rows(pg_engine)
    assert {i for i in ids if after[i].status == S.PENDING} == set(dead)
    assert {i: r.effect_key for i, r in after.items()} == keys  # never a fresh key
