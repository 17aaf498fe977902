"""``python -m bench.chaos.scenarios failover|pooler``: the chaos run on real infrastructure.

    python -m bench.chaos.scenarios failover [--replication sync|async] [--operations N]
                                             [--kills N] [--max-seconds S] [--seed N]
    python -m bench.chaos.scenarios pooler   [--operations N] [--kills N] [--max-seconds S]

``failover``: a PostgreSQL primary and a streaming replica, started here
(``infra.Cluster``). Every Outbox process gets the multi-host URL
``postgresql://postgres@/DB?host=H,H&port=P1,P2&target_session_attrs=read-write``.
While the load runs, the primary is killed with SIGKILL (postmaster and
backends at once) and, after ``--detect-seconds`` (what a failover manager
takes to decide), the replica is promoted. No process is told: each one's
next connection finds the new primary by itself.

``pooler``: PgBouncer in ``pool_mode = transaction`` (``infra.PgBouncer``) in
front of the PostgreSQL server at ``--pg-url``. The API, the dispatchers and
the reconciler all connect through it with ``OUTBOX_DATABASE_POOLER=transaction``;
the dispatchers LISTEN on a direct connection (``OUTBOX_LISTEN_URL``), or poll
with ``--listen poll``. The monkey kills processes and terminates the server
connections behind the pooler, as in ``make chaos``.

Both run one phase of ``bench.chaos.run`` (the provider honours keys by
default), check every invariant of ``make chaos``, print the same figures and
end with the ledger: acknowledged creates, lost, duplicates, resends after
ambiguity, keys minted (and, for failover, promotions). Exit status 0 only
when every invariant held (for failover with synchronous replication: lost=0,
duplicates=0 and at least one promotion); 1 otherwise; 2 for bad arguments.
With ``--replication async`` the figures are printed and losses are reported,
not failed on: that is what asynchronous replication may cost (docs/failover.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.chaos import infra, run
from bench.chaos.__main__ import print_phase

DETECT_SECONDS_DEFAULT = 1.0
KILL_AT_PROGRESS = 0.35  # of the load's calls: the primary dies while callers are busy

LEDGER = (
    ("acknowledged", "acknowledged creates"),
    ("lost", "lost operations"),
    ("duplicates", "duplicate tickets"),
    ("resends after ambiguity", "resends after ambiguity (same key)"),
    ("keys minted", "keys minted for retries"),
)


class Failover:
    """Kill the primary once the load is under way, then promote the replica."""

    def __init__(
        self,
        cluster: infra.Cluster,
        progress: Callable[[], float | None],
        *,
        detect_seconds: float,
        log: Callable[[str], None],
    ) -> None:
        self.cluster = cluster
        self.progress = progress
        self.detect_seconds = detect_seconds
        self.log = log
        self.errors: list[str] = []
        self.lag_at_kill: int | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-failover", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                done = self.progress()
                if done is None or done >= KILL_AT_PROGRESS:
                    break
                time.sleep(0.05)
            self.lag_at_kill = self.cluster.replication_lag_bytes()
            self.cluster.kill_primary()
            self.log(f"  [failover] primary killed (kill -9); lag was {self.lag_at_kill} bytes")
            time.sleep(self.detect_seconds)
            self.cluster.promote()
            self.log("  [failover] replica promoted")
        except Exception as exc:  # noqa: BLE001 - reported as the phase's error
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def finish(self, timeout: float) -> None:
        # The promotion is the point of the run: wait for it past the monkey's bound.
        self._thread.join(max(timeout, 60.0))
        if self._thread.is_alive():
            self.errors.append("the failover did not finish in time")

    def figures(self) -> dict[str, Any]:
        c = self.cluster
        without = None
        if c.primary_killed_at is not None and c.promoted_at is not None:
            without = round(c.promoted_at - c.primary_killed_at, 2)
        return {
            "replication": "synchronous" if c.synchronous else "asynchronous",
            "promotions": c.promotions,
            "primary kills (kill -9 postmaster and backends)": int(c.primary_killed_at is not None),
            "seconds without a writable primary": without,
            "replica replay lag at the kill (bytes)": self.lag_at_kill,
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos.scenarios",
        description="The chaos run through a PostgreSQL failover or PgBouncer.",
    )
    p.add_argument("scenario", choices=["failover", "pooler"])
    p.add_argument("--operations", type=int, default=200, help="calls (bounded)")
    p.add_argument("--kills", type=int, default=3, help="kill -9 of Outbox processes")
    p.add_argument("--max-seconds", type=float, default=180.0, help="time bound of the phase")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dispatchers", type=int, default=2, choices=[2, 3, 4])
    p.add_argument("--workers", type=int, default=6, help="load generator threads")
    p.add_argument("--phase", choices=list(run.PHASES), default="honour")
    p.add_argument(
        "--replication",
        choices=["sync", "async"],
        default="sync",
        help="failover: synchronous (default) or asynchronous streaming replication",
    )
    p.add_argument(
        "--detect-seconds",
        type=float,
        default=DETECT_SECONDS_DEFAULT,
        help="failover: seconds between the primary's death and the promotion",
    )
    p.add_argument(
        "--listen",
        choices=["direct", "poll"],
        default="direct",
        help="pooler: dispatchers LISTEN on a direct connection, or poll",
    )
    p.add_argument(
        "--pg-url",
        default=os.environ.get("OUTBOX_TEST_POSTGRES_URL") or run.PG_ADMIN_URL_DEFAULT,
        help="pooler: the PostgreSQL server behind PgBouncer",
    )
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    return p


def _ledger(figures: dict[str, Any], scenario: str) -> list[tuple[str, Any]]:
    rows = [(label, figures.get(key)) for label, key in LEDGER]
    if scenario == "failover":
        rows.append(("promotions", figures.get("promotions")))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.operations < 10 or args.kills < 0 or args.max_seconds < 20:
        print("--operations >= 10, --kills >= 0, --max-seconds >= 20", file=sys.stderr)
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix=f"outbox_chaos_{args.scenario}_"))
    command = "python -m bench.chaos.scenarios " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    print(f"{command}\nrun directory (logs): {run_dir}", flush=True)
    started = time.monotonic()

    def log(message: str) -> None:
        print(message, flush=True)

    cluster: infra.Cluster | None = None
    bouncer: infra.PgBouncer | None = None
    result: run.PhaseResult | None = None
    try:
        common: dict[str, Any] = {
            "database": "postgres",
            "operations": args.operations,
            "kills": args.kills,
            "seconds": args.max_seconds,
            "seed": args.seed,
            "dispatchers": args.dispatchers,
            "workers": args.workers,
            "run_dir": run_dir,
        }
        if args.scenario == "failover":
            cluster = infra.Cluster(synchronous=args.replication == "sync")
            cluster.start()
            log(
                f"primary 127.0.0.1:{cluster.primary.port}, replica 127.0.0.1:"
                f"{cluster.replica.port} ({args.replication} streaming replication)"
            )
            failover_cluster = cluster
            options = run.PhaseOptions(
                **common,
                pg_admin_url=cluster.url(),
                # The failover is this run's database fault; backends are not terminated too.
                terminate_backends=False,
                disturbance=lambda progress: Failover(
                    failover_cluster, progress, detect_seconds=args.detect_seconds, log=log
                ),
            )
        else:
            import sqlalchemy as sa

            server = sa.make_url(args.pg_url)
            bouncer = infra.PgBouncer(server.host or "127.0.0.1", server.port or 5432)
            bouncer.start()
            log(f"pgbouncer 127.0.0.1:{bouncer.port} (pool_mode=transaction) -> {server.host}")
            pooled = bouncer
            listen = args.listen

            def service(direct: str) -> tuple[str, dict[str, str]]:
                env = {"OUTBOX_DATABASE_POOLER": "transaction"}
                if listen == "direct":
                    # LISTEN needs a session of its own: past the pooler, to the server.
                    env["OUTBOX_LISTEN_URL"] = direct
                return pooled.url(sa.make_url(direct).database or ""), env

            options = run.PhaseOptions(
                **common,
                pg_admin_url=args.pg_url,
                service=service,
                # What a pooler cannot carry from the client's start-up: the database's own.
                database_settings={"timezone": "UTC", "lock_timeout": "5s"},
            )
        result = run.run_phase(run.PHASES[args.phase], options, log=log)
        if bouncer is not None:
            result.figures.update(_bouncer_figures(bouncer))
    finally:
        if bouncer is not None:
            bouncer.close(keep=args.keep)
        if cluster is not None:
            cluster.close(keep=args.keep)
    print_phase(result)
    figures = result.figures
    ok = result.ok
    verdicts = []
    if args.scenario == "failover" and figures.get("promotions", 0) < 1:
        ok = False
        verdicts.append("no promotion happened")
    if args.scenario == "failover" and args.replication == "async":
        verdicts.append("asynchronous replication: losses are reported, not failed on")
        ok = result.error is None and figures.get("promotions", 0) >= 1
    print(f"\n== ledger ({args.scenario})")
    for label, value in _ledger(figures, args.scenario):
        print(f"  {label:<26} {value}")
    line = " ".join(
        f"{label.replace(' ', '_')}={value}" for label, value in _ledger(figures, args.scenario)
    )
    print(line)
    for verdict in verdicts:
        print(verdict)
    seconds = round(time.monotonic() - started, 1)
    if ok and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"logs kept in {run_dir}")
    print(f"\n{'PASS' if ok else 'FAIL'} in {seconds}s", flush=True)
    return 0 if ok else 1


def _bouncer_figures(bouncer: infra.PgBouncer) -> dict[str, Any]:
    try:
        stats = bouncer.show("STATS")
        config = {row["key"]: row["value"] for row in bouncer.show("CONFIG")}
    except Exception as exc:  # noqa: BLE001 - figures only
        return {"pgbouncer": f"stats unavailable: {exc}"}
    return {
        "pgbouncer pool_mode": config.get("pool_mode"),
        "pgbouncer transactions": sum(int(r.get("total_xact_count", 0)) for r in stats),
        "pgbouncer queries": sum(int(r.get("total_query_count", 0)) for r in stats),
    }


if __name__ == "__main__":
    sys.exit(main())
