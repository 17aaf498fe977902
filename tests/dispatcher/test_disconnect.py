"""Terminated server connections: the dispatcher's claim and result write have no pre-ping.

PostgreSQL only: ``pg_terminate_backend`` kills every server process of the
test database (the pool's and the LISTEN connection), as a restart would. A
claim or a result write that meets a dead pooled connection before COMMIT runs
again on a new one; the loop keeps going either way.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from adapters import DeliveryRequest, DeliveryResult
from outbox import db, faults, schema, settings
from outbox.delivery.dispatcher import Dispatcher
from outbox.states import AttemptOutcome, EffectStatus
from tests.dispatcher.support import attempts, seed, statuses, terminate_backends
from tests.dispatcher.test_dispatcher import fake
from tests.support.patience import PATIENCE_S

S = EffectStatus


@pytest.fixture(autouse=True)
def _postgres_only(backend: str) -> None:
    if backend != "postgres":
        pytest.skip("a server connection to terminate is PostgreSQL's")


def _all_delivered(engine: sa.Engine, ids: list[int]) -> None:
    assert statuses(engine) == {S.SUCCEEDED: len(ids)}
    for effect_id in ids:
        (a,) = attempts(engine, effect_id)
        assert (a.outcome, a.late) == (AttemptOutcome.DELIVERED, False)


def test_a_claim_on_a_terminated_connection_runs_again(engine, clock, make_dispatcher) -> None:
    dispatcher = make_dispatcher(fake(), claim_batch_size=3)
    ids = seed(engine, 6, now=clock())
    assert dispatcher.run_once(now=clock()) == 3  # the pool now holds used connections
    assert terminate_backends(engine) >= 1
    assert dispatcher.run_once(now=clock()) == 3
    _all_delivered(engine, ids)


def test_results_are_recorded_when_the_connection_dies_after_the_claim(
    engine, clock, make_dispatcher
) -> None:
    dispatcher = make_dispatcher(fake())
    ids = seed(engine, 4, now=clock())
    faults.arm("dispatch.after_attempt_commit", lambda: terminate_backends(engine))
    try:
        assert dispatcher.run_once(now=clock()) == 4
    finally:
        faults.disarm()
    _all_delivered(engine, ids)
    assert dispatcher.late_results == 0


def _delivering() -> tuple[list[str], Any]:
    """A step that notes each delivered key, and the list it notes them in."""
    delivered: list[str] = []

    def step(request: DeliveryRequest) -> DeliveryResult:
        delivered.append(request.effect_key)
        return DeliveryResult.delivered(f"ref-{request.effect_id}", status_code=201)

    return delivered, step


@contextlib.contextmanager
def _looping(
    engine: sa.Engine, dispatcher: Dispatcher
) -> Iterator[tuple[sa.Engine, threading.Thread]]:
    """``dispatcher.run()`` on a thread, and another engine to add rows through
    (a ping in the dispatcher's own would heal its pool); stopped and checked after."""
    other = db.create_engine(
        settings.load(), url=engine.url.render_as_string(hide_password=False), poolclass=NullPool
    )
    ready = threading.Event()
    thread = threading.Thread(target=dispatcher.run, kwargs={"ready": ready})
    thread.start()
    try:
        assert ready.wait(PATIENCE_S)
        yield other, thread
    finally:
        dispatcher.request_stop()
        thread.join(10)
        other.dispose()
    assert not thread.is_alive()


def test_the_loop_outlives_terminated_connections(engine, make_dispatcher) -> None:
    delivered, step = _delivering()
    dispatcher = make_dispatcher(fake(*[step] * 20), poll_interval=0.2)
    with _looping(engine, dispatcher) as (other, thread):
        ids = seed(other, 2, now=schema.utcnow(), prefix="a")
        _wait_for_count(delivered, 2)
        for round_ in range(3):
            assert terminate_backends(engine) >= 1
            ids += seed(other, 2, now=schema.utcnow(), prefix=f"r{round_}")
            _wait_for_count(delivered, len(ids))
        assert thread.is_alive()
    _all_delivered(engine, ids)


def _wait_for_count(delivered: list[str], count: int) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while len(delivered) < count:
        assert time.monotonic() < deadline, "the dispatcher did not deliver in time"
        time.sleep(0.05)


class _Remembered(threading.Event):
    """The dispatcher's "listening" flag, remembering that it was ever cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = threading.Event()

    def clear(self) -> None:
        self.dropped.set()
        super().clear()


def test_the_listen_connection_comes_back_and_wakes_the_loop(engine, make_dispatcher) -> None:
    """The LISTEN connection dies with the others: the loop notices (no busy
    loop on the dead socket), connects again, and a NOTIFY wakes it with the
    poll far away (longer than any wait here)."""
    delivered, step = _delivering()
    passes: list[int] = []
    dispatcher = make_dispatcher(fake(*[step] * 4), poll_interval=PATIENCE_S * 10)
    # The loop connects again 0.1 s after it drops the connection: faster than a busy
    # machine may let this thread look at the flag, so the drop is kept as an event.
    listening = _Remembered()
    dispatcher._listening = listening
    real_pass = dispatcher._run_pass

    def counting(now, **how):  # type: ignore[no-untyped-def]
        passes.append(1)
        return real_pass(now, **how)

    dispatcher._run_pass = counting  # type: ignore[method-assign]
    with _looping(engine, dispatcher) as (other, _thread):
        assert listening.wait(PATIENCE_S)
        listening.dropped.clear()
        assert terminate_backends(engine) >= 1
        # The loop finds the socket closed and drops it.
        assert listening.dropped.wait(PATIENCE_S), "the lost LISTEN connection went unnoticed"
        # The loop connects again by itself: its next attempt, not the poll, ends its wait.
        assert dispatcher._listening.wait(PATIENCE_S), "the LISTEN connection did not come back"
        time.sleep(0.3)
        before = len(passes)
        ids = seed(other, 2, now=schema.utcnow())
        _wait_for_count(delivered, 2)
        assert 1 <= len(passes) - before <= 4, f"{len(passes) - before} passes for one NOTIFY"
    _all_delivered(engine, ids)


def test_the_loop_claims_on_one_held_connection_and_gives_it_back(
    engine, make_dispatcher, monkeypatch
) -> None:
    """``run()``'s claims skip the pool's checkout and return (``db.Pinned``): every pass
    claims on one connection, which goes back to the pool when the loop stops."""
    used: list[int] = []
    real = db.Pinned.autocommit

    def noted(self: db.Pinned, body: Any) -> Any:
        result = real(self, body)
        assert self._held is not None
        used.append(id(self._held.connection.dbapi_connection))
        return result

    monkeypatch.setattr(db.Pinned, "autocommit", noted)
    delivered, step = _delivering()
    dispatcher = make_dispatcher(fake(*[step] * 6), poll_interval=0.2)
    with _looping(engine, dispatcher) as (other, _thread):
        for wave in range(3):
            seed(other, 2, now=schema.utcnow(), prefix=f"w{wave}")
            _wait_for_count(delivered, 2 * (wave + 1))
    assert len(used) >= 3 and len(set(used)) == 1
    assert db.in_use(engine) == 0
