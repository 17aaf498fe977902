"""Scratch databases, client processes and the JSON lines every case prints.

Scratch databases: one migrated template per backend per run (PostgreSQL
``outbox_bench_<run>_tmpl``, a SQLite file in a temp dir), cloned for each
measurement so no variant inherits another's bloat, and all dropped at exit.

Client processes: a spawned pool (never forked: a forked child would share the
parent's database sockets). A measurement hands every client the same start
time; each warms up, waits for it, runs until the shared end time (or its
operation cap), and reports what it did. Throughput is the sum of operations
over the span from the first start to the last end.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import resource
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

PG_ADMIN_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"
TENANT = "bench"
# Clients get this long to connect and warm up before the shared start.
START_LEAD_S = 0.8


def add_pg_argument(parser: argparse.ArgumentParser, flag: str = "--pg") -> None:
    """The PostgreSQL server a bench command makes its scratch databases on."""
    parser.add_argument(
        flag,
        default=os.environ.get("OUTBOX_BENCH_POSTGRES_URL", PG_ADMIN_URL_DEFAULT),
        help="an admin URL of the PostgreSQL server (scratch databases are made and dropped)",
    )


def pg_url(admin_url: str, database: str) -> str:
    return sa.make_url(admin_url).set(database=database).render_as_string(hide_password=False)


def raw_tables(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table]:
    """``raw_tasks`` and ``raw_outbox``: the business and outbox tables' columns, CHECKs
    and indexes (so every row costs the same to store), without foreign keys, which
    only makes the baseline faster."""
    from outbox import schema

    made = []
    for source, name in ((schema.tasks, "raw_tasks"), (schema.outbox, "raw_outbox")):
        table = sa.Table(name, metadata)
        for column in source.columns:
            copy = column._copy()
            copy.foreign_keys.clear()
            copy.constraints = {c for c in copy.constraints if not isinstance(c, sa.ForeignKey)}
            table.append_column(copy)
        for constraint in source.constraints:
            if isinstance(constraint, sa.CheckConstraint) and isinstance(
                constraint.sqltext, sa.TextClause | schema.OneOf
            ):
                table.append_constraint(
                    sa.CheckConstraint(constraint.sqltext, name=f"raw_{constraint.name}")
                )
        for index in source.indexes:
            sa.Index(
                f"raw_{index.name}",
                *[table.c[c.name] for c in index.columns],
                unique=index.unique,
                **{k: v for k, v in index.dialect_kwargs.items() if k.endswith("_where")},
            )
        made.append(table)
    return made[0], made[1]


# What the table says of each baseline beside its name.
NOTES = {"floor": "Outbox's SQL, bare driver", "minimal": "bare tables, one index"}


def note(system: str) -> dict[str, str]:
    """The ``note`` field of a measurement of ``system``, if it has one."""
    return {"note": NOTES[system]} if system in NOTES else {}


def minimal_tables(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table]:
    """``minimal_tasks`` and ``minimal_outbox``: the fewest columns a working outbox needs
    and one partial index, on the due pending rows the claim reads. The same loops on
    these and on ``raw_tables`` (or ``outbox``) tell what our schema itself costs."""
    from outbox.schema import BigId

    def stamp(name: str, nullable: bool = False) -> sa.Column[Any]:
        return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)

    tasks = sa.Table(
        "minimal_tasks",
        metadata,
        sa.Column("id", BigId, primary_key=True),
        sa.Column("subject", sa.Text(), nullable=False),
        stamp("created_at"),
    )
    outbox = sa.Table(
        "minimal_outbox",
        metadata,
        sa.Column("id", BigId, primary_key=True),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        stamp("next_attempt_at"),
        sa.Column("attempts", sa.Integer(), nullable=False),
        stamp("lease_expires_at", nullable=True),
        stamp("created_at"),
    )
    due = sa.text("status = 'pending'")
    sa.Index(
        "minimal_outbox_due",
        outbox.c.next_attempt_at,
        outbox.c.id,
        postgresql_where=due,
        sqlite_where=due,
    )
    return tasks, outbox


def prepare(engine: sa.Engine) -> None:
    """Migrate, add the tenant and the raw and minimal baseline tables."""
    from outbox import db, schema

    db.upgrade(engine)
    metadata = sa.MetaData()
    raw_tables(metadata)
    minimal_tables(metadata)
    metadata.create_all(engine)
    with db.write(engine) as conn:
        conn.execute(sa.insert(schema.tenants), {"id": TENANT, "created_at": schema.utcnow()})


@dataclass
class Scratch:
    """The databases of one run. ``postgres()`` / ``sqlite()`` hand out fresh clones."""

    pg_admin_url: str
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="outbox_bench_")))
    _pg_template: str | None = None
    _sqlite_template: Path | None = None
    _pg_made: list[str] = field(default_factory=list)
    _counter: int = 0

    def _admin(self) -> sa.Engine:
        from outbox import db

        return sa.create_engine(
            db.normalise_url(self.pg_admin_url),
            isolation_level="AUTOCOMMIT",
            poolclass=sa.pool.NullPool,
        )

    def _next(self) -> int:
        self._counter += 1
        return self._counter

    def postgres(self, *, migrated: bool = True) -> str:
        """A fresh database: a clone of the migrated template, or empty."""
        from outbox import db, settings

        name = f"outbox_bench_{self.run_id}_{self._next()}"
        admin = self._admin()
        with admin.connect() as conn:
            if migrated and self._pg_template is None:
                template = f"outbox_bench_{self.run_id}_tmpl"
                conn.exec_driver_sql(f'CREATE DATABASE "{template}"')
                self._pg_made.append(template)
                engine = db.create_engine(
                    settings.load(),
                    url=pg_url(self.pg_admin_url, template),
                    poolclass=sa.pool.NullPool,
                )
                prepare(engine)
                engine.dispose()
                self._pg_template = template
            clause = f' TEMPLATE "{self._pg_template}"' if migrated else ""
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"{clause}')
        admin.dispose()
        self._pg_made.append(name)
        return pg_url(self.pg_admin_url, name)

    def sqlite(self) -> str:
        from outbox import db, settings

        if self._sqlite_template is None:
            path = self.tmp / "template.db"
            engine = db.create_engine(
                settings.load(), url=f"sqlite:///{path}", poolclass=sa.pool.NullPool
            )
            prepare(engine)
            engine.dispose()
            # Fold the WAL into the file, so a copy of the file alone is the whole database.
            raw = sqlite3.connect(path)
            raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            raw.close()
            self._sqlite_template = path
        path = self.tmp / f"run_{self._next()}.db"
        shutil.copyfile(self._sqlite_template, path)
        return f"sqlite:///{path}"

    def drop(self, url: str) -> None:
        """Drop one clone now (a big one should not wait for the end of the run)."""
        parsed = sa.make_url(url)
        if parsed.get_backend_name() == "sqlite":
            for suffix in ("", "-wal", "-shm"):
                Path(f"{parsed.database}{suffix}").unlink(missing_ok=True)
            return
        name = parsed.database
        if name in self._pg_made:
            with self._admin().connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            self._pg_made.remove(name)

    def close(self) -> None:
        if self._pg_made:
            with self._admin().connect() as conn:
                for name in reversed(self._pg_made):
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            self._pg_made.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fresh(self, backend: str) -> str:
        return self.postgres() if backend == "postgres" else self.sqlite()

    def server_cpu(self, url: str) -> ServerCpu | None:
        """A sampler of the server's CPU for a measurement on ``url`` (PostgreSQL only)."""
        if sa.make_url(url).get_backend_name() == "sqlite":
            return None
        return ServerCpu(self.pg_admin_url, url)


