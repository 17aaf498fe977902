"""How the dispatcher's loop waits: for a wake-up, or for a NOTIFY, on its own thread.

``Waker`` is ``threading.Event``'s set / clear / is_set, with a ``wait`` that
also returns when a file descriptor is readable. ``Listener`` is the loop's
LISTEN connection (PostgreSQL), connected again with backoff when it is lost.
The loop waits on both at once, so a NOTIFY wakes the thread that claims,
with no hand-off from a listening thread: at 200 creates/s that hand-off was
70 to 80 us of a delivery's 0.8 ms median latency.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from typing import Any

import sqlalchemy as sa

from outbox import db, schema

logger = logging.getLogger("outbox.dispatcher")

CONNECT_TIMEOUT_SECONDS = 2  # the loop's own thread connects: never for long
RETRY_FIRST_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0


class Waker:
    """A wake-up flag that a ``select`` can wait on (a self-pipe).

    ``set`` may come from any thread, before, during or after ``wait``; the
    pipe exists only while the loop runs (``open``/``close``), so a waker
    that is never waited on holds no file descriptor.
    """

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None

    def open(self) -> None:
        with self._lock:
            if self._pipe is None:
                read, write = os.pipe()
                os.set_blocking(read, False)
                os.set_blocking(write, False)
                self._pipe = (read, write)
                if self._flag:
                    os.write(write, b"\0")

    def close(self) -> None:
        with self._lock:
            if self._pipe is not None:
                for fd in self._pipe:
                    os.close(fd)
                self._pipe = None

    def set(self) -> None:
        self._flag = True
        with self._lock:  # never write to a pipe being closed (its number may be reused)
            if self._pipe is not None:
                with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending
                    os.write(self._pipe[1], b"\0")

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        """Forget the wake-ups so far (a spurious one may remain: a pass too many, never one too few)."""
        self._flag = False
        pipe = self._pipe
        if pipe is not None:
            try:
                while os.read(pipe[0], 4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    def wait(self, timeout: float, also: int | None = None) -> bool:
        """Until set, ``also`` is readable, or ``timeout`` seconds: False if it timed out."""
        if self._flag:
            return True
        self.open()
        assert self._pipe is not None
        fds = [self._pipe[0]] if also is None else [self._pipe[0], also]
        readable, _, _ = select.select(fds, [], [], timeout)
        return self._flag or bool(readable)


class Listener:
    """PostgreSQL: the loop's LISTEN connection. Used from the loop's thread only.

    ``fileno()`` connects when the connection is down and a retry is due
    (backoff from 0.1 s to 5 s), and gives the socket to wait on, or None while
    down: the loop then polls, waking for the next attempt at the latest
    (``retry_in``). A new connection sets ``woken``: rows may have
    committed before LISTEN took effect. ``drain()`` reads the NOTIFYs that
    have arrived, without waiting; a lost connection is dropped there.
    """

    def __init__(
        self,
        params: str | dict[str, Any],
        channel: str,
        *,
        woken: Waker,
        listening: threading.Event,
        worker: str,
    ) -> None:
        # A conninfo string, or ``psycopg.connect`` keyword arguments (``db.libpq_params``).
        self._params: dict[str, Any] = {"conninfo": params} if isinstance(params, str) else params
        self._channel = channel
        self._woken = woken
        self._listening = listening
        self._worker = worker
        self._conn: Any = None
        self._retry_at = 0.0
        self._delay = RETRY_FIRST_SECONDS

    def fileno(self) -> int | None:
        if self._conn is None and time.monotonic() >= self._retry_at:
            self._connect()
        return None if self._conn is None else int(self._conn.fileno())

    @property
    def backend_pid(self) -> int | None:
        """The LISTEN connection's backend at the server, while connected."""
        return None if self._conn is None else int(self._conn.info.backend_pid)

    def retry_in(self) -> float | None:
        """While down: seconds until the next connection attempt (the loop waits no longer)."""
        if self._conn is not None:
            return None
        return max(0.0, self._retry_at - time.monotonic())

    def drain(self) -> None:
        if self._conn is None:
            return
        import psycopg

        try:
            for _ in self._conn.notifies(timeout=0):
                pass
        except psycopg.Error as error:
            self._lost(error)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._listening.clear()

    def _connect(self) -> None:
        import psycopg

        try:
            params = {"connect_timeout": CONNECT_TIMEOUT_SECONDS, **self._params}
            conn = psycopg.connect(**params, autocommit=True)
            try:
                conn.execute(f"LISTEN {self._channel}")
            except BaseException:
                conn.close()
                raise
        except psycopg.Error as error:
            self._lost(error)
            return
        self._conn = conn
        self._delay = RETRY_FIRST_SECONDS
        self._listening.set()
        self._woken.set()  # rows may have committed before LISTEN took effect

    def _lost(self, error: BaseException) -> None:
        logger.warning(
            "LISTEN connection lost; polling until it is back",
            exc_info=error,
            extra={"worker": self._worker},
        )
        if self._conn is not None:
            with contextlib.suppress(Exception):  # it is gone either way
                self._conn.close()
            self._conn = None
        self._listening.clear()
        self._retry_at = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, RETRY_MAX_SECONDS)


