"""The outbox table at the storage level: before and after migration 0006 (fillfactors).

Every delivery writes three row versions: the claim updates the outbox row and
inserts its attempt row; the result updates both. This measures, on PostgreSQL,
what those writes cost the database with the tables' storage parameters as
shipped (``after``) and reset to PostgreSQL's default fillfactor of 100
(``before``), in the same run, interleaved:

- a drain of ``--effects`` effects by the dispatcher (``run_once`` with a no-op
  adapter, batches of 100): effects per second, WAL bytes per effect, the share
  of updates that were HOT (wrote no index entry), the tables' and indexes' sizes;
- ``EXPLAIN (ANALYZE, BUFFERS, WAL)`` of one claim statement and one result
  statement of 100 rows each, the store's own SQL (``--plans`` prints them whole).

Bounded: ``--reps`` repetitions of two drains, about 10 s each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from bench.perf import backlog, floor, harness
from bench.perf.dispatch import dispatcher

# Each variant's set-up on a freshly migrated database, before the backlog is written.
VARIANTS = {
    "before": ["ALTER TABLE outbox RESET (fillfactor)", "ALTER TABLE attempts RESET (fillfactor)"],
    "after": [],
}
_SIZES = """
SELECT pg_relation_size('outbox'), pg_indexes_size('outbox'),
       pg_relation_size('attempts'), pg_indexes_size('attempts')
"""
_UPDATES = """
SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
WHERE relname IN ('outbox', 'attempts')
"""


def _database(scratch: harness.Scratch, variant: str, effects: int) -> str:
    url = scratch.postgres()
    with psycopg.connect(backlog.conninfo(url), autocommit=True) as conn:
        for statement in VARIANTS[variant]:
            conn.execute(statement)
    backlog.fill(url, effects)
    return url


def drain(scratch: harness.Scratch, variant: str, effects: int) -> dict[str, Any]:
    """Drain a fresh backlog; what it cost the database."""
    url = _database(scratch, variant, effects)
    with psycopg.connect(backlog.conninfo(url), autocommit=True) as conn:
        conn.execute("CHECKPOINT")  # every run starts writing full-page images afresh
        conn.execute("SELECT pg_stat_reset()")
        (start,) = conn.execute("SELECT pg_current_wal_lsn()").fetchone() or (None,)
        d = dispatcher(url)
        try:
            began = time.monotonic()
            done = 0
            while handled := d.run_once():
                done += handled
            elapsed = time.monotonic() - began
        finally:
            d.close()
            d.adapters.close()
            d.engine.dispose()
        (wal,) = conn.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (start,)
        ).fetchone() or (0,)
        # The dispatcher's sessions have ended, so their counters are in the view.
        conn.execute("SELECT pg_stat_clear_snapshot()")
        updates = {name: (upd, hot) for name, upd, hot in conn.execute(_UPDATES).fetchall()}
        sizes = conn.execute(_SIZES).fetchone() or (0, 0, 0, 0)
    scratch.drop(url)
    assert done == effects, f"drained {done} of {effects}"
    return {
        "effects_per_s": done / elapsed,
        "wal_bytes_per_effect": float(wal) / done,
        "outbox_hot_pct": 100.0 * updates["outbox"][1] / max(1, updates["outbox"][0]),
        "attempts_hot_pct": 100.0 * updates["attempts"][1] / max(1, updates["attempts"][0]),
        "outbox_mib": sizes[0] / 2**20,
        "outbox_indexes_mib": sizes[1] / 2**20,
        "attempts_mib": sizes[2] / 2**20,
        "attempts_indexes_mib": sizes[3] / 2**20,
    }


def plans(scratch: harness.Scratch, variant: str) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS, WAL) of a claim of 100 rows and of their results."""
    from outbox.delivery import store

    url = _database(scratch, variant, 2_000)
    try:
        with psycopg.connect(backlog.conninfo(url), autocommit=True) as conn:
            claim = {"owner": "bench", "lease": timedelta(seconds=60), "limit": 100}
            claim["unsettled"] = []
            claim_plan = _explain(conn, store._PG_CLAIM_FIRST, claim)
            claimed = [r[1:-1] for r in conn.execute(store._PG_CLAIM_FIRST, claim) if r[0]]
            at = datetime.now(UTC).timestamp()
            batch = json.dumps([floor._finish(c, at) for c in claimed])
            finish_plan = _explain(conn, store._PG_FINISH, {"batch": batch})
        return {"claim": claim_plan, "finish": finish_plan}
    finally:
        scratch.drop(url)


