"""Case 3: draining a pre-filled backlog with a no-op adapter.

Outbox: ``Dispatcher.run(once=True)`` (``outbox dispatcher --once``), in 1 and 2 processes, with
``adapters.testing.NoopAdapter``: every claim still opens an attempt row per
effect before the send, and every result is still recorded under its fence.
Baseline: a raw claim loop on the same table and rows (claim 100 with
``FOR UPDATE SKIP LOCKED`` in one UPDATE ... RETURNING, commit, then one batched
acknowledgement), no attempt rows. Minimal: the same raw loop on a table of
the fewest columns and one partial index (``harness.minimal_tables``), filled
with the same backlog: Outbox against it is what our schema costs on top of the
loop. Peers: pgqueuer and procrastinate draining the same number of jobs with
no-op handlers (PostgreSQL only).

Each drain runs until the backlog is empty or the window ends, and its rate is the
effects done over its span. The slower loops run the whole window; the faster ones
(raw, minimal, Outbox with 2 or more processes) empty the backlog first, so their
figure is a whole drain's, start-up and last passes included.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import sqlalchemy as sa

from bench.perf import backlog, floor, harness, peers

BATCH = 100
RAW_CLAIM_PG = """
UPDATE outbox SET status = 'in_flight', reason = 'claimed', lease_owner = %(owner)s,
    lease_expires_at = now() + interval '60 seconds', fence = fence + 1,
    attempts = attempts + 1, updated_at = now()
