"""Case 4: from the commit of a create to the start of its delivery.

A producer process commits creates at a fixed rate and notes when each call
returned (the commit). A consumer process runs the system's worker and notes
when each delivery starts. Both use CLOCK_MONOTONIC, which is one clock for the
whole machine on Linux.

Outbox: ``Outbox.execute`` in the producer; ``Dispatcher.run()`` in the
consumer (woken by LISTEN/NOTIFY on PostgreSQL, by its poll interval on SQLite).
Baseline (PostgreSQL): INSERT + NOTIFY in one transaction, and a LISTENing
consumer that claims at once. Peers: pgqueuer and procrastinate enqueueing and
consuming with their LISTEN/NOTIFY wake-ups.

Outbox and raw also note how long the claim that took each row ran
(``claim_p50_ms``): Outbox's claim is one statement that also writes and
commits the attempt row, the evidence that must be on disk before the send.

The producer never starts a create after the window ends: on a loaded host it
can fall behind its schedule (a create slower than 1/rate), and creates
committed later than the consumer's drain would be counted as undelivered
although nobody listened for them. What it could not send in time is reported
as ``unsent``, and how far it fell behind as ``behind_ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg

from bench.perf import backlog, create_path, harness, peers

# The consumer keeps listening this long after the producer stops.
DRAIN_S = 1.5
# The consumer gets this long to connect and LISTEN before the first create.
PRODUCER_DELAY_S = 1.0
SQLITE_POLL_MS = 100


def _schedule(start_at: float, end_at: float, rate: float) -> list[float]:
    count = int((end_at - start_at) * rate)
    return [start_at + i / rate for i in range(count)]


def _produce(start_at: float, end_at: float, rate: float, one: Any) -> dict[str, Any]:
    committed: dict[str, float] = {}
    schedule = _schedule(start_at + PRODUCER_DELAY_S, end_at, rate)
    behind = 0.0
    for i, at in enumerate(schedule):
        if time.monotonic() >= end_at:
            break  # behind schedule: nobody listens for what commits after the drain
        harness.wait_until(at)
        behind = max(behind, time.monotonic() - at)
        key = f"lat-{i}"
        one(key, i)
        committed[key] = time.monotonic()
    return _produced(committed, len(schedule), behind)


def _produced(committed: dict[str, float], scheduled: int, behind: float) -> dict[str, Any]:
    return {
        "committed": committed,
        "unsent": scheduled - len(committed),
        "behind_ms": behind * 1000,
    }


# --- Outbox -----------------------------------------------------------------------


class _Recording:
    """A no-op adapter that notes when each delivery starts."""

    def __init__(self, name: str, seen: dict[str, float]) -> None:
        from adapters.testing import NoopAdapter

        self._noop = NoopAdapter(name)
        self.name = name
        self.capabilities = self._noop.capabilities
        self.seen = seen

    def deliver(self, request: Any) -> Any:
        self.seen.setdefault(request.operation_id, time.monotonic())
        return self._noop.deliver(request)

    def lookup(self, effect_key: str, reference: str | None) -> Any:
        return self._noop.lookup(effect_key, reference)

    def close(self) -> None:
        pass


def outbox_latency(
    *, client: int, start_at: float, end_at: float, url: str, rate: float
) -> dict[str, Any]:
    import adapters
    from outbox import Outbox, db, settings
    from outbox.delivery.dispatcher import Dispatcher

    config = settings.load(
        sqlite_synchronous="NORMAL", poll_interval=timedelta(milliseconds=SQLITE_POLL_MS)
    )
    if client == 1:
        box = Outbox(url, config=config)
        try:
            args = create_path.arguments(0, 0)
            return _produce(
                start_at,
                end_at,
                rate,
                lambda key, _i: box.execute(harness.TENANT, key, "create_support_task", args),
            )
        finally:
            box.close()
    seen: dict[str, float] = {}
    claims: dict[str, float] = {}
    engine = db.create_engine(config, url=url)
    registry = adapters.Registry([_Recording("helpdesk", seen)])
    dispatcher = Dispatcher(engine, registry, config, worker_id="bench-latency")
    ready = threading.Event()
    with _claims_timed(claims):
        thread = threading.Thread(target=dispatcher.run, kwargs={"ready": ready}, daemon=True)
        thread.start()
        ready.wait(10)
        harness.wait_until(end_at + DRAIN_S)
        dispatcher.request_stop()
        thread.join(15)
    dispatcher.close()
    engine.dispose()
    return {"seen": seen, "claims": claims}


@contextlib.contextmanager
def _claims_timed(claims: dict[str, float]) -> Iterator[None]:
    """Note how long the claim that took each row ran (``store.claim_due``: the
    statement that claims it and commits its attempt row, and the Python around
    it), so a delivery's latency splits into the claim and what follows it. The
    wrapper adds one call a pass, and is gone after: the client process serves
    the run's later cases."""
    from outbox.delivery import store

    claim_due = store.claim_due

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        claim = claim_due(*args, **kwargs)
        took = time.monotonic() - began
        for effect in claim.effects:
            claims[effect.operation_id] = took
        return claim

    store.claim_due = timed
    try:
        yield
    finally:
        store.claim_due = claim_due


