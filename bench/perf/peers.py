"""The Python peers, pgqueuer and procrastinate, on the same server in the same run.

Installed only by the ``bench`` extra. Each gets its own scratch database with
its own schema, a backlog enqueued in bulk through its own API, and no-op
handlers. Their settings are their documented ones for throughput: pgqueuer
dequeues batches of 100 (as our claim does); procrastinate runs one worker with
``concurrency`` 8 (as our dispatcher's delivery threads), LISTEN/NOTIFY on.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time
from datetime import timedelta
from typing import Any

from bench.perf import backlog

BATCH = 100
ENQUEUE_CHUNK = 5_000
PAYLOAD = backlog.PAYLOAD.encode("utf-8")


def available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# --- pgqueuer ---------------------------------------------------------------


async def _pgq(url: str) -> tuple[Any, Any]:
    import psycopg
    from pgqueuer.adapters.drivers.psycopg import PsycopgDriver
    from pgqueuer.queries import Queries

    conn = await psycopg.AsyncConnection.connect(backlog.conninfo(url), autocommit=True)
    return conn, Queries(PsycopgDriver(conn))


async def _pgq_prepare(url: str, count: int) -> None:
    conn, queries = await _pgq(url)
    try:
        await queries.install()
        for start in range(0, count, ENQUEUE_CHUNK):
            n = min(ENQUEUE_CHUNK, count - start)
            await queries.enqueue(["noop"] * n, [PAYLOAD] * n, [0] * n)
    finally:
        await conn.close()


async def _pgq_drain(
    url: str, start_at: float, end_at: float, on_job: Any = None
) -> dict[str, Any]:
    from pgqueuer.core.qm import QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    conn, queries = await _pgq(url)
    qm = QueueManager(queries)
    done = 0
    last = 0.0

    @qm.entrypoint("noop")
    async def noop(job: Any) -> None:
        nonlocal done, last
        if time.monotonic() >= end_at:
            return  # finished while it stops: past the window, not counted
        done += 1
        last = time.monotonic()
        if on_job is not None:
            on_job(job)

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    started = last = time.monotonic()
    runner = asyncio.create_task(
        qm.run(
            batch_size=BATCH, mode=QueueExecutionMode.drain, dequeue_timeout=timedelta(seconds=1)
        )
    )
    try:
        await asyncio.wait_for(asyncio.shield(runner), timeout=max(0.1, end_at - time.monotonic()))
    except TimeoutError:
        qm.shutdown.set()
        await asyncio.wait_for(runner, timeout=30)
    await conn.close()
    # The span ends with the last job done in the window. Not when the drain returns:
    # once the backlog is gone it waits out its dequeue timeout, and stopping it after
    # the window takes seconds more (a quick run's 10,000 jobs, done in 1.8 s, read as
    # 5.8 s). Our loops end on their first empty claim; this errs in pgqueuer's favour.
    return {"ops": done, "started": started, "ended": last}


# --- procrastinate ------------------------------------------------------------


def _procrastinate_app(
    url: str, counter: list[int], on_job: Any = None, last: list[float] | None = None
) -> Any:
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=backlog.conninfo(url))
    )

    @app.task(name="noop", queue="bench")
    async def noop(**_: Any) -> None:
        counter[0] += 1
        if last is not None:
            last[0] = time.monotonic()
        if on_job is not None:
            on_job(_)

    app.bench_noop = noop  # type: ignore[attr-defined]
    return app


async def _procrastinate_prepare(url: str, count: int) -> None:
    app = _procrastinate_app(url, [0])
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        for start in range(0, count, ENQUEUE_CHUNK):
            n = min(ENQUEUE_CHUNK, count - start)
            await app.bench_noop.batch_defer_async(*[{"payload": backlog.PAYLOAD}] * n)


async def _procrastinate_drain(url: str, start_at: float, end_at: float) -> dict[str, Any]:
    counter, last = [0], [0.0]
    app = _procrastinate_app(url, counter, last=last)
    async with app.open_async():
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        started = last[0] = time.monotonic()
        worker = asyncio.create_task(
            app.run_worker_async(
                queues=["bench"],
                wait=False,
                concurrency=8,
                install_signal_handlers=False,
                listen_notify=True,
                delete_jobs="never",
            )
        )
        try:
            await asyncio.wait_for(
                asyncio.shield(worker), timeout=max(0.1, end_at - time.monotonic())
            )
        except TimeoutError:
            done, ended = counter[0], time.monotonic()  # the window's end
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(worker, timeout=30)
            return {"ops": done, "started": started, "ended": ended}
    # Drained before the window ended (``wait=False``): the span ends with its last job.
    return {"ops": counter[0], "started": started, "ended": last[0]}


# --- entry points run in the client processes -----------------------------------


def prepare_backlog(system: str, url: str, count: int) -> None:
    """The peer's backlog, then ANALYZE, as ours gets (``backlog.fill``).

    Without statistics on a table just filled in bulk the planner guesses, and
    procrastinate's fetch ran 11x slower (64 jobs/s against 736, measured):
    every system starts from an analysed backlog.
    """
    if system == "pgqueuer":
        asyncio.run(_pgq_prepare(url, count))
    else:
        asyncio.run(_procrastinate_prepare(url, count))
    import psycopg

    with psycopg.connect(backlog.conninfo(url), autocommit=True) as conn:
        conn.execute("ANALYZE")


def pgqueuer_drain(*, client: int, start_at: float, end_at: float, url: str) -> dict[str, Any]:
    return asyncio.run(_pgq_drain(url, start_at, end_at))


def procrastinate_drain(*, client: int, start_at: float, end_at: float, url: str) -> dict[str, Any]:
    return asyncio.run(_procrastinate_drain(url, start_at, end_at))


DRAINERS = {"pgqueuer": pgqueuer_drain, "procrastinate": procrastinate_drain}


# --- continuous consumers, for the latency case --------------------------------


async def _pgq_consume(url: str, until: float, on_job: Any) -> None:
    """pgqueuer woken by its LISTEN/NOTIFY, handling jobs as they come, until ``until``."""
    from pgqueuer.core.qm import QueueManager

    conn, queries = await _pgq(url)
    qm = QueueManager(queries)

    @qm.entrypoint("noop")
    async def noop(job: Any) -> None:
        on_job(job)

    runner = asyncio.create_task(qm.run(batch_size=BATCH, dequeue_timeout=timedelta(seconds=1)))
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    qm.shutdown.set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(runner, timeout=30)
    await conn.close()


async def _procrastinate_consume(url: str, until: float, on_job: Any) -> None:
    app = _procrastinate_app(url, [0], on_job)
    async with app.open_async():
        worker = asyncio.create_task(
            app.run_worker_async(
                queues=["bench"], concurrency=8, install_signal_handlers=False, listen_notify=True
            )
        )
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(worker, timeout=30)
