"""Real infrastructure for the chaos scenarios: a PostgreSQL primary with a
streaming replica, and PgBouncer, each started by the scenario on free loopback
ports in a temporary directory, and always stopped.

``Cluster`` runs ``initdb`` and ``pg_basebackup -R`` from the newest
``/usr/lib/postgresql/*/bin`` (or ``$PG_BIN``), then starts both servers as
foreground ``postgres`` processes in their own process groups. PostgreSQL
refuses to run as root, so as root they run as the ``postgres`` OS user.
``kill_primary()`` sends SIGKILL to the primary's whole group (postmaster and
every backend at once: a pulled plug, not a shutdown), and ``promote()`` turns
the replica into the new primary (``pg_promote()``, what a failover manager
such as Patroni does after it has decided).

Replication is synchronous when ``synchronous`` is set: the primary runs with
``synchronous_standby_names = '*'`` and ``synchronous_commit = on``, so a
COMMIT is acknowledged only once the replica has flushed its WAL. The setting
is given to the primary alone (on its command line, not in a file
``pg_basebackup`` would copy): a promoted replica with no standby of its own
must not wait for one.

``PgBouncer`` runs Debian's ``pgbouncer`` in ``pool_mode = transaction`` in
front of one server; every database name is passed through (``* = ...``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from bench.chaos import procs

READY_TIMEOUT_S = 60.0
PGBOUNCER = os.environ.get("PGBOUNCER", "/usr/sbin/pgbouncer")


def pg_bin() -> Path:
    """The newest PostgreSQL server binaries on this machine."""
    override = os.environ.get("PG_BIN")
    if override:
        return Path(override)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    if not found:
        raise RuntimeError(
            "no PostgreSQL server binaries in /usr/lib/postgresql/*/bin: install the "
            "postgresql package, or set PG_BIN"
        )
    return Path(found[-1])


def _os_user() -> dict[str, Any]:
    """Servers refuse root: as root, run them as the ``postgres`` OS user."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root needs a 'postgres' OS user for the servers") from None
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _own(path: Path) -> None:
    user = _os_user()
    if user:
        os.chown(path, user["user"], user["group"])


def _run(argv: Sequence[str], log: Path) -> None:
    with open(log, "ab") as out:
        done = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=READY_TIMEOUT_S * 2,
            check=False,
            **_os_user(),
        )
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{argv[0]} exited with {done.returncode}:\n{tail}")