# --- raw INSERT + NOTIFY ------------------------------------------------------------


def raw_latency(
    *, client: int, start_at: float, end_at: float, url: str, rate: float
) -> dict[str, Any]:
    if client == 1:
        with psycopg.connect(backlog.conninfo(url)) as conn:

            def one(key: str, i: int) -> None:
                _task, effect = create_path._rows(0, i, _now())
                effect["operation_id"] = key
                conn.execute(create_path._insert_sql("raw_outbox", effect, "pyformat"), effect)
                conn.execute("SELECT pg_notify('raw_bench', '')")
                conn.commit()

            return _produce(start_at, end_at, rate, one)
    seen: dict[str, float] = {}
    claims: dict[str, float] = {}
    with (
        psycopg.connect(backlog.conninfo(url), autocommit=True) as listener,
        psycopg.connect(backlog.conninfo(url)) as worker,
    ):
        listener.execute("LISTEN raw_bench")
        claim = """UPDATE raw_outbox SET status = 'in_flight', lease_owner = 'raw',
                       lease_expires_at = now() + interval '60 seconds', fence = fence + 1
                   WHERE id IN (SELECT id FROM raw_outbox WHERE status = 'pending'
                       ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED)
                   RETURNING id, operation_id"""
        ack = """UPDATE raw_outbox SET status = 'succeeded', provider_ref = 'noop',
                     finished_at = now(), lease_owner = NULL, lease_expires_at = NULL
                 WHERE id = ANY(%s)"""
        while time.monotonic() < end_at + DRAIN_S:
            for _ in listener.notifies(timeout=0.2, stop_after=1):
                began = time.monotonic()
                rows = worker.execute(claim).fetchall()
                worker.commit()
                took = time.monotonic() - began
                for _id, op in rows:
                    seen.setdefault(op, time.monotonic())
                    claims[op] = took
                if rows:
                    worker.execute(ack, ([r[0] for r in rows],))
                    worker.commit()
    return {"seen": seen, "claims": claims}


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


# --- peers ----------------------------------------------------------------------------


def pgqueuer_latency(
    *, client: int, start_at: float, end_at: float, url: str, rate: float
) -> dict[str, Any]:
    if client == 1:

        async def produce() -> dict[str, Any]:
            conn, queries = await peers._pgq(url)
            committed: dict[str, float] = {}
            schedule = _schedule(start_at + PRODUCER_DELAY_S, end_at, rate)
            behind = 0.0
            try:
                for i, at in enumerate(schedule):
                    if time.monotonic() >= end_at:
                        break
                    await asyncio.sleep(max(0.0, at - time.monotonic()))
                    behind = max(behind, time.monotonic() - at)
                    key = f"lat-{i}"
                    await queries.enqueue("noop", key.encode())
                    committed[key] = time.monotonic()
            finally:
                await conn.close()
            return _produced(committed, len(schedule), behind)

        return asyncio.run(produce())
    seen: dict[str, float] = {}

    def on_job(job: Any) -> None:
        seen.setdefault(bytes(job.payload).decode(), time.monotonic())

    asyncio.run(peers._pgq_consume(url, end_at + DRAIN_S, on_job))
    return {"seen": seen}