def _warm_imports() -> None:
    # Pay the import cost once per worker, outside every timed region.
    import psycopg  # noqa: F401

    import outbox  # noqa: F401


class Clients:
    """A pool of spawned client processes, reused for the whole run."""

    def __init__(self, size: int) -> None:
        self.pool = ProcessPoolExecutor(
            max_workers=size,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_warm_imports,
        )
        self.size = size

    def run(
        self,
        fn: Callable[..., dict[str, Any]],
        count: int,
        duration: float,
        *,
        server: ServerCpu | None = None,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        """Run ``fn`` in ``count`` processes from one shared start for ``duration`` seconds.

        ``server``: count the database server's CPU from the start until the clients end."""
        assert count <= self.size
        start_at = time.monotonic() + START_LEAD_S
        if server is not None:
            server.start(start_at)
        try:
            futures = [
                self.pool.submit(
                    fn, client=i, start_at=start_at, end_at=start_at + duration, **kwargs
                )
                for i in range(count)
            ]
            # Bounded: a client that hangs fails the case instead of the run hanging.
            return [f.result(timeout=duration + 120) for f in futures]
        finally:
            if server is not None:
                server.stop()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 600, **kwargs: Any) -> Any:
        return self.pool.submit(fn, *args, **kwargs).result(timeout=timeout)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def sqlite_connect(url: str, *, check_same_thread: bool = True) -> sqlite3.Connection:
    """A bare sqlite3 connection set up as ``outbox.db`` sets up its own (WAL,
    foreign keys, ``synchronous=NORMAL``, a busy timeout), in autocommit mode."""
    path = sa.make_url(url).database
    assert path
    conn = sqlite3.connect(
        path, isolation_level=None, timeout=5, check_same_thread=check_same_thread
    )
    for pragma in (
        "journal_mode=WAL",
        "foreign_keys=ON",
        "synchronous=NORMAL",
        "busy_timeout=5000",
    ):
        conn.execute(f"PRAGMA {pragma}")
    return conn


def _usage() -> tuple[float, int]:
    """This process's CPU seconds so far (user + system, every thread), and how often
    the kernel has taken the CPU from it while it could run: one reading."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_nivcsw


def begin() -> tuple[float, float, int]:
    """A client's timed span starts: (monotonic clock, CPU seconds, preemptions)."""
    return (time.monotonic(), *_usage())


