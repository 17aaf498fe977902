"""The wake-up's gate (PostgreSQL): creates notify only while a dispatcher may sleep.

A NOTIFY serialises its commit with every other notifying commit in the
cluster; while every dispatcher is busy, or none runs, nobody listens for it.
The trigger reads ``dispatch_wakeup`` under a shared advisory lock and notifies only when a
dispatcher has counted itself in. What must never happen is a lost wake-up: a
dispatcher asleep while a committed row waits for the poll. These tests hold
the two sides of that: the count-in waits for a create that read zero, and a
dispatcher that counted itself out under a backlog counts in again before it
sleeps, and is then woken by the next create.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

import adapters
from adapters import DeliveryRequest, DeliveryResult
from adapters.testing import FakeAdapter
from outbox import Outbox, db, faults, schema, settings
from outbox.delivery import wakeup
from outbox.delivery.dispatcher import Dispatcher
from tests.dispatcher.conftest import TEST_SETTINGS
from tests.dispatcher.support import seed, statuses
from tests.support import notify
from tests.support.patience import PATIENCE_S, until

pytestmark = pytest.mark.postgres

TOOL = "create_support_task"
HONOURS = adapters.Capabilities(True, True, 2.0)


@pytest.fixture
def pg_engine(postgres_url: str) -> Iterator[Engine]:
    engine = db.create_engine(settings.load(), url=postgres_url)
    yield engine
    engine.dispose()


def _sleepers(engine: Engine) -> int:
    with db.read(engine) as conn:
        return int(conn.execute(sa.select(schema.dispatch_wakeup.c.sleepers)).scalar_one())


def _set_sleepers(engine: Engine, count: int) -> None:
    with db.write(engine) as conn:
        conn.execute(sa.update(schema.dispatch_wakeup).values(sleepers=count))


def _dispatcher_polling_rarely(engine: Engine) -> tuple[Dispatcher, threading.Event]:
    """A dispatcher whose poll is ten patiences away (only a NOTIFY, or the look after
    counting in, delivers in time), and the event its one delivery sets."""
    delivered = threading.Event()

    def step(request: DeliveryRequest) -> DeliveryResult:
        delivered.set()
        return DeliveryResult.delivered(f"T-{request.effect_id}", status_code=201)

    adapter = FakeAdapter(name="helpdesk", capabilities=HONOURS, script=[step])
    config = settings.load(**{**TEST_SETTINGS, "poll_interval": PATIENCE_S * 10})
    return Dispatcher(engine, adapters.Registry([adapter]), config, worker_id="w1"), delivered


def test_the_trigger_notifies_only_while_a_dispatcher_is_counted_in(postgres_url: str, clock):
    with Outbox(postgres_url, clock=clock) as box, notify.listener(postgres_url) as listener:
        box.create_tenant("acme")
        assert _sleepers(box.engine) == 0  # as migrated: nobody sleeps yet
        box.execute("acme", "op-1", TOOL, {"subject": "s"})
        assert notify.notifications(listener, postgres_url) == 0
        _set_sleepers(box.engine, 2)
        box.execute("acme", "op-2", TOOL, {"subject": "s"})
        assert notify.notifications(listener, postgres_url) == 1
        with db.write(box.engine) as conn:  # a missing row fails open: notify
            conn.execute(sa.delete(schema.dispatch_wakeup))
        box.execute("acme", "op-3", TOOL, {"subject": "s"})
        assert notify.notifications(listener, postgres_url) == 1


def test_counting_in_waits_for_a_create_that_saw_no_sleeper(postgres_url: str, clock):
    """The create read zero and will not notify; the count-in waits for its commit,
    so the dispatcher's look after counting in finds its row."""
    with Outbox(postgres_url, clock=clock) as box, notify.listener(postgres_url) as listener:
        box.create_tenant("acme")
        box.tools.needs_transaction.add(TOOL)  # the create holds its transaction open
        inside, release = threading.Event(), threading.Event()

        def pause() -> None:
            inside.set()
            assert release.wait(PATIENCE_S)

        faults.arm("create.after_operation_insert", pause)
        creating = threading.Thread(
            target=box.execute, args=("acme", "op-1", TOOL, {"subject": "s"})
        )
        creating.start()
        gate = wakeup.Gate(box.engine, worker="w1")
        pid = listener.info.backend_pid  # the LISTEN connection it would sleep on
        counting = threading.Thread(target=gate.count_in, args=(pid,))
        try:
            assert inside.wait(PATIENCE_S)  # its row is written, the gate's row share-locked
            counting.start()

            def waiting() -> bool:
                with db.read(box.engine) as conn:
                    return bool(
                        conn.exec_driver_sql(
                            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a"
                            " ON a.pid = l.pid WHERE NOT l.granted"
                            " AND a.datname = current_database()"
                        ).scalar_one()
                    )

            until(waiting, "the count-in waits for the create's lock")
            assert counting.is_alive() and not gate.counted
        finally:
            release.set()
            creating.join(PATIENCE_S)
            counting.join(PATIENCE_S)
        assert gate.counted and _sleepers(box.engine) == 1
        # The create committed before the count went up: the look after it sees the row.
        assert statuses(box.engine) == {"pending": 1}
        assert notify.notifications(listener, postgres_url) == 0
        box.execute("acme", "op-2", TOOL, {"subject": "s"})  # after the count: notifies
        assert notify.notifications(listener, postgres_url) == 1
        gate.count_out()
        assert _sleepers(box.engine) == 0


