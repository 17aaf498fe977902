"""The floor: Outbox's own SQL, run by the bare driver with no library around it.

The raw baselines of cases 1 and 3 do less than Outbox must: two rows per
create instead of three and no lookup of the key; a claim and an
acknowledgement per batch with no attempt rows. So a ratio to raw mixes two
costs: what the guarantees cost the database, and what our Python costs.
The floor separates them. It sends the very statements the library sends
(rendered from the same definitions, ``outbox.create`` and ``outbox.store``),
in the same order and transactions, from a tight loop on the driver:

- floor / raw is what the guarantees cost: no library can beat it with
  this SQL, so a target above it cannot be met without changing what is
  written (the receipt, the attempt rows);
- outbox / floor is what our code costs on top.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import sqlalchemy as sa

from bench.perf import backlog, harness

# --- case 1: a create ------------------------------------------------------------


def _create_rows(client: int, i: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The task, operation record and outbox row one ``create_support_task`` writes,
    with the same sizes; the receipt is filled in once the task has its id."""
    from bench.perf import create_path

    now = datetime.now(UTC)
    task, effect = create_path._rows(client, i, now)
    op = f"floor-{client}-{i}"
    task["operation_id"] = effect["operation_id"] = op
    record = {
        "tenant": harness.TENANT,
        "operation_id": op,
        "tool": "create_support_task",
        "payload_version": 1,
        "args_digest": uuid.uuid4().hex * 2,  # the size of a SHA-256 in hex
        "receipt": None,
        "status_code": 201,
        "task_id": None,
        "created_at": now,
        "expires_at": now + timedelta(days=7),
    }
    return task, record, effect


def _receipt(record: dict[str, Any], task_id: int) -> None:
    record["task_id"] = task_id
    record["receipt"] = json.dumps(
        {"operation_id": record["operation_id"], "status": "created", "task_id": task_id},
        sort_keys=True,
        separators=(",", ":"),
    )


def pg_create_statement(cur: Any, client: int, i: int, ids: list[int]) -> tuple[str, Any]:
    """The one statement Outbox's create sends on PostgreSQL for create ``i`` of
    ``client``, and its parameters. Its task id comes from ``ids``, refilled from a
    block of the tasks' sequence when empty, as the create's handler draws them."""
    from outbox import schema
    from outbox.creating import create

    task, record, effect = _create_rows(client, i)
    if not ids:
        table = {"table": "tasks", "column": "id"}
        next_ids = create._NEXT_IDS.format(create._Ids.BLOCK)
        ids.extend(row[0] for row in reversed(cur.execute(next_ids, table).fetchall()))
    task["id"] = ids.pop()
    _receipt(record, task["id"])
    columns = [k for k in effect if k not in ("tenant", "operation_id")]
    return create._pg_statement(record, [(schema.tasks, task)], [{k: effect[k] for k in columns}])


def create_client(*, client: int, start_at: float, end_at: float, url: str) -> dict[str, Any]:
    from bench.perf import create_path
    from outbox import db, schema
    from outbox.creating import create

    backend = "sqlite" if sa.make_url(url).get_backend_name() == "sqlite" else "postgresql"
    task, record, effect = _create_rows(client, 0)
    find = db.driver_sql(create._FIND, backend)
    ids: list[int] = []
    if backend == "postgresql":
        # Autocommit: one statement that commits alone, with the key's lookup in it.
        conn: Any = psycopg.connect(backlog.conninfo(url), autocommit=True)
    else:
        conn = harness.sqlite_connect(url)
        insert_task = db.insert_sql(schema.tasks, tuple(task), "id", backend)
        insert_record = create._insert_operation(backend, tuple(record))
        insert_effect = db.insert_sql(schema.outbox, tuple(effect), None, backend)

    def one(i: int) -> None:
        if backend == "postgresql":
            cur = conn.cursor()
            sql, params = pg_create_statement(cur, client, i, ids)
            assert [row[0] for row in cur.execute(sql, params).fetchall()] == ["new"]
            return
        task, record, effect = _create_rows(client, i)
        key = {"tenant": record["tenant"], "operation_id": record["operation_id"]}
        task, record, effect = (db.driver_values(backend, r) for r in (task, record, effect))
        conn.execute("BEGIN IMMEDIATE")
        assert conn.execute(find, key).fetchone() is None
        _receipt(record, conn.execute(insert_task, task).fetchone()[0])
        assert conn.execute(insert_record, record).fetchone() is not None
        conn.execute(insert_effect, effect)
        conn.execute("COMMIT")

    try:
        return create_path.timed(one, start_at, end_at)
    finally:
        conn.close()