def span(ops: int, begun: tuple[float, float, int]) -> dict[str, Any]:
    """A client's report: ``ops`` since ``begin()``, with the CPU the span took and
    how often the client was preempted in it (read beside the CPU: whether a
    client's CPU grows with preemption is a question, not a given)."""
    started, cpu_started, preempted_before = begun
    ended, (cpu, preempted) = time.monotonic(), _usage()
    return {
        "ops": ops,
        "started": started,
        "ended": ended,
        "cpu_s": cpu - cpu_started,
        "preempted": preempted - preempted_before,
    }


class ServerCpu:
    """The CPU a database's server processes spend while a measurement runs.

    PostgreSQL runs one process per connection and does not count CPU itself;
    Linux does, per process (``/proc/<pid>/stat``). A thread polls the backends
    connected to the measurement's database every ``POLL_S`` from the shared
    start, so a backend that exits (its client disconnected) keeps its last
    reading: at most one poll of its work is lost. Each backend counts from its
    first reading at or after the start, so the clients' warm-up is left out.
    Only a local process named ``postgres`` is read: ``seconds`` is None when no
    backend could be (a server on another host, whose process ids mean nothing
    here; SQLite, which runs in the client).
    """

    POLL_S = 0.05

    def __init__(self, admin_url: str, url: str) -> None:
        self._admin_url = admin_url
        self._database = sa.make_url(url).database
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = os.sysconf("SC_CLK_TCK")
        self.polls = 0  # readings taken so far

    def start(self, start_at: float) -> None:
        self._thread = threading.Thread(target=self._poll, args=(start_at,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    @property
    def seconds(self) -> float | None:
        if not self._first:
            return None
        return sum(self._last[pid] - first for pid, first in self._first.items())

    def cpu(self, pid: int) -> float | None:
        """A local PostgreSQL process's CPU seconds so far; None if it is not one (or gone)."""
        try:
            with open(f"/proc/{pid}/stat") as stat:
                text = stat.read()
        except OSError:
            return None
        name, _, rest = text.partition(" (")[2].rpartition(") ")
        if name != "postgres":
            return None
        fields = rest.split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime

    def _poll(self, start_at: float) -> None:
        import psycopg

        conninfo = sa.make_url(self._admin_url).set(drivername="postgresql")
        dsn = conninfo.render_as_string(hide_password=False)
        with psycopg.connect(dsn, autocommit=True) as admin:
            if self._stop.wait(max(0.0, start_at - time.monotonic())):
                return  # stopped before the start
            while True:
                rows = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                    (self._database,),
                ).fetchall()
                for (pid,) in rows:
                    cpu = self.cpu(pid)
                    if cpu is None:  # exited since the query, or not a local backend
                        continue
                    self._first.setdefault(pid, cpu)
                    self._last[pid] = cpu
                self.polls += 1
                if self._stop.wait(self.POLL_S):
                    return


def on_scratch_postgres(admin_url: str, measure: Callable[[str], Any]) -> Any:
    """``measure(url)`` on a fresh migrated PostgreSQL database, dropped afterwards."""
    scratch = Scratch(admin_url)
    try:
        return measure(scratch.postgres())
    finally:
        scratch.close()


def wait_until(start_at: float) -> None:
    delay = start_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def cpu_per_op(reports: list[dict[str, Any]], server: ServerCpu | None = None) -> dict[str, float]:
    """``client_cpu_us`` (the clients' CPU per operation), ``preempted_per_op``
    (how often a client lost its core, per operation) and, where the server's
    processes could be read, ``server_cpu_us``: the fields a measurement adds."""
    ops = sum(r["ops"] for r in reports)
    if not ops or any("cpu_s" not in r for r in reports):
        return {}
    figures = {"client_cpu_us": sum(r["cpu_s"] for r in reports) / ops * 1e6}
    if all("preempted" in r for r in reports):
        figures["preempted_per_op"] = sum(r["preempted"] for r in reports) / ops
    seconds = None if server is None else server.seconds
    if seconds is not None:
        figures["server_cpu_us"] = seconds / ops * 1e6
    return figures


def throughput(reports: list[dict[str, Any]]) -> tuple[int, float]:
    ops = sum(r["ops"] for r in reports)
    span = max(r["ended"] for r in reports) - min(r["started"] for r in reports)
    return ops, span


@dataclass
class Recorder:
    """Collects every measurement and prints each as one JSON line."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, **row: Any) -> dict[str, Any]:
        # JSON has no infinity: a figure that could not be measured is null.
        clean = {
            k: (round(v, 6) if math.isfinite(v) else None) if isinstance(v, float) else v
            for k, v in row.items()
        }
        self.rows.append(clean)
        print(json.dumps(clean), flush=True)
        return clean

    def note(self, message: str) -> None:
        print(f"# {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def rss_kib(pid: int | None = None) -> int:
    with open(f"/proc/{pid or os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def rotated(items: list[Any], rep: int) -> Iterator[Any]:
    """Interleave: each repetition starts at a different variant, so order bias cancels."""
    k = rep % len(items)
    yield from items[k:] + items[:k]


def postgres_version(admin_url: str) -> str:
    import psycopg

    conninfo = sa.make_url(admin_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(conninfo) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return f"PostgreSQL {row[0]}" if row else ""
