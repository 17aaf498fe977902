# Longer than 500 lines on purpose: the engine set-up of both databases, the driver-level
# fast paths and the migration runner are the one place that knows each dialect's quirks.
"""Engines, transactions and the schema guard, for SQLite and PostgreSQL.

SQLite: WAL journal (readers never block the writer), ``foreign_keys=ON``, a
busy timeout, and every write transaction opened with ``BEGIN IMMEDIATE`` so
two writers serialise at BEGIN instead of failing at their first write. The
pysqlite driver opens transactions lazily and on its own terms, so we switch
that off (``isolation_level = None``) and emit BEGIN ourselves from the
``begin`` event: the recipe in SQLAlchemy's SQLite dialect documentation.

PostgreSQL: psycopg 3, timestamps in UTC, ``lock_timeout`` bounded by the busy
timeout so a write that waits on a lock answers Busy instead of hanging. A
connection taken from the pool is pinged first (a pooled connection can die
while idle: a server restart, ``pg_terminate_backend``), except in ``transact``,
the hot paths' transaction, which saves that round trip and instead runs its
body once more on a fresh connection when the first try found the connection
dead before anything was committed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.dialects.postgresql import psycopg as _psycopg
from sqlalchemy.dialects.sqlite import pysqlite as _pysqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import PoolProxiedConnection, QueuePool

from outbox import errors, schema
from outbox.settings import Settings

SQLITE_BEGIN_OPTION = "outbox_sqlite_begin"
_FRESH = "outbox_fresh"  # in a pool record's info: connected, not yet checked out
_NO_PING: contextvars.ContextVar[bool] = contextvars.ContextVar("outbox_no_ping", default=False)

T = TypeVar("T")


def normalise_url(url: str) -> sa.URL:
    """Accept ``postgresql://`` and ``postgres://`` and use psycopg 3 for them."""
    parsed = sa.make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def is_sqlite(engine_or_conn: Engine | Connection) -> bool:
    return engine_or_conn.dialect.name == "sqlite"


def create_engine(settings: Settings, *, url: str | None = None, **kwargs: Any) -> Engine:
    """The one engine factory. ``url`` overrides ``settings.database_url``."""
    parsed = normalise_url(url or settings.database_url)
    busy = settings.busy_timeout.total_seconds()
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, settings, busy, **kwargs)
    if parsed.get_backend_name() == "postgresql":
        return _postgres_engine(
            parsed, busy, pooled=settings.database_pooler == "transaction", **kwargs
        )
    raise errors.ConfigError(
        f"OUTBOX_DATABASE_URL: unsupported database {parsed.get_backend_name()!r}; "
        "use sqlite:///path.db or postgresql://user@host/db"
    )