def test_a_dispatcher_counts_out_under_a_backlog_and_in_again_before_it_sleeps(
    pg_engine: Engine, monkeypatch
) -> None:
    """With the poll a long way off, every delivery here is woken by a NOTIFY or
    found by the look after counting in: never by the poll."""
    calls: list[str] = []
    real_in, real_out = wakeup.Gate.count_in, wakeup.Gate.count_out

    def count_in(self: wakeup.Gate, pid: int) -> bool:
        calls.append("in")
        return real_in(self, pid)

    def count_out(self: wakeup.Gate) -> None:
        if self.counted:
            calls.append("out")
        real_out(self)

    monkeypatch.setattr(wakeup.Gate, "count_in", count_in)
    monkeypatch.setattr(wakeup.Gate, "count_out", count_out)
    delivered: list[int] = []
    lock = threading.Lock()

    def step(request: DeliveryRequest) -> DeliveryResult:
        with lock:
            delivered.append(request.effect_id)
        return DeliveryResult.delivered(f"T-{request.effect_id}", status_code=201)

    adapter = FakeAdapter(name="helpdesk", capabilities=HONOURS, script=[step] * 100)
    config = settings.load(
        **{**TEST_SETTINGS, "poll_interval": PATIENCE_S * 10, "claim_batch_size": 5}
    )
    dispatcher = Dispatcher(pg_engine, adapters.Registry([adapter]), config, worker_id="w1")
    ready = threading.Event()
    thread = threading.Thread(target=dispatcher.run, kwargs={"ready": ready})
    thread.start()
    try:
        assert ready.wait(PATIENCE_S)
        until(lambda: _sleepers(pg_engine) == 1, "the idle dispatcher counts itself in")
        seed(pg_engine, 1, now=schema.utcnow(), prefix="one")
        until(lambda: len(delivered) == 1, "one create wakes the sleeping dispatcher")
        # A backlog of 40 in one commit: the passes come back full, the dispatcher
        # counts itself out, drains it, and counts in again before it sleeps.
        seed(pg_engine, 40, now=schema.utcnow(), prefix="many")
        until(lambda: len(delivered) == 41, "the backlog drains")
        until(lambda: _sleepers(pg_engine) == 1, "counted in again once idle")
        assert "out" in calls and calls[-1] == "in"
        seed(pg_engine, 1, now=schema.utcnow(), prefix="last")
        until(lambda: len(delivered) == 42, "the next create wakes it again")
    finally:
        dispatcher.request_stop()
        thread.join(PATIENCE_S)
        dispatcher.close()
    assert not thread.is_alive()
    assert _sleepers(pg_engine) == 0  # counted out as it stopped
    assert sorted(delivered) == sorted(set(delivered))  # each once