# --- case 3: a dispatcher's pass with a no-op adapter ------------------------------


def drain(*, client: int, start_at: float, end_at: float, url: str) -> dict[str, Any]:
    """The pass of ``outbox.store``: due rows, claim with attempt rows, commit; then
    the fenced results with the attempts' ends, commit. No admission, no threads."""
    owner = f"floor-{client}-{uuid.uuid4().hex[:6]}"
    pg = sa.make_url(url).get_backend_name() != "sqlite"
    conn: Any = psycopg.connect(backlog.conninfo(url)) if pg else harness.sqlite_connect(url)
    try:
        harness.wait_until(start_at)
        begun = harness.begin()
        done = 0
        while time.monotonic() < end_at:
            handled = _pass_pg(conn, owner) if pg else _pass_sqlite(conn, owner)
            if handled == 0:
                break
            done += handled
        return harness.span(done, begun)
    finally:
        conn.close()


def _pass_pg(conn: Any, owner: str) -> int:
    from outbox.delivery import store

    due = conn.execute(store._PG_DUE, {"limit": 100}).fetchall()
    if not due:
        conn.commit()
        return 0
    now = due[0][5]
    claimed = conn.execute(
        store._PG_CLAIM,
        {
            "ids": [r[0] for r in due],
            "owner": owner,
            "now": now,
            "lease_expires_at": now + timedelta(seconds=60),
        },
    ).fetchall()
    conn.commit()
    at = datetime.now(UTC).timestamp()
    batch = [_finish(c, at) for c in claimed]
    # Planned every call, as the store runs it (a prepared one keeps a young table's plan).
    conn.execute(store._PG_FINISH, {"batch": json.dumps(batch)}, prepare=False).fetchall()
    conn.commit()
    return len(claimed)


def _finish(c: Any, at: float) -> dict[str, Any]:
    """One row of ``store._PG_FINISH``'s batch: ``at`` in seconds since the epoch."""
    ref = f"noop-{c[6]}"
    return {
        "id": c[0],
        "fence": c[8],
        "attempt_no": c[7],
        "at_s": at,
        "status": "succeeded",
        "reason": "delivered",
        "maybe_sent": True,
        "terminal": True,
        "next_attempt_at": None,
        "next_lookup_at": None,
        "provider_ref": ref,
        "attempt_provider_ref": ref,
        "error": None,
        "outcome": "delivered",
        "status_code": None,
    }


def _pass_sqlite(conn: sqlite3.Connection, owner: str) -> int:
    from outbox import schema
    from outbox.delivery import store

    t = schema.sqlite_time
    now = datetime.now(UTC)
    conn.execute("BEGIN IMMEDIATE")
    due = conn.execute(store._SQLITE_DUE, (t(now), 100)).fetchall()
    if not due:
        conn.execute("COMMIT")
        return 0
    ids = [r[0] for r in due]
    claimed = conn.execute(
        store._SQLITE_CLAIM.format(marks=", ".join("?" * len(ids))),
        (owner, t(now + timedelta(seconds=60)), t(now), *ids),
    ).fetchall()
    conn.executemany(
        store._SQLITE_OPEN_ATTEMPTS, [(c[0], c[7], owner, c[8], c[6], t(now)) for c in claimed]
    )
    conn.execute("COMMIT")
    at = t(datetime.now(UTC))
    conn.execute("BEGIN IMMEDIATE")
    claimed_ids = [c[0] for c in claimed]
    fences = store._SQLITE_FENCES.format(marks=", ".join("?" * len(claimed_ids)))
    current = {r[0]: (r[1], r[2]) for r in conn.execute(fences, claimed_ids).fetchall()}
    held = [c for c in claimed if current.get(c[0]) == (c[8], "in_flight")]
    conn.executemany(
        store._SQLITE_FINISH_ROW,
        [
            ("succeeded", "delivered", 1, None, f"noop-{c[6]}", None, at, None, at, c[0], c[8])
            for c in held
        ],
    )
    conn.executemany(
        store._SQLITE_FINISH_ATTEMPT,
        [(at, "delivered", None, None, f"noop-{c[6]}", 0, c[0], c[7], c[8]) for c in claimed],
    )
    conn.execute("COMMIT")
    return len(claimed)