WHERE id IN (
    SELECT id FROM outbox WHERE status = 'pending' AND next_attempt_at <= now()
    ORDER BY next_attempt_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING id, effect_key, payload, fence
"""
RAW_ACK_PG = """
UPDATE outbox SET status = 'succeeded', reason = 'delivered', provider_ref = 'noop-' || effect_key,
    finished_at = now(), lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
WHERE id = ANY(%(ids)s)
"""
RAW_CLAIM_SQLITE = """
UPDATE outbox SET status = 'in_flight', reason = 'claimed', lease_owner = :owner,
    lease_expires_at = :lease, fence = fence + 1, attempts = attempts + 1, updated_at = :now
WHERE id IN (
    SELECT id FROM outbox WHERE status = 'pending' AND next_attempt_at <= :now
    ORDER BY next_attempt_at, id LIMIT :limit)
RETURNING id, effect_key, payload, fence
"""
RAW_ACK_SQLITE = """
UPDATE outbox SET status = 'succeeded', reason = 'delivered', provider_ref = 'noop-' || effect_key,
    finished_at = :now, lease_owner = NULL, lease_expires_at = NULL, updated_at = :now
WHERE id IN ({marks})
"""
# The same loop on ``minimal_outbox``: what is left of the claim and the acknowledgement
# when the table has no column the loop does not need.
MINIMAL_CLAIM_PG = """
UPDATE minimal_outbox SET status = 'in_flight',
    lease_expires_at = now() + interval '60 seconds', attempts = attempts + 1
WHERE id IN (
    SELECT id FROM minimal_outbox WHERE status = 'pending' AND next_attempt_at <= now()
    ORDER BY next_attempt_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING id, payload
"""
MINIMAL_ACK_PG = """
UPDATE minimal_outbox SET status = 'succeeded', lease_expires_at = NULL WHERE id = ANY(%(ids)s)
"""
MINIMAL_CLAIM_SQLITE = """
UPDATE minimal_outbox SET status = 'in_flight', lease_expires_at = :lease,
    attempts = attempts + 1
WHERE id IN (
    SELECT id FROM minimal_outbox WHERE status = 'pending' AND next_attempt_at <= :now
    ORDER BY next_attempt_at, id LIMIT :limit)
RETURNING id, payload
"""
MINIMAL_ACK_SQLITE = """
UPDATE minimal_outbox SET status = 'succeeded', lease_expires_at = NULL WHERE id IN ({marks})
"""
# The raw loop's (claim, acknowledgement) by table, then by backend.
LOOPS = {
    "raw": {"postgres": (RAW_CLAIM_PG, RAW_ACK_PG), "sqlite": (RAW_CLAIM_SQLITE, RAW_ACK_SQLITE)},
    "minimal": {
        "postgres": (MINIMAL_CLAIM_PG, MINIMAL_ACK_PG),
        "sqlite": (MINIMAL_CLAIM_SQLITE, MINIMAL_ACK_SQLITE),
    },
}


def _noop(row: Any) -> str:
    return f"noop-{row[1]}"


def raw_drain(
    *, client: int, start_at: float, end_at: float, url: str, tables: str = "raw"
) -> dict[str, Any]:
    """The raw claim loop on ``outbox`` (``tables="raw"``) or on ``minimal_outbox``."""
    owner = f"{tables}-{client}-{uuid.uuid4().hex[:6]}"
    if sa.make_url(url).get_backend_name() == "sqlite":
        return _raw_drain_sqlite(owner, start_at, end_at, url, *LOOPS[tables]["sqlite"])
    claim, ack = LOOPS[tables]["postgres"]
    with psycopg.connect(backlog.conninfo(url)) as conn:
        harness.wait_until(start_at)
        begun = harness.begin()
        done = 0
        while time.monotonic() < end_at:
            rows = conn.execute(claim, {"owner": owner, "limit": BATCH}).fetchall()
            conn.commit()
            if not rows:
                break
            for row in rows:
                _noop(row)
            conn.execute(ack, {"ids": [r[0] for r in rows]})
            conn.commit()
            done += len(rows)
        return harness.span(done, begun)


def _raw_drain_sqlite(
    owner: str, start_at: float, end_at: float, url: str, claim: str, ack: str
) -> dict[str, Any]:
    conn = harness.sqlite_connect(url)

    def ts(value: datetime) -> str:
        return value.replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")

    try:
        harness.wait_until(start_at)
        begun = harness.begin()
        done = 0
        while time.monotonic() < end_at:
            now = datetime.now(UTC)
            conn.execute("BEGIN IMMEDIATE")
            rows = conn.execute(
                claim,
                {
                    "owner": owner,
                    "lease": ts(now + timedelta(seconds=60)),
                    "now": ts(now),
                    "limit": BATCH,
                },
            ).fetchall()
            conn.execute("COMMIT")
            if not rows:
                break
            for row in rows:
                _noop(row)
            ids = [r[0] for r in rows]
            # Positional marks for the ids; every :now of the statement is the same time.
            sql = ack.format(marks=",".join("?" * len(ids)))
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                sql.replace(":now", "?"), [ts(datetime.now(UTC))] * sql.count(":now") + ids
            )
            conn.execute("COMMIT")
            done += len(rows)
        return harness.span(done, begun)
    finally:
        conn.close()


def dispatcher(
    url: str, adapter_names: tuple[str, ...] = (backlog.NOOP_ADAPTER,), **overrides: Any
) -> Any:
    """A ``Dispatcher`` with no-op adapters, as ``outbox dispatcher`` would build it."""
    import adapters
    from adapters.testing import NoopAdapter
    from outbox import db, settings
    from outbox.delivery.dispatcher import Dispatcher

    config = settings.load(sqlite_synchronous="NORMAL", claim_batch_size=BATCH, **overrides)
    engine = db.create_engine(config, url=url)
    registry = adapters.Registry([NoopAdapter(name) for name in adapter_names])
    return Dispatcher(engine, registry, config, worker_id=f"bench-{uuid.uuid4().hex[:8]}")


def run_once_until(d: Any, start_at: float, end_at: float) -> dict[str, Any]:
    """``d.run(once=True)`` (``outbox dispatcher --once``: pass after pass until nothing
    is due) from ``start_at``, stopped at ``end_at`` as SIGTERM stops it (the pass in
    progress is recorded before it returns): the client's report (``harness.span``)."""
    harness.wait_until(start_at)
    begun = harness.begin()
    stop = threading.Timer(max(0.0, end_at - begun[0]), d.request_stop)
    stop.start()
    try:
        done = d.run(once=True)
    finally:
        stop.cancel()
    return harness.span(done, begun)


def outbox_drain(*, client: int, start_at: float, end_at: float, url: str) -> dict[str, Any]:
    """A drain with ``run_once_until``: the loop users run, with the no-op adapter."""
    d = dispatcher(url)
    try:
        return run_once_until(d, start_at, end_at)
    finally:
        d.close()
        d.adapters.close()
        d.engine.dispose()


SYSTEMS = {
    "outbox": outbox_drain,
    "raw": raw_drain,
    "minimal": functools.partial(raw_drain, tables="minimal"),
    "floor": floor.drain,
}
# How each system's backlog is made (the peers enqueue theirs through their own API).
FILLS = {"minimal": backlog.fill_minimal}


def run(ctx: Any) -> None:
    seconds = 2.0 if ctx.quick else 4.0
    for rep in range(ctx.reps):
        for backend in ctx.backends:
            variants: list[tuple[str, int]] = [("outbox", 1), ("raw", 1), ("minimal", 1)]
            # Quick mode measures every system a target names (raw, pgqueuer, 2
            # processes), not the floor, the scaling beyond 2 or procrastinate.
            if not ctx.quick:
                variants.append(("floor", 1))
            if backend == "postgres":
                variants += [("outbox", 2), ("raw", 2), ("minimal", 2)]
                peer_names = ["pgqueuer"] if ctx.quick else list(peers.DRAINERS)
                variants += [(name, 1) for name in peer_names if peers.available(name)]
            if backend == "postgres" and not ctx.quick:
                variants.append(("floor", 2))
                # Scaling: throughput must not fall as dispatcher processes are added.
                # Raw beside it: past the cores, does the host's own loop fall too?
                variants += [("outbox", 4), ("outbox", 8), ("raw", 4), ("raw", 8)]
            for system, processes in harness.rotated(variants, rep):
                _measure(ctx, rep, backend, system, processes, seconds)


def _measure(ctx: Any, rep: int, backend: str, system: str, processes: int, seconds: float) -> None:
    if system in peers.DRAINERS:
        url = ctx.scratch.postgres(migrated=False)
        try:
            ctx.clients.call(peers.prepare_backlog, system, url, ctx.backlog)
            reports = ctx.clients.run(peers.DRAINERS[system], processes, seconds, url=url)
        finally:
            ctx.scratch.drop(url)
    else:
        url = ctx.scratch.fresh(backend)
        server = ctx.scratch.server_cpu(url)
        try:
            FILLS.get(system, backlog.fill)(url, ctx.backlog)
            reports = ctx.clients.run(SYSTEMS[system], processes, seconds, url=url, server=server)
        finally:
            ctx.scratch.drop(url)
    done, span = harness.throughput(reports)
    ctx.out.emit(
        case="dispatch",
        system=system,
        **harness.note(system),
        db=backend,
        processes=processes,
        rep=rep,
        backlog=ctx.backlog,
        effects=done,
        seconds=span,
        effects_per_s=done / span,
        **harness.cpu_per_op(reports, None if system in peers.DRAINERS else server),
    )