class Gate:
    """PostgreSQL: this dispatcher's place among the sleepers (``schema.dispatch_wakeup``).

    The wake-up trigger notifies only while the count is above zero. The loop
    counts itself in before it sleeps on LISTEN, then looks once more: the
    count-in takes the advisory lock the trigger holds shared, so it waits for
    every create that read the count before it, and that look sees their rows;
    every create after it notifies. It counts
    itself out while a backlog keeps it busy (its passes come back full), when
    no create needs to notify on its account.

    A count-in writes this dispatcher's row in ``dispatch_sleepers``, keyed by the
    backend pid of its LISTEN connection; every count-in and count-out deletes the
    rows whose backend is gone and sets the count to the rows left. So a dispatcher
    killed while counted in (its LISTEN connection dies with it) is dropped at the
    next count-in of any dispatcher, instead of making every create notify for good.
    A new LISTEN connection is a new pid: the loop counts out and in again.

    Errors lean to notifying too much: a count-in whose outcome is unknown is
    not believed (the loop sleeps no longer than its poll interval, and counts
    in again next time: at worst one too many), and a count-out is believed
    whether or not it committed (at worst its row stays until this dispatcher
    counts in again, or its LISTEN connection ends).
    """

    _LOCK = sa.text(f"SELECT pg_advisory_xact_lock({schema.WAKEUP_LOCK})")
    # A row whose backend has ended, or whose pid now belongs to a later backend.
    # ``backend_start`` is NULL in other roles' rows without pg_read_all_stats:
    # then a live pid is trusted (a reused one costs notifications, no more).
    _PRUNE = sa.text(
        "DELETE FROM dispatch_sleepers AS s WHERE s.pid = :pid OR NOT EXISTS ("
        "SELECT 1 FROM pg_stat_activity AS a WHERE a.pid = s.pid"
        " AND (a.backend_start IS NULL OR a.backend_start = s.backend_start))"
    )
    _IN = sa.text(
        "INSERT INTO dispatch_sleepers (pid, backend_start, worker, since)"
        " SELECT a.pid, a.backend_start, :worker, now() FROM pg_stat_activity AS a"
        " WHERE a.pid = :pid"
    )
    _COUNT = sa.text(
        "UPDATE dispatch_wakeup SET sleepers = (SELECT count(*) FROM dispatch_sleepers)"
        " WHERE id = 1"
    )

    def __init__(self, engine: Any, *, worker: str) -> None:
        self._engine = engine
        self._worker = worker
        self.pid: int | None = None  # the LISTEN backend counted in, while counted

    @property
    def counted(self) -> bool:
        return self.pid is not None

    def count_in(self, pid: int) -> bool:
        """True when counted in: then a NOTIFY will come for any later create.

        ``pid`` is the backend of the LISTEN connection the loop sleeps on; a
        count-in for a pid that no longer runs is not believed.
        """
        if self.pid != pid:
            self.count_out()  # a new LISTEN connection: the old pid's row goes
            if self._update(pid, enter=True):
                self.pid = pid
        return self.counted

    def count_out(self) -> None:
        if self.pid is not None:
            self._update(self.pid, enter=False)
            self.pid = None

    def _update(self, pid: int, *, enter: bool) -> bool:
        """Under the lock: drop the dead rows and ``pid``'s own, write it again when
        ``enter``, and recount. False when that failed, or ``pid``'s backend has ended."""
        params = {"pid": pid, "worker": self._worker}
        try:
            with db.write(self._engine) as conn:
                conn.execute(self._LOCK)
                conn.execute(self._PRUNE, params)
                entered = enter and conn.execute(self._IN, params).rowcount == 1
                conn.execute(self._COUNT)
        except Exception:
            logger.warning(
                "could not update the wake-up gate; polling meanwhile",
                exc_info=True,
                extra={"worker": self._worker},
            )
            return False
        return entered or not enter
