"""Cases 1 and 2: the create path and the replay path, next to raw inserts.

Outbox: ``Outbox(url).execute(tenant, op_id, "create_support_task", args)``,
each call its own transaction (task + operation record + outbox row).
Baseline: the driver itself (psycopg / sqlite3), one business row plus one
outbox row per transaction, the same columns, values and indexes.
Minimal: the same loop writing one row to each of two bare tables
(``harness.minimal_tables``): Outbox against it is what our schema and our
guarantees cost together over the least a transactional outbox writes.
Replay: the same keys again, every call answered from the stored receipt.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from bench.perf import floor, harness

TOOL = "create_support_task"
BODY = "The parcel was promised for Tuesday and has not arrived; please chase the carrier. " * 2
MAX_OPS = 500_000
WARMUP_OPS = 20


def arguments(client: int, i: int) -> dict[str, Any]:
    return {"subject": f"Bench task {client}-{i}", "body": BODY, "priority": "normal"}


def _key(prefix: str, client: int, i: int) -> str:
    return f"{prefix}-{client}-{i}"


def outbox_client(
    *,
    client: int,
    start_at: float,
    end_at: float,
    url: str,
    prefix: str,
    created: list[int] | None = None,
) -> dict[str, Any]:
    """``created`` set: replay those keys (cyclically); otherwise create new ones."""
    from outbox import Outbox, settings

    config = settings.load(sqlite_synchronous="NORMAL")
    box = Outbox(url, config=config)
    try:
        for i in range(WARMUP_OPS):
            box.execute(harness.TENANT, _key(f"{prefix}w", client, i), TOOL, arguments(client, i))
        harness.wait_until(start_at)
        begun = harness.begin()
        ops = 0
        if created is None:
            while ops < MAX_OPS and time.monotonic() < end_at:
                box.execute(harness.TENANT, _key(prefix, client, ops), TOOL, arguments(client, ops))
                ops += 1
        else:
            # A client starved of the write lock may have created nothing: it replays
            # its warm-up keys instead.
            pool, keys = (
                (created[client], prefix) if created[client] else (WARMUP_OPS, f"{prefix}w")
            )
            while ops < MAX_OPS and time.monotonic() < end_at:
                i = ops % pool
                result = box.execute(
                    harness.TENANT, _key(keys, client, i), TOOL, arguments(client, i)
                )
                assert result.replayed
                ops += 1
        return harness.span(ops, begun)
    finally:
        box.close()


def timed(one: Callable[[int], object], start_at: float, end_at: float) -> dict[str, Any]:
    """A client's loop: warm up, wait for the shared start, then ``one(i)`` until the end."""
    for i in range(WARMUP_OPS):
        one(-1 - i)
    harness.wait_until(start_at)
    begun = harness.begin()
    ops = 0
    while ops < MAX_OPS and time.monotonic() < end_at:
        one(ops)
        ops += 1
    return harness.span(ops, begun)


def _payload(args: dict[str, Any]) -> str:
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _rows(client: int, i: int, now: datetime) -> tuple[dict[str, Any], dict[str, Any]]:
    args = arguments(client, i)
    op = f"raw-{client}-{i}"
    task = {
        "tenant": harness.TENANT,
        "subject": args["subject"],
        "body": args["body"],
        "priority": args["priority"],
        "status": "open",
        "operation_id": op,
        "created_at": now,
        "updated_at": now,
    }
    payload = _payload(args)
    effect = {
        "tenant": harness.TENANT,
        "operation_id": op,
        "effect": "open_ticket",
        "adapter": "helpdesk",
        "payload": payload,
        "effect_key": f"obx_{uuid.uuid4().hex}",
        "status": "pending",
        "reason": "created",
        "attempts": 0,
        "maybe_sent": False,
        "next_attempt_at": now,
        "deadline_at": now + timedelta(minutes=15),
        "fence": 0,
        "needs_review": False,
        "lookup_attempts": 0,
        "created_at": now,
        "updated_at": now,
    }
    return task, effect


def _minimal_rows(client: int, i: int, now: datetime) -> tuple[dict[str, Any], dict[str, Any]]:
    """The business row and the outbox row of the minimal tables, the same payload."""
    args = arguments(client, i)
    task = {"subject": args["subject"], "created_at": now}
    effect = {
        "payload": _payload(args),
        "status": "pending",
        "next_attempt_at": now,
        "attempts": 0,
        "created_at": now,
    }
    return task, effect


# The raw loop's (business table, outbox table, rows of call i) by baseline.
TABLES = {
    "raw": ("raw_tasks", "raw_outbox", _rows),
    "minimal": ("minimal_tasks", "minimal_outbox", _minimal_rows),
}