def _explain(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> dict[str, Any]:
    """The statement's plan and figures, run and rolled back (its rows stay as they were)."""
    with conn.transaction(force_rollback=True):
        text = [r[0] for r in conn.execute("EXPLAIN (ANALYZE, BUFFERS, WAL) " + sql, params)]
    with conn.transaction(force_rollback=True):
        (start,) = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone() or (None,)
        (doc,) = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) " + sql, params
        ).fetchone() or (None,)
        (wal,) = conn.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (start,)
        ).fetchone() or (0,)
    plan_doc: dict[str, Any] = doc[0]
    plan = plan_doc["Plan"]
    nodes = {
        f"{n.get('Operation', n['Node Type']).lower()} {n['Relation Name']}": n
        for n in _walk(plan)
        if n["Node Type"] == "ModifyTable"
    }
    # Each table's write (a data-modifying CTE's node) with what it read and locked
    # to do it; the whole statement's WAL from the insert position around it (the
    # plan's top node leaves out the CTEs the final SELECT does not read).
    figures: dict[str, float] = {
        "execution_ms": plan_doc["Execution Time"],
        "wal_bytes": float(wal),
    }
    for name, node in sorted(nodes.items()):
        figures[f"{name}: wal_records"] = node["WAL Records"]
        figures[f"{name}: wal_bytes"] = node["WAL Bytes"]
        figures[f"{name}: buffers_hit"] = node["Shared Hit Blocks"]
        figures[f"{name}: buffers_dirtied"] = node["Shared Dirtied Blocks"]
    return {"figures": figures, "text": "\n".join(text)}


def _walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _walk(child))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.storage", description=__doc__)
    parser.add_argument("--effects", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--plans", action="store_true", help="print the EXPLAIN plans whole")
    parser.add_argument("--pg-url", default=harness.PG_ADMIN_URL_DEFAULT)
    args = parser.parse_args(argv)
    scratch = harness.Scratch(pg_admin_url=args.pg_url)
    try:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for rep in range(args.reps):
            for variant in harness.rotated(list(VARIANTS), rep):
                runs[variant].append(drain(scratch, variant, args.effects))
        explained = {v: plans(scratch, v) for v in VARIANTS}
    finally:
        scratch.close()
    _report(runs, explained, args)
    return 0


def _report(
    runs: dict[str, list[dict[str, Any]]],
    explained: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> None:
    print(f"drain of {args.effects:,} effects, medians of {args.reps} (after / before):")
    for figure in runs["after"][0]:
        before, after = (statistics.median(r[figure] for r in runs[v]) for v in VARIANTS)
        ratio = f"{after / before:.2f}x" if before else "-"
        print(f"  {figure:24} before {before:12,.2f}  after {after:12,.2f}  {ratio}")
    for statement in ("claim", "finish"):
        print(f"EXPLAIN (ANALYZE, BUFFERS, WAL) of one {statement} statement, 100 rows:")
        before, after = (explained[v][statement]["figures"] for v in VARIANTS)
        for figure in after:
            print(
                f"  {figure:36} before {before.get(figure, 0):10,.2f}  after {after[figure]:10,.2f}"
            )
        if args.plans:
            for variant in VARIANTS:
                print(f"--- {statement}, {variant}:\n{explained[variant][statement]['text']}")


if __name__ == "__main__":
    sys.exit(main())