def procrastinate_latency(
    *, client: int, start_at: float, end_at: float, url: str, rate: float
) -> dict[str, Any]:
    if client == 1:

        async def produce() -> dict[str, Any]:
            app = peers._procrastinate_app(url, [0])
            committed: dict[str, float] = {}
            schedule = _schedule(start_at + PRODUCER_DELAY_S, end_at, rate)
            behind = 0.0
            async with app.open_async():
                for i, at in enumerate(schedule):
                    if time.monotonic() >= end_at:
                        break
                    await asyncio.sleep(max(0.0, at - time.monotonic()))
                    behind = max(behind, time.monotonic() - at)
                    key = f"lat-{i}"
                    await app.bench_noop.defer_async(payload=key)
                    committed[key] = time.monotonic()
            return _produced(committed, len(schedule), behind)

        return asyncio.run(produce())
    seen: dict[str, float] = {}

    def on_job(kwargs: dict[str, Any]) -> None:
        seen.setdefault(kwargs["payload"], time.monotonic())

    asyncio.run(peers._procrastinate_consume(url, end_at + DRAIN_S, on_job))
    return {"seen": seen}


SYSTEMS = {
    "outbox": outbox_latency,
    "raw": raw_latency,
    "pgqueuer": pgqueuer_latency,
    "procrastinate": procrastinate_latency,
}


def run(ctx: Any) -> None:
    seconds = ctx.latency_seconds
    for rep in range(ctx.reps):
        for backend in ctx.backends:
            systems = ["outbox"]
            if backend == "postgres":
                systems += ["raw"]
                if not ctx.quick:  # quick mode: regressions against the baseline only
                    systems += [name for name in peers.DRAINERS if peers.available(name)]
            for system in harness.rotated(systems, rep):
                _measure(ctx, rep, backend, system, seconds)


def _measure(ctx: Any, rep: int, backend: str, system: str, seconds: float) -> None:
    peer = system in peers.DRAINERS
    url = ctx.scratch.postgres(migrated=False) if peer else ctx.scratch.fresh(backend)
    try:
        if peer:
            ctx.clients.call(peers.prepare_backlog, system, url, 0)
        consumer, producer = ctx.clients.run(
            SYSTEMS[system], 2, seconds + PRODUCER_DELAY_S, url=url, rate=ctx.latency_rate
        )
    finally:
        ctx.scratch.drop(url)
    committed, seen = producer["committed"], consumer["seen"]
    latencies = sorted(
        max(0.0, seen[key] - at) * 1000 for key, at in committed.items() if key in seen
    )
    missing = len(committed) - len(latencies)
    # A create never delivered within the window counts as infinitely late.
    latencies += [float("inf")] * missing
    row: dict[str, Any] = {
        "case": "latency",
        "system": system,
        "db": backend,
        "rate": int(ctx.latency_rate),
        "rep": rep,
        "seconds": seconds,
        "creates": len(committed),
        "unsent": producer["unsent"],
        "behind_ms": producer["behind_ms"],
        "undelivered": missing,
        "p50_ms": harness.percentile(latencies, 0.50),
        "p90_ms": harness.percentile(latencies, 0.90),
        "p99_ms": harness.percentile(latencies, 0.99),
        "max_ms": latencies[-1] if latencies else float("nan"),
    }
    if backend == "sqlite":
        row["poll_ms"] = SQLITE_POLL_MS
    # Outbox and raw: how long the claim that took each row ran, for the rows delivered.
    took = sorted(t * 1000 for key, t in consumer.get("claims", {}).items() if key in committed)
    if took:
        row["claim_p50_ms"] = harness.percentile(took, 0.50)
    ctx.out.emit(**row)