def _insert_sql(table: str, row: dict[str, Any], style: str, returning: str = "") -> str:
    columns = ", ".join(row)
    marks = ", ".join(f"%({c})s" if style == "pyformat" else f":{c}" for c in row)
    return f"INSERT INTO {table} ({columns}) VALUES ({marks}){returning}"


def raw_postgres_client(
    *, client: int, start_at: float, end_at: float, url: str, tables: str = "raw"
) -> dict[str, Any]:
    return raw_postgres_loop(
        lambda one: timed(one, start_at, end_at), client=client, url=url, tables=tables
    )


def raw_postgres_loop(
    loop: Callable[[Callable[[int], None]], dict[str, Any]],
    *,
    client: int,
    url: str,
    tables: str = "raw",
) -> dict[str, Any]:
    """``loop(one)`` on a bare psycopg connection, ``one(i)`` being raw's create number i."""
    import psycopg

    business, outbox, rows = TABLES[tables]
    conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, options="-c timezone=UTC") as conn:
        task, effect = rows(client, 0, datetime.now(UTC))
        task_sql = _insert_sql(business, task, "pyformat", " RETURNING id")
        effect_sql = _insert_sql(outbox, effect, "pyformat")
        cur = conn.cursor()

        def one(i: int) -> None:
            task, effect = rows(client, i, datetime.now(UTC))
            cur.execute(task_sql, task)
            cur.fetchone()
            cur.execute(effect_sql, effect)
            conn.commit()

        return loop(one)


def _sqlite_ts(value: datetime) -> str:
    return value.replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")


def raw_sqlite_client(
    *, client: int, start_at: float, end_at: float, url: str, tables: str = "raw"
) -> dict[str, Any]:
    business, outbox, rows = TABLES[tables]
    conn = harness.sqlite_connect(url, check_same_thread=False)
    task, effect = rows(client, 0, datetime.now(UTC))
    task_sql = _insert_sql(business, task, "named", " RETURNING id")
    effect_sql = _insert_sql(outbox, effect, "named")

    def one(i: int) -> None:
        task, effect = rows(client, i, datetime.now(UTC))
        for row in (task, effect):
            for k, v in row.items():
                if isinstance(v, datetime):
                    row[k] = _sqlite_ts(v)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(task_sql, task).fetchone()
        conn.execute(effect_sql, effect)
        conn.execute("COMMIT")

    try:
        return timed(one, start_at, end_at)
    finally:
        conn.close()


RAW_CLIENT = {"postgres": raw_postgres_client, "sqlite": raw_sqlite_client}


def run(ctx: Any) -> None:
    """Cases 1 and 2, interleaved over ``ctx.reps`` repetitions (case 2 replays case 1's keys)."""
    for rep in range(ctx.reps):
        for backend in ctx.backends:
            for clients in ctx.create_clients:
                # Quick mode measures the systems the targets name (not the floor).
                systems = ["raw", "minimal", "outbox"]
                if not ctx.quick:
                    systems += ["floor"]
                for system in harness.rotated(systems, rep):
                    url = ctx.scratch.fresh(backend)
                    try:
                        _measure(ctx, rep, backend, clients, system, url)
                    finally:
                        ctx.scratch.drop(url)


def _baseline(system: str, backend: str) -> Callable[..., dict[str, Any]]:
    """The client function of a baseline: raw and minimal are one loop on two sets of tables."""
    if system == "floor":
        return floor.create_client
    return functools.partial(RAW_CLIENT[backend], tables=system)


def _measure(ctx: Any, rep: int, backend: str, clients: int, system: str, url: str) -> None:
    def measure(case: str, fn: Callable[..., dict[str, Any]], **kwargs: Any) -> list[int]:
        """Run ``fn`` on every client, emit the measurement, return each client's ops."""
        server = ctx.scratch.server_cpu(url)
        reports = ctx.clients.run(fn, clients, ctx.create_seconds, url=url, server=server, **kwargs)
        ops, span = harness.throughput(reports)
        named = {"system": system, **harness.note(system)}
        ctx.out.emit(
            case=case,
            **named,
            db=backend,
            clients=clients,
            rep=rep,
            ops=ops,
            seconds=span,
            ops_per_s=ops / span,
            **harness.cpu_per_op(reports, server),
        )
        return [r["ops"] for r in reports]

    if system != "outbox":
        measure("create", _baseline(system, backend))
        return
    prefix = f"r{rep}"
    created = measure("create", outbox_client, prefix=prefix)
    if 2 in ctx.cases:
        measure("replay", outbox_client, prefix=prefix, created=created)