def test_a_row_committed_just_before_the_count_in_is_found_by_the_look_after_it(
    pg_engine: Engine, monkeypatch
) -> None:
    """The race the look after counting in closes: a create reads zero (no NOTIFY)
    and commits after the dispatcher's last pass but before its count-in."""
    real_in = wakeup.Gate.count_in
    raced: list[int] = []

    def count_in(self: wakeup.Gate, pid: int) -> bool:
        if not raced:
            assert _sleepers(pg_engine) == 0
            raced.extend(seed(pg_engine, 1, now=schema.utcnow(), prefix="race"))
        return real_in(self, pid)

    monkeypatch.setattr(wakeup.Gate, "count_in", count_in)
    dispatcher, delivered = _dispatcher_polling_rarely(pg_engine)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        assert delivered.wait(PATIENCE_S), "the row waited for the poll: a lost wake-up"
    finally:
        dispatcher.request_stop()
        thread.join(PATIENCE_S)
        dispatcher.close()
    assert raced and statuses(pg_engine) == {"succeeded": 1}


# --- a dispatcher that dies counted in ---------------------------------------------------


def _counted(engine: Engine) -> set[int]:
    """The LISTEN backends counted in (``dispatch_sleepers``)."""
    with db.read(engine) as conn:
        return set(conn.execute(sa.select(schema.dispatch_sleepers.c.pid)).scalars())


def _gone(engine: Engine, pid: int) -> bool:
    with db.read(engine) as conn:
        return not conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %(pid)s", {"pid": pid}
        ).scalar_one()


def test_a_dispatcher_that_died_counted_in_is_dropped_at_the_next_count_in(
    postgres_url: str, clock
) -> None:
    """0008 kept a bare count: a dispatcher killed while counted in left it high for
    good, and every create notified from then on. Its LISTEN connection dies with it;
    the next count-in of any dispatcher drops its row and recounts."""
    with Outbox(postgres_url, clock=clock) as box, notify.listener(postgres_url) as listener:
        box.create_tenant("acme")
        dead = notify.listener(postgres_url)  # the LISTEN connection of one that dies
        dead_pid = dead.info.backend_pid
        assert wakeup.Gate(box.engine, worker="dies").count_in(dead_pid)
        assert (_sleepers(box.engine), _counted(box.engine)) == (1, {dead_pid})
        dead.close()  # killed: no count-out, and its backend ends
        until(lambda: _gone(box.engine, dead_pid), "the dead dispatcher's backend ends")
        box.execute("acme", "op-1", TOOL, {"subject": "s"})
        assert notify.notifications(listener, postgres_url) == 1  # still counted: it costs

        alive = wakeup.Gate(box.engine, worker="lives")
        assert alive.count_in(listener.info.backend_pid)
        assert (_sleepers(box.engine), _counted(box.engine)) == (1, {listener.info.backend_pid})
        alive.count_out()
        assert (_sleepers(box.engine), _counted(box.engine)) == (0, set())
        box.execute("acme", "op-2", TOOL, {"subject": "s"})
        assert notify.notifications(listener, postgres_url) == 0  # nobody sleeps: no NOTIFY


def test_a_row_whose_pid_now_belongs_to_a_later_backend_is_dropped(postgres_url: str) -> None:
    """Pids are reused: a row counts only while its backend is the one that started
    when it was written."""
    engine = db.create_engine(settings.load(), url=postgres_url)
    try:
        with notify.listener(postgres_url) as reused, notify.listener(postgres_url) as own:
            with db.write(engine) as conn:
                conn.execute(
                    sa.insert(schema.dispatch_sleepers).values(
                        pid=reused.info.backend_pid,
                        backend_start=schema.utcnow() - timedelta(days=3),
                        worker="long-gone",
                        since=schema.utcnow() - timedelta(days=3),
                    )
                )
                conn.execute(sa.update(schema.dispatch_wakeup).values(sleepers=1))
            gate = wakeup.Gate(engine, worker="w1")
            assert gate.count_in(own.info.backend_pid)
            assert (_sleepers(engine), _counted(engine)) == (1, {own.info.backend_pid})
    finally:
        engine.dispose()