def _sqlite_engine(parsed: sa.URL, settings: Settings, busy: float, **kwargs: Any) -> Engine:
    database = parsed.database
    if not database or database == ":memory:":
        raise errors.ConfigError(
            "OUTBOX_DATABASE_URL: an in-memory SQLite database cannot be shared between "
            "processes or connections; use a file, e.g. sqlite:///var/outbox.db"
        )
    Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(
        parsed,
        connect_args={"timeout": busy, "check_same_thread": False},
        **_pool_options(kwargs),
    )
    synchronous = settings.sqlite_synchronous
    busy_ms = int(busy * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let us, not the driver, decide when a transaction begins.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(SQLITE_BEGIN_OPTION, "IMMEDIATE")
        driver_execute(conn, f"BEGIN {mode}", ())

    return engine


def _postgres_engine(parsed: sa.URL, busy: float, *, pooled: bool, **kwargs: Any) -> Engine:
    connect_args: dict[str, Any] = {"application_name": "outbox"}
    if pooled:
        # Behind a pooler in transaction mode, consecutive transactions of one
        # connection run on different server sessions: a statement psycopg
        # prepared on one is unknown on the next ("prepared statement ... does
        # not exist"), and session settings sent at start-up are refused (PgBouncer
        # rejects the ``options`` parameter). So: no prepared statements, and the
        # time zone set with SET, which PgBouncer tracks and replays on every
        # server connection it lends us. lock_timeout is the database's setting
        # there (``ALTER DATABASE ... SET lock_timeout``, see docs/failover.md).
        connect_args["prepare_threshold"] = None
    else:
        connect_args["options"] = f"-c timezone=UTC -c lock_timeout={int(busy * 1000)}"
    pre_ping = kwargs.pop("pool_pre_ping", True)
    if "poolclass" not in kwargs:
        # Room for the parked connections on top of the pool's own: callers can still
        # check out pool_size + max_overflow while ``Parking.LIMIT`` are parked.
        _pool_options(kwargs)
        kwargs["poolclass"] = Parking
        if kwargs["max_overflow"] >= 0:
            kwargs["max_overflow"] += Parking.LIMIT
    engine = sa.create_engine(
        parsed,
        connect_args=connect_args,
        pool_pre_ping=False,  # ours below, which ``transact`` can skip
        **kwargs,
    )
    if pooled:

        @event.listens_for(engine, "connect")
        def _utc(dbapi_connection: Any, _record: Any) -> None:
            autocommit = dbapi_connection.autocommit
            dbapi_connection.autocommit = True
            try:
                dbapi_connection.execute("SET TIME ZONE 'UTC'")
            finally:
                dbapi_connection.autocommit = autocommit

    if pre_ping:
        _install_pre_ping(engine)
    return engine


def libpq_params(engine: Engine, url: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``psycopg.connect`` to the engine's database (or ``url``'s).

    For connections made outside the pool (the dispatchers' LISTEN): built by the
    dialect, so a multi-host URL (``?host=a:5432&host=b:5432`` or
    ``?host=a,b&port=5432,5432``) and ``target_session_attrs`` mean the same
    as they do for the pool.
    """
    parsed = normalise_url(url) if url else engine.url
    _args, params = engine.dialect.create_connect_args(parsed)
    params.pop("context", None)
    return dict(params)


def _install_pre_ping(engine: Engine) -> None:
    """SQLAlchemy's ``pool_pre_ping``, skipped inside ``transact``.

    As the built-in one: a connection just made is not pinged; one that fails
    the ping as a disconnect invalidates the pool (a restarted server killed
    them all) and the checkout goes on with a new connection.
    """
    dialect = engine.dialect

    @event.listens_for(engine, "connect")
    def _on_connect(_dbapi_connection: Any, record: Any) -> None:
        record.info[_FRESH] = True  # the record's info is cleared when it reconnects

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if record.info.pop(_FRESH, False) or _NO_PING.get():
            return
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as error:
            if dialect.is_disconnect(error, dbapi_connection, None):
                raise exc.InvalidatePoolError() from error
            raise


def _pool_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Room for a dispatcher's threads; no sizes when the caller picked a pool class."""
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_size", 16)
        kwargs.setdefault("max_overflow", 16)
    return kwargs


@contextlib.contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """A write transaction: ``BEGIN IMMEDIATE`` on SQLite. Commits on success."""
    with translate_errors(), engine.connect() as conn, conn.begin():
        yield conn


def transact(
    engine: Engine,
    body: Callable[[Connection], T],
    *,
    repeatable: Callable[[], bool] | None = None,
) -> T:
    """``body(conn)`` in a write transaction (as ``write``), without the pre-ping.

    The hot paths (a create, a dispatcher's claim and result write) save the
    ping's round trip. A pooled connection that died while idle then fails the
    first statement instead of the ping; when a try fails as a disconnect before
    COMMIT was sent, nothing was committed, and ``body`` runs once more on a new
    connection (SQLAlchemy has invalidated the dead one, and the pool's older
    ones with it). A disconnect during COMMIT is raised: the commit may have
    happened. ``repeatable()``, asked after a failed try, may refuse the second
    one (the body did something outside the transaction that must not happen
    twice).
    """
    committing = False

    def attempt() -> T:
        nonlocal committing
        committing = False
        with translate_errors(), _connect_unpinged(engine) as conn, conn.begin():
            result = body(conn)
            committing = True
        return result

    return _once_more_if_disconnected(
        attempt, lambda: not committing and (repeatable is None or repeatable())
    )


class Driver(Protocol):
    """What ``driver_execute`` needs: a SQLAlchemy ``Connection``, or a ``Direct``."""

    @property
    def dialect(self) -> sa.Dialect: ...

    @property
    def connection(self) -> PoolProxiedConnection: ...

    def invalidate(self, exception: BaseException | None = None) -> None: ...


class Direct:
    """A pooled driver connection without SQLAlchemy's ``Connection`` around it.

    For the hottest paths, whose statements all go through ``driver_execute``:
    a ``Connection``'s set-up, execution options and reset on return cost more
    than a create's own Python (measured: about 60 microseconds a call against
    a few for the pooled connection alone). ``autocommit`` and ``direct_write``
    hand one out and take it back.
    """

    __slots__ = ("_cursor", "connection", "dialect")

    def __init__(self, connection: PoolProxiedConnection, dialect: sa.Dialect) -> None:
        self.connection = connection
        self.dialect = dialect
        self._cursor: Any = None

    def cursor(self) -> Any:
        """One driver cursor for every statement on this connection.

        ``driver_execute``'s callers read each result before the next statement, so
        one cursor serves them all; a new psycopg cursor a statement (its adapters'
        map, its transformer) cost about 8 microseconds of a 30-parameter statement's
        60 in a tight loop."""
        cursor = self._cursor
        if cursor is None:
            cursor = self._cursor = self.connection.cursor()
        return cursor

    def invalidate(self, exception: BaseException | None = None) -> None:
        self._cursor = None
        self.connection.invalidate(exception)


def autocommit(engine: Engine, body: Callable[[Direct], T]) -> T:
    """``body(conn)`` on a connection where each statement commits alone (PostgreSQL).

    For one statement that is a whole transaction: no BEGIN and no COMMIT, one
    round trip. No pre-ping either: a pooled connection that died while idle
    fails the statement, and ``body`` runs once more on a new connection, so
    it must be safe to run twice (its statement may have committed before the
    connection died). ``body`` gets a ``Direct`` connection: its statements go
    through ``driver_execute``. On our engines the connection comes from, and
    goes back to, the pool's ``Parking`` when it can.
    """
    pool = engine.pool
    parking = pool if isinstance(pool, Parking) else None

    def attempt() -> T:
        conn = parking.take() if parking is not None else None
        if conn is None:
            conn = _unpinged(engine, autocommit=True)
        try:
            result = body(conn)
        except BaseException as error:
            _give_back(conn)
            # ``translate_errors``, written out: its context manager costs a create more
            # than this.
            if isinstance(error, exc.DBAPIError) and is_lock_error(error):
                raise errors.Busy() from error
            raise
        if parking is None or not parking.park(conn):
            _give_back(conn)
        return result

    return _once_more_if_disconnected(attempt, lambda: True)


def _unpinged(engine: Engine, *, autocommit: bool = False) -> Direct:
    """A pooled connection without the pre-ping, switched to autocommit if asked."""
    token = _NO_PING.set(True)
    try:
        conn = Direct(engine.raw_connection(), engine.dialect)
    finally:
        _NO_PING.reset(token)
    if autocommit:
        dbapi_connection: Any = conn.connection.dbapi_connection
        dbapi_connection.autocommit = True
    return conn


def _give_back(conn: Direct) -> None:
    """Out of autocommit, back to the pool (a dead connection is discarded by it)."""
    if conn.connection.is_valid:
        with contextlib.suppress(Exception):  # a dead one is discarded either way
            conn.connection.dbapi_connection.autocommit = False  # type: ignore[union-attr]
    conn.connection.close()


class Parking(QueuePool):
    """A ``QueuePool`` that keeps a few autocommit connections out for ``autocommit``.

    A create on PostgreSQL is one statement in autocommit. Taking its connection
    from the pool and giving it back, each with the switch in and out of
    autocommit and the pool's reset, cost a fifth of a create's Python (measured
    in interleaved blocks of creates: client CPU 206 against 265 us a create,
    wall 0.90x). So the connection of a finished call waits here, still checked
    out and in autocommit, for the next call from any thread (at most ``LIMIT``;
    the most recently used first).

    What the pool would do for it still happens, in other places:
    - capacity: our engines add ``LIMIT`` to ``max_overflow``, so the parked
      connections never take one a caller could have had;
    - a dead connection: ``autocommit`` has no pre-ping anyway; the first
      disconnect anywhere on the pool (``driver_execute``) gives every parked
      connection back, and the pool remakes each at its next checkout;
    - age: a connection parked longer than ``MAX_PARKED_S`` goes back to the
      pool instead of being used, so ``pool_recycle`` still applies;
    - ``dispose()`` (``Outbox.close``) closes them, and a call still running then
      gives its connection back instead of parking it; a forked child forgets its
      parent's without touching them (their sockets are the parent's).
    """

    LIMIT = 4
    MAX_PARKED_S = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parked: list[tuple[Direct, float]] = []
        self._parked_lock = threading.Lock()
        self._disposed = False
        _PARKINGS.add(self)

    def take(self) -> Direct | None:
        """The most recently parked connection, or None (then use the pool)."""
        with self._parked_lock:
            if not self._parked:
                return None
            conn, since = self._parked.pop()
        if time.monotonic() - since > self.MAX_PARKED_S:
            _give_back(conn)
            return None
        return conn

    def park(self, conn: Direct) -> bool:
        """Keep ``conn`` for the next call; False if it cannot be (give it back)."""
        dbapi_connection: Any = conn.connection.dbapi_connection
        if (
            not conn.connection.is_valid
            or dbapi_connection.pgconn.transaction_status != _IDLE
            or not dbapi_connection.autocommit
        ):
            return False
        with self._parked_lock:
            if self._disposed or len(self._parked) >= self.LIMIT:
                # Disposed (``Outbox.close`` while this call ran): nobody would close it.
                return False
            self._parked.append((conn, time.monotonic()))
        return True

    def parked(self) -> list[Direct]:
        """The connections waiting here now (for tests and diagnostics)."""
        with self._parked_lock:
            return [conn for conn, _ in self._parked]

    def give_back_parked(self) -> None:
        """Every parked connection back to the pool (after a disconnect, at dispose)."""
        with self._parked_lock:
            parked, self._parked = self._parked, []
        for conn, _ in parked:
            _give_back(conn)

    def dispose(self) -> None:
        with self._parked_lock:
            self._disposed = True
        self.give_back_parked()
        super().dispose()

    def _forget_parked(self) -> None:
        # After a fork, in the child: neither used nor closed (closing would end the
        # parent's sessions); kept referenced so the pool never sees them come back.
        _ABANDONED.extend(conn for conn, _ in self._parked)
        self._parked = []
        self._parked_lock = threading.Lock()


def in_use(engine: Engine) -> int:
    """Connections checked out of ``engine``'s pool by callers now (not parked ones)."""
    pool: Any = engine.pool
    parked = len(pool.parked()) if isinstance(pool, Parking) else 0
    return int(pool.checkedout()) - parked


_IDLE = 0  # psycopg.pq.TransactionStatus.IDLE
_PARKINGS: weakref.WeakSet[Parking] = weakref.WeakSet()
_ABANDONED: list[Direct] = []


def _forget_parked_in_child() -> None:
    for parking in list(_PARKINGS):
        parking._forget_parked()


os.register_at_fork(after_in_child=_forget_parked_in_child)


class Pinned:
    """``autocommit`` on one pooled connection held across calls (PostgreSQL).

    For a loop that runs one statement a pass from one thread (the dispatcher's
    claim): the pool's checkout and return, with the autocommit switch each way,
    cost about 50 microseconds a call, most of the Python around a one-row
    claim. The connection stays in autocommit while held. As with
    ``autocommit``, there is no pre-ping: a held connection that died while idle
    (a restarted server, an idle timeout) fails its statement, is dropped, and
    ``body`` runs once more on a new one, so it must be safe to run twice. Not
    for use from two threads at once.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._held: Direct | None = None

    def autocommit(self, body: Callable[[Direct], T]) -> T:
        def attempt() -> T:
            with translate_errors():
                conn = self._connection()
                try:
                    return body(conn)
                except exc.DBAPIError:
                    # Found dead (then invalidated), or refused (a lock timeout, a server
                    # made read-only by a failover): the next call starts from the pool.
                    self.close()
                    raise
                except BaseException:
                    # Interrupted mid-statement, the driver's state is unknown: drop it.
                    conn.invalidate()
                    self.close()
                    raise

        return _once_more_if_disconnected(attempt, lambda: True)

    def close(self) -> None:
        """Give the connection back to the pool, out of autocommit, if one is held."""
        held, self._held = self._held, None
        if held is not None:
            _give_back(held)

    def _connection(self) -> Direct:
        if self._held is None:
            self._held = _unpinged(self._engine, autocommit=True)
        return self._held


def direct_write(engine: Engine, body: Callable[[Direct], T]) -> T:
    """SQLite: ``body(conn)`` in a ``BEGIN IMMEDIATE`` transaction on a ``Direct`` connection.

    ``write`` without SQLAlchemy's ``Connection``: commits if ``body`` returns,
    rolls back if it raises. Its statements go through ``driver_execute``.
    """
    with translate_errors(), _direct(engine) as conn:
        driver_execute(conn, "BEGIN IMMEDIATE", ())
        try:
            result = body(conn)
        except BaseException:
            if conn.connection.is_valid:
                conn.connection.dbapi_connection.rollback()  # type: ignore[union-attr]
            raise
        driver_execute(conn, "COMMIT", ())
        return result


@contextlib.contextmanager
def _direct(engine: Engine) -> Iterator[Direct]:
    conn = _unpinged(engine)
    try:
        yield conn
    finally:
        conn.connection.close()


def _once_more_if_disconnected(attempt: Callable[[], T], repeatable: Callable[[], bool]) -> T:
    """``attempt()``, and once more if it failed on a connection SQLAlchemy found dead
    (it has invalidated that one, and the pool's older ones with it) and
    ``repeatable()`` allows it."""
    try:
        return attempt()
    except exc.DBAPIError as error:
        if not error.connection_invalidated or not repeatable():
            raise
    return attempt()


def _connect_unpinged(engine: Engine) -> Connection:
    token = _NO_PING.set(True)
    try:
        return engine.connect()
    finally:
        _NO_PING.reset(token)


# The dialects that render a statement as its driver's SQL, with named parameters.
_DRIVER_DIALECTS: dict[str, sa.Dialect] = {
    "postgresql": _psycopg.dialect(),  # type: ignore[no-untyped-call]
    "sqlite": _pysqlite.dialect(paramstyle="named"),
}


@functools.cache
def driver_sql(statement: sa.ClauseElement, backend: str) -> str:
    """``statement`` as SQL text for ``Connection.exec_driver_sql`` on ``backend``.

    For the hot paths: the statement stays defined once, in SQLAlchemy, and is
    rendered once per backend; executing the text skips SQLAlchemy's statement
    cache lookup and its per-parameter binding, which the caller then owns:
    plain values only (a ``StrEnum``'s value, a timezone-aware datetime on
    PostgreSQL, ``schema.sqlite_time`` text on SQLite). Parameters are named
    (``%(name)s`` / ``:name``) and passed as a mapping.
    """
    return str(statement.compile(dialect=_DRIVER_DIALECTS[backend]))


def driver_values(backend: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Plain values as the driver takes them, for ``driver_sql`` statements.

    An enum becomes its value; a naive datetime is refused, as
    ``schema.UTCDateTime`` refuses it, and on SQLite a datetime becomes the
    text that type stores.
    """
    sqlite = backend == "sqlite"
    out: dict[str, Any] = {}
    for name, value in values.items():
        if type(value) not in _PLAIN:  # most values have nothing to convert
            if isinstance(value, Enum):
                value = value.value
            elif isinstance(value, datetime):
                if value.tzinfo is None:
                    raise ValueError(
                        f"naive datetime {value!r}: pass a timezone-aware UTC datetime"
                    )
                if sqlite:
                    value = _sqlite_time(value)
        out[name] = value
    return out


_PLAIN = frozenset({str, int, float, bool, type(None), bytes})

# A create writes the same few instants (now, its deadlines) into several
# columns of several rows: each is converted once.
_sqlite_time = functools.lru_cache(maxsize=64)(schema.sqlite_time)


@functools.cache
def insert_sql(
    table: sa.Table, columns: tuple[str, ...], returning: str | None, backend: str
) -> str:
    """An INSERT of ``columns`` into ``table`` (RETURNING ``returning``), as ``driver_sql``."""
    statement = sa.insert(table).values(
        {name: sa.bindparam(name, type_=table.c[name].type) for name in columns}
    )
    if returning is not None:
        statement = statement.returning(table.c[returning])
    return driver_sql(statement, backend)


def insert_row(
    conn: Driver, table: sa.Table, values: Mapping[str, Any], returning: str | None = None
) -> Any:
    """Insert one row of plain values; return the ``returning`` column's value (or None).

    The statement is rendered once per table and set of columns and goes
    straight to the driver (``driver_sql``): for rows written on a hot path.
    """
    backend = conn.dialect.name
    sql = insert_sql(table, tuple(values), returning, backend)
    cursor = driver_execute(conn, sql, driver_values(backend, values))
    return cursor.fetchone()[0] if returning is not None else None


def driver_execute(
    conn: Driver, sql: str, params: Any, *, many: bool = False, prepare: bool | None = None
) -> Any:
    """Run ``sql`` on the connection's driver cursor; return the cursor.

    Errors come out as SQLAlchemy's (``exc.DBAPIError`` and its kinds), and a
    disconnect invalidates the connection, as ``Connection.execute`` would do.
    ``prepare`` (psycopg only): False plans the statement afresh on every call
    instead of letting the driver prepare it once it is frequent (None).
    """
    dbapi_connection = conn.connection.dbapi_connection
    assert dbapi_connection is not None
    cursor = conn.cursor() if type(conn) is Direct else dbapi_connection.cursor()
    try:
        if many:
            cursor.executemany(sql, params)
        elif prepare is not None:
            psycopg_cursor: Any = cursor  # DB-API's execute has no ``prepare``; psycopg's has
            psycopg_cursor.execute(sql, params, prepare=prepare)
        else:
            cursor.execute(sql, params)
    except conn.dialect.loaded_dbapi.Error as error:
        lost = conn.dialect.is_disconnect(error, dbapi_connection, cursor)
        if lost:
            _invalidate_pool(conn.connection, error)
            conn.invalidate(error)
        raise exc.DBAPIError.instance(
            sql,
            params,
            error,
            conn.dialect.loaded_dbapi.Error,
            connection_invalidated=lost,
            dialect=conn.dialect,
        ) from error
    return cursor


def _invalidate_pool(connection: PoolProxiedConnection, error: BaseException) -> None:
    """After a disconnect, have the pool remake every connection older than now.

    What SQLAlchemy's own ``Connection`` does when a statement finds its server
    gone: a restart or a failover dropped the pool's idle connections too, so each
    is made afresh at its next checkout instead of failing its next statement.
    Without it, the one retry of a create (which has no pre-ping) draws the next
    dead connection of the pool and the caller gets the error.
    """
    proxied: Any = connection  # the pool that lent it is not in the public type
    pool = proxied._pool
    pool._invalidate(connection, error, _checkin=False)
    if isinstance(pool, Parking):
        # Parked connections are checked out, out of the invalidation's reach: back
        # to the pool, which remakes them (older than now) at their next checkout.
        pool.give_back_parked()


@contextlib.contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    """A read transaction: deferred on SQLite, so readers never queue for the write lock."""
    with translate_errors(), engine.connect() as conn:
        if is_sqlite(conn):
            conn.execution_options(**{SQLITE_BEGIN_OPTION: "DEFERRED"})
        with conn.begin():
            yield conn


def is_lock_error(error: BaseException) -> bool:
    """Lock waits that ran out: SQLite 'database is locked', PostgreSQL lock/serialisation."""
    orig = getattr(error, "orig", None)
    if orig is None:
        return False
    text = str(orig).lower()
    if "database is locked" in text or "database table is locked" in text:
        return True
    sqlstate = getattr(orig, "sqlstate", None)
    # 55P03 lock_not_available, 40001 serialization_failure, 40P01 deadlock_detected
    return sqlstate in ("55P03", "40001", "40P01")


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Map the driver's lock errors to ``Busy`` once, here, keeping the cause."""
    try:
        yield
    except exc.DBAPIError as error:  # OperationalError among them
        if is_lock_error(error):
            raise errors.Busy() from error
        raise


def constraint_name(error: exc.IntegrityError) -> str | None:
    """The violated constraint's name (PostgreSQL reports it; SQLite reports the text)."""
    orig: Any = error.orig
    diag = getattr(orig, "diag", None)
    name = getattr(diag, "constraint_name", None)
    if name:
        return str(name)
    return None


# --- migrations -------------------------------------------------------------


def _alembic_config(connection: Connection | None = None) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


def known_revisions() -> set[str]:
    from alembic.script import ScriptDirectory

    return {rev.revision for rev in ScriptDirectory.from_config(_alembic_config()).walk_revisions()}


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with read(engine) as conn:
        rev: str | None = MigrationContext.configure(conn).get_current_revision()
        return rev


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str]:
    """Apply migrations; safe to run twice, and from two processes at once on PostgreSQL."""
    from alembic import command

    with engine.connect() as conn:
        sqlite_driver: Any = None
        if conn.dialect.name == "postgresql":
            # One migrator at a time: a second waits, then finds nothing to do.
            conn.exec_driver_sql("SELECT pg_advisory_lock(726373)")
            conn.commit()
        else:
            # SQLite changes a table's constraints by rebuilding it, and dropping
            # the old table would cascade to the rows that reference it. Foreign
            # keys are off for the migration (the pragma is a no-op inside a
            # transaction, so before it begins) and checked before they are on again.
            sqlite_driver = conn.connection.driver_connection
            sqlite_driver.execute("PRAGMA foreign_keys=OFF")
        try:
            # Read under the lock: a second migrator reports where the first left it.
            before = current_revision(engine)
            command.upgrade(_alembic_config(conn), revision)
            conn.commit()
        finally:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SELECT pg_advisory_unlock(726373)")
                conn.commit()
            elif sqlite_driver is not None:
                broken = sqlite_driver.execute("PRAGMA foreign_key_check").fetchall()
                sqlite_driver.execute("PRAGMA foreign_keys=ON")
                if broken:
                    raise errors.SchemaError(f"the migration broke foreign keys: {broken[:5]}")
    return before, current_revision(engine) or ""


def check_schema(engine: Engine) -> None:
    """Refuse to run on a schema older or newer than the code, saying what to run."""
    head = head_revision()
    current = current_revision(engine)
    if current == head:
        return
    if current is not None and current not in known_revisions():
        raise errors.SchemaTooNew(current, head)
    raise errors.SchemaNotCurrent(current, head)


def database_label(engine: Engine) -> str:
    """The URL without its password, for messages and logs."""
    return engine.url.render_as_string(hide_password=True)


def sqlite_path(engine: Engine) -> str | None:
    return engine.url.database if is_sqlite(engine) else None


def ensure_var_dir() -> None:
    os.makedirs("var", exist_ok=True)
