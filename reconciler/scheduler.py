"""``outbox reconciler``: APScheduler wiring only; the work is in ``sweeps``.

One interval job per sweep (``OUTBOX_SWEEP_INTERVAL``; retention on
``OUTBOX_RETENTION_INTERVAL``), each with ``max_instances=1`` and
``coalesce=True``: a slow pass is never overlapped by the next one of the same
sweep in this process, and missed runs collapse into one. Other reconciler
processes may run the same sweeps at the same time; the sweeps themselves make
that safe (row claims), not the scheduler.

SIGTERM or SIGINT stops the scheduler and waits for the running passes to
finish, so a lookup in progress records its answer before the process exits.
The scheduler is APScheduler 3.x; keeping this module thin means the 4.x API
never leaks into the sweeps.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import Counter

from outbox import metrics
from reconciler import sweeps

logger = logging.getLogger("reconciler")
# How often the main thread wakes to run a signal handler another thread received.
SIGNAL_CHECK_SECONDS = 0.2

# Rows handled and passes run are outbox.metrics' SWEEP_ROWS / SWEEP_RUNS.
SWEEP_FAILURES = Counter(
    "outbox_sweep_failures_total", "Reconciler sweep passes that raised", ["sweep"]
)

OnRun = Callable[[str, int | None], None]
"""Called after every pass: the sweep's name and what it handled (None: it raised)."""


def default_worker_id() -> str:
    return f"reconciler-{socket.gethostname()}-{os.getpid()}"


class Reconciler:
    """The sweeps on a schedule. ``run(stop)`` blocks until ``stop`` is set."""

    def __init__(
        self,
        jobs: Sequence[tuple[sweeps.Sweep, timedelta]],
        *,
        on_run: OnRun | None = None,
    ) -> None:
        self.jobs = list(jobs)
        self.on_run = on_run

    def _pass(self, sweep: sweeps.Sweep) -> None:
        try:
            handled = sweep.run_once()
        except Exception:
            # One failed pass (a database restart, a lock timeout) must not stop
            # the schedule: log it and try again at the next interval.
            logger.exception("sweep %s failed; it runs again at the next interval", sweep.name)
            SWEEP_FAILURES.labels(sweep.name).inc()
            if self.on_run:
                self.on_run(sweep.name, None)
            return
        metrics.SWEEP_RUNS.labels(sweep.name).inc()
        metrics.SWEEP_ROWS.labels(sweep.name).inc(handled)
        if handled:
            logger.info(
                "sweep %s handled %d",
                sweep.name,
                handled,
                extra={"sweep": sweep.name, "count": handled},
            )
        if self.on_run:
            self.on_run(sweep.name, handled)

    def run(self, stop: threading.Event) -> None:
        scheduler = BackgroundScheduler(timezone=UTC)
        start = datetime.now(UTC)
        for sweep, interval in self.jobs:
            scheduler.add_job(
                self._pass,
                IntervalTrigger(seconds=interval.total_seconds(), timezone=UTC),
                args=[sweep],
                id=sweep.name,
                name=sweep.name,
                max_instances=1,
                coalesce=True,
                next_run_time=start,  # a first pass right away, not one interval later
                misfire_grace_time=None,
            )
        scheduler.start()
        logger.info("reconciler started: %s", ", ".join(s.name for s, _ in self.jobs))
        try:
            # With a timeout: a SIGTERM the kernel hands to another thread only
            # flags the main thread, which must wake to run the handler. A bare
            # wait() slept through it (seen as a reconciler that ignored SIGTERM).
            while not stop.wait(SIGNAL_CHECK_SECONDS):
                pass
        finally:
            # wait=True: passes in progress finish and record what they did.
            scheduler.shutdown(wait=True)
            logger.info("reconciler stopped")


def jobs_for(
    all_sweeps: Sequence[sweeps.Sweep], config: Any
) -> list[tuple[sweeps.Sweep, timedelta]]:
    """Each sweep with its interval: retention on its own, longer one."""
    return [
        (
            sweep,
            config.retention_interval
            if sweep.name == sweeps.ApplyRetention.name
            else config.sweep_interval,
        )
        for sweep in all_sweeps
    ]


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (only the main thread may install handlers)."""

    def handle(signum: int, _frame: FrameType | None) -> None:
        logger.info("signal %s: stopping after the passes in progress", signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
