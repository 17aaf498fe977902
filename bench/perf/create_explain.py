"""The server's side of a create, part by part, beside the minimal transaction's.

``python -m bench.perf.create_explain [--creates N] [--pg URL]``

``make bench``'s CPU table gives the server's time per create as one figure; this
splits it. On a fresh migrated database, the floor's create (Outbox's one
statement, sent from a bare driver, as ``bench.perf.floor`` sends it) and the
minimal baseline's two inserts (``bench.perf.create_path``, in their transaction)
run ``N`` times each, interleaved, under ``EXPLAIN (ANALYZE, BUFFERS, WAL)``, after
a warm-up of each. Printed, as medians per create:

- the statement's execution, and within it each table's insert (its row, its
  indexes, its CHECKs) and each trigger the statement fired: the foreign keys'
  checks and the dispatcher's wake-up gate; what is left is the executor's start
  and end (opening each table and each of its indexes, every time), the key's
  lookup and the statement's own plumbing (the CTEs, the union);
- the planning, which a long-lived process does not pay: after five runs psycopg
  prepares the create and PostgreSQL keeps its generic plan;
- the WAL each writes, its commit record included (the difference of the insert
  position around it), and how much of it the inserts wrote; the rest is the
  commit record and, for ours, the row locks the foreign keys' checks take.

The commit's flush is not timed: both pay one a create. The timings carry the
instrumentation's own cost (a clock read around every node), the same on both
sides; read them as shares.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from bench.perf import backlog, create_path, floor, harness

EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) "
WARMUP = 20
OUTBOX, MINIMAL = "outbox create", "minimal transaction"
EXECUTION, PLANNING = "execution", "planning (a prepared create does not pay it)"
OTHER = "the rest: executor start and end, the key's lookup, the CTEs"
WAL_BYTES = "WAL bytes, the commit's included"
WAL_INSERTS = "of which the inserts (rows and index entries)"
COUNTED = (WAL_BYTES, WAL_INSERTS)


def measure(creates: int, url: str) -> dict[str, dict[str, float]]:
    """``{part: {system: median}}``: milliseconds for times, bytes for WAL.

    ``url``: a migrated PostgreSQL database with the bench's tables; the creates
    are committed to it."""
    import psycopg

    took: dict[str, dict[str, list[float]]] = {}
    with psycopg.connect(backlog.conninfo(url), autocommit=True) as conn:
        names = _trigger_names(conn)
        ids: list[int] = []
        minimal_task, minimal_effect = create_path._minimal_rows(0, 0, datetime.now(UTC))
        task_sql = create_path._insert_sql(
            "minimal_tasks", minimal_task, "pyformat", " RETURNING id"
        )
        effect_sql = create_path._insert_sql("minimal_outbox", minimal_effect, "pyformat")

        def ours(i: int) -> tuple[list[dict[str, Any]], int]:
            sql, params = floor.pg_create_statement(conn, 0, i, ids)
            start = _wal_position(conn)
            documents = [_explain(conn, sql, params)]
            return documents, _wal_since(conn, start)

        def minimal(i: int) -> tuple[list[dict[str, Any]], int]:
            task, effect = create_path._minimal_rows(0, i, datetime.now(UTC))
            start = _wal_position(conn)
            with conn.transaction():
                documents = [_explain(conn, task_sql, task), _explain(conn, effect_sql, effect)]
            return documents, _wal_since(conn, start)

        for i in range(WARMUP):
            ours(-1 - i)
            minimal(-1 - i)
        for i in range(creates):
            for system, run in ((OUTBOX, ours), (MINIMAL, minimal)):
                documents, wal = run(i)
                for part, value in _parts(documents, names, wal).items():
                    took.setdefault(part, {}).setdefault(system, []).append(value)
    return {
        part: {system: statistics.median(values) for system, values in by.items()}
        for part, by in took.items()
    }


def _explain(conn: Any, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    (row,) = conn.execute(EXPLAIN + sql, params).fetchall()
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    result: dict[str, Any] = document[0]
    return result


def _wal_position(conn: Any) -> str:
    (row,) = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchall()
    return str(row[0])


def _wal_since(conn: Any, start: str) -> int:
    sql = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)::bigint"
    (row,) = conn.execute(sql, (start,)).fetchall()
    return int(row[0])


def _trigger_names(conn: Any) -> dict[str, str]:
    """What each trigger a create fires is for: its constraint, or its own name."""
    rows = conn.execute(
        "SELECT t.tgname, c.conname, t.tgrelid::regclass::text, c.confrelid::regclass::text"
        " FROM pg_trigger t LEFT JOIN pg_constraint c ON c.oid = t.tgconstraint"
        " WHERE t.tgrelid::regclass::text IN ('tasks', 'operations', 'outbox')"
    ).fetchall()
    return {
        name: f"foreign key {table} -> {parent}" if constraint else f"trigger {name}"
        for name, constraint, table, parent in rows
    }


def _parts(
    documents: Iterable[dict[str, Any]], names: dict[str, str], wal: int
) -> dict[str, float]:
    """One create's figures from its statements' plans (a transaction sums its
    statements) and the WAL it wrote in all.

    Each insert is read off its own ModifyTable node: a data-modifying CTE the
    statement does not read runs after the main plan, outside its top node's
    counts, so the top node's figures would leave it out."""
    parts: dict[str, float] = {WAL_BYTES: wal}

    def add(part: str, value: float) -> None:
        parts[part] = parts.get(part, 0.0) + value

    for document in documents:
        plan = document["Plan"]
        add(EXECUTION, document["Execution Time"])
        add(PLANNING, document["Planning Time"])
        accounted = 0.0
        for node in _nodes(plan):
            if node["Node Type"] == "ModifyTable":
                # Its own time: the row, its indexes and CHECKs; not what fed it rows.
                own = node["Actual Total Time"] - sum(
                    child["Actual Total Time"] for child in node.get("Plans", [])
                )
                add(f"insert {node['Relation Name']}", own)
                add(WAL_INSERTS, node.get("WAL Bytes", 0))
                accounted += own
        for trigger in document.get("Triggers", []):
            name = names.get(trigger["Trigger Name"], f"trigger {trigger['Trigger Name']}")
            add(name, trigger["Time"])
            accounted += trigger["Time"]
        add(OTHER, document["Execution Time"] - accounted)
    return parts