def test_a_count_in_for_a_backend_that_ended_is_not_believed(postgres_url: str) -> None:
    engine = db.create_engine(settings.load(), url=postgres_url)
    try:
        ended = notify.listener(postgres_url)
        pid = ended.info.backend_pid
        ended.close()
        until(lambda: _gone(engine, pid), "the backend ends")
        gate = wakeup.Gate(engine, worker="w1")
        assert not gate.count_in(pid)
        assert (gate.counted, gate.pid) == (False, None)
        assert (_sleepers(engine), _counted(engine)) == (0, set())
    finally:
        engine.dispose()


def test_a_new_listen_connection_counts_in_again_under_its_own_pid(
    pg_engine: Engine,
) -> None:
    """The LISTEN connection is lost (here: terminated) and connected again, as a new
    backend: the dispatcher counts the old pid out and the new one in, and the next
    create wakes it (the poll is a long way off)."""
    dispatcher, delivered = _dispatcher_polling_rarely(pg_engine)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        until(lambda: bool(_counted(pg_engine)), "the idle dispatcher counts itself in")
        (old,) = _counted(pg_engine)
        with db.read(pg_engine) as conn:
            assert conn.exec_driver_sql("SELECT pg_terminate_backend(%(p)s)", {"p": old}).scalar()
        until(
            lambda: len(c := _counted(pg_engine)) == 1 and old not in c,
            "counted in again under the new LISTEN connection",
        )
        assert _sleepers(pg_engine) == 1
        seed(pg_engine, 1, now=schema.utcnow(), prefix="after")
        assert delivered.wait(PATIENCE_S), "the row waited for the poll: a lost wake-up"
    finally:
        dispatcher.request_stop()
        thread.join(PATIENCE_S)
        dispatcher.close()
    assert (_sleepers(pg_engine), _counted(pg_engine)) == (0, set())


def test_a_count_in_whose_reply_was_lost_is_written_once_when_it_runs_again(
    postgres_url: str,
) -> None:
    """A count-in that committed but was not believed (its reply lost) runs again: it
    deletes its own pid's row before writing it, so the count stays one."""
    engine = db.create_engine(settings.load(), url=postgres_url)
    try:
        with notify.listener(postgres_url) as listening:
            pid = listening.info.backend_pid
            gate = wakeup.Gate(engine, worker="w1")
            assert gate.count_in(pid)
            gate.pid = None  # the reply was lost: the loop does not believe it
            assert gate.count_in(pid)
            assert (_sleepers(engine), _counted(engine)) == (1, {pid})
    finally:
        engine.dispose()


def test_two_dispatchers_counting_in_at_once_are_both_counted(postgres_url: str) -> None:
    """The lock serialises them: each recounts after the other's commit."""
    engine = db.create_engine(settings.load(), url=postgres_url)
    try:
        with notify.listener(postgres_url) as one, notify.listener(postgres_url) as two:
            gates = [wakeup.Gate(engine, worker=f"w{i}") for i in (1, 2)]
            pids = [one.info.backend_pid, two.info.backend_pid]
            start = threading.Barrier(2)
            results: list[bool] = []

            def count_in(gate: wakeup.Gate, pid: int) -> None:
                start.wait(PATIENCE_S)
                results.append(gate.count_in(pid))

            threads = [
                threading.Thread(target=count_in, args=pair)
                for pair in zip(gates, pids, strict=True)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(PATIENCE_S)
            assert results == [True, True]
            assert (_sleepers(engine), _counted(engine)) == (2, set(pids))
            gates[0].count_out()
            assert (_sleepers(engine), _counted(engine)) == (1, {pids[1]})
    finally:
        engine.dispose()