class Server:
    """One ``postgres`` process on a data directory, in its own process group."""

    def __init__(self, name: str, datadir: Path, port: int, run_dir: Path) -> None:
        self.name = name
        self.datadir = datadir
        self.port = port
        self.run_dir = run_dir
        self.log = run_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, settings: dict[str, str]) -> None:
        argv = [str(pg_bin() / "postgres"), "-D", str(self.datadir)]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **_os_user(),
            )

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host={procs.HOST} port={self.port} user=postgres dbname={dbname}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error as exc:
                last = exc
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready: {last}\n{self.log_tail()}")

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn(), connect_timeout=2, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def kill(self) -> None:
        """SIGKILL the whole group: the postmaster and every backend, at once."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self) -> None:
        """A fast shutdown (SIGINT), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Cluster:
    """A primary and one streaming replica; ``url`` reaches whichever is writable."""

    def __init__(self, *, synchronous: bool = True) -> None:
        self.synchronous = synchronous
        self.dir = Path(tempfile.mkdtemp(prefix="outbox_failover_"))
        self.dir.chmod(0o755)
        _own(self.dir)
        self.primary = Server("primary", self.dir / "primary", procs.free_port(), self.dir)
        self.replica = Server("replica", self.dir / "replica", procs.free_port(), self.dir)
        self.promotions = 0
        self.primary_killed_at: float | None = None
        self.promoted_at: float | None = None

    def _common(self, port: int) -> dict[str, str]:
        return {
            "port": str(port),
            "listen_addresses": procs.HOST,
            "unix_socket_directories": str(self.dir),
            "max_connections": "200",
            "shared_buffers": "32MB",
            "wal_level": "replica",
            "max_wal_senders": "5",
            "hot_standby": "on",
            "wal_keep_size": "256MB",
            # The plug is pulled on a process, never on the machine: the page cache
            # survives, so fsync only costs the shared disk time here.
            "fsync": "off",
            "full_page_writes": "off",
            "log_min_messages": "warning",
        }

    def start(self) -> None:
        log = self.dir / "setup.log"
        _run(
            [
                str(pg_bin() / "initdb"),
                "-D",
                str(self.primary.datadir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            log,
        )
        primary = self._common(self.primary.port)
        if self.synchronous:
            # Any one standby must have flushed a commit's WAL before it is acknowledged.
            primary["synchronous_standby_names"] = "*"
            primary["synchronous_commit"] = "on"
        self.primary.start(primary)
        self.primary.wait_ready()
        _run(
            [
                str(pg_bin() / "pg_basebackup"),
                "-h",
                procs.HOST,
                "-p",
                str(self.primary.port),
                "-U",
                "postgres",
                "-D",
                str(self.replica.datadir),
                "-R",  # standby.signal and primary_conninfo: a streaming replica
                "-X",
                "stream",
                "--checkpoint=fast",
                "--no-sync",
            ],
            log,
        )
        # Not synchronous_standby_names: after a promotion it has no standby to wait for.
        self.replica.start(self._common(self.replica.port) | {"synchronous_standby_names": ""})
        self.replica.wait_ready()
        self._wait_streaming()

    def _wait_streaming(self) -> None:
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            rows = self.primary.query("SELECT state, sync_state FROM pg_stat_replication")
            if any(state == "streaming" and sync == want for state, sync in rows):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the replica is not streaming ({want}):\n{self.replica.log_tail()}")

    def url(self, dbname: str = "postgres") -> str:
        """Both hosts; libpq (and Outbox) take the first that accepts writes."""
        return (
            f"postgresql://postgres@/{dbname}?host={procs.HOST},{procs.HOST}"
            f"&port={self.primary.port},{self.replica.port}"
            "&target_session_attrs=read-write&connect_timeout=2"
        )

    def kill_primary(self) -> None:
        self.primary.kill()
        self.primary_killed_at = time.monotonic()

    def promote(self) -> None:
        (done,) = self.replica.query("SELECT pg_promote(wait => true, wait_seconds => 30)")[0]
        if not done:
            raise RuntimeError(f"the replica was not promoted:\n{self.replica.log_tail()}")
        self.promotions += 1
        self.promoted_at = time.monotonic()

    def replication_lag_bytes(self) -> int | None:
        """Bytes the replica has not yet replayed (None when not streaming)."""
        try:
            rows = self.primary.query(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint "
                "FROM pg_stat_replication"
            )
        except psycopg.Error:
            return None
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def close(self, keep: bool = False) -> None:
        for server in (self.primary, self.replica):
            server.stop()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


class PgBouncer:
    """PgBouncer in transaction pooling mode in front of ``server_host:server_port``."""

    def __init__(self, server_host: str, server_port: int, *, pool_size: int = 20) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="outbox_pgbouncer_"))
        self.dir.chmod(0o755)
        self.port = procs.free_port()
        self.log = self.dir / "pgbouncer.log"
        ini = self.dir / "pgbouncer.ini"
        users = self.dir / "userlist.txt"
        users.write_text('"postgres" ""\n')
        ini.write_text(
            "[databases]\n"
            f"* = host={server_host} port={server_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = {procs.HOST}\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            "pool_mode = transaction\n"
            "max_client_conn = 1000\n"
            f"default_pool_size = {pool_size}\n"
            "min_pool_size = 0\n"
            "server_login_retry = 1\n"
            "admin_users = postgres\n"
            f"logfile = {self.log}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n"
        )
        for path in (self.dir, ini, users):
            _own(path)
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which(PGBOUNCER) is not None or Path(PGBOUNCER).exists()

    def start(self) -> None:
        if not self.available():
            raise RuntimeError(
                "pgbouncer is missing: install Debian's pgbouncer package (make chaos-pooler "
                "does it when run as root)"
            )
        self.proc = subprocess.Popen(
            [PGBOUNCER, str(self.dir / "pgbouncer.ini")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **_os_user(),
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited:\n{self.log_tail()}")
            try:
                with psycopg.connect(
                    f"host={procs.HOST} port={self.port} user=postgres dbname=pgbouncer",
                    connect_timeout=2,
                    autocommit=True,
                    prepare_threshold=None,
                ) as conn:
                    conn.execute("SHOW VERSION")
                return
            except psycopg.Error:
                time.sleep(0.1)
        raise RuntimeError(f"pgbouncer not ready:\n{self.log_tail()}")

    def url(self, dbname: str) -> str:
        return f"postgresql://postgres@{procs.HOST}:{self.port}/{dbname}"

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console (pools, stats, config)."""
        with psycopg.connect(
            f"host={procs.HOST} port={self.port} user=postgres dbname=pgbouncer",
            connect_timeout=2,
            autocommit=True,
            prepare_threshold=None,
        ) as conn:
            cursor = conn.execute(f"SHOW {what}")
            names = [c.name for c in cursor.description or []]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def close(self, keep: bool = False) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