def _nodes(plan: dict[str, Any]) -> Iterable[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def table(parts: dict[str, dict[str, float]]) -> list[str]:
    """One line a part: Outbox's create, the minimal transaction's, and the difference."""
    order = [
        EXECUTION,
        *sorted(p for p in parts if p.startswith("insert ")),
        *sorted(p for p in parts if p.startswith(("foreign key", "trigger"))),
        OTHER,
        PLANNING,
        WAL_BYTES,
        WAL_INSERTS,
    ]
    width = max(len(p) for p in order)
    lines = [f"{'':<{width}}  {OUTBOX:>14}  {MINIMAL:>19}  {'difference':>10}"]
    for part in order:
        if part not in parts:
            continue
        ours = parts[part].get(OUTBOX, 0.0)
        minimal = parts[part].get(MINIMAL, 0.0)
        counted = part in COUNTED
        unit = "" if counted else " µs"
        scale = 1 if counted else 1000  # EXPLAIN gives milliseconds
        indent = "  " if part not in (EXECUTION, PLANNING, WAL_BYTES) else ""
        name = f"{indent}{part}"
        lines.append(
            f"{name:<{width + 2}}{ours * scale:>12.0f}{unit:3}  {minimal * scale:>16.0f}{unit:3}"
            f"  {(ours - minimal) * scale:>+8.0f}{unit}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=500)
    harness.add_pg_argument(parser)
    options = parser.parse_args(argv)
    parts = harness.on_scratch_postgres(options.pg, lambda url: measure(options.creates, url))
    print("\n".join(table(parts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
