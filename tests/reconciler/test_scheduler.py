"""The scheduler shell: every sweep runs on its interval, a failing pass does not
stop the schedule, and stop() waits for the pass in progress."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from adapters import Registry
from outbox import Outbox
from reconciler import scheduler, sweeps
from tests.support.patience import PATIENCE_S


class Scripted:
    """A sweep that raises on its first pass, then counts."""

    def __init__(self, name: str, fail_first: bool = False) -> None:
        self.name = name
        self.fail_first = fail_first
        self.passes = 0
        self.running = threading.Lock()
        self.overlapped = False

    def run_once(self, now: datetime | None = None) -> int:
        if not self.running.acquire(blocking=False):
            self.overlapped = True
            return 0
        try:
            self.passes += 1
            if self.fail_first and self.passes == 1:
                raise RuntimeError("database went away")
            return 1
        finally:
            self.running.release()


def test_every_sweep_runs_and_a_failed_pass_is_retried() -> None:
    flaky, steady = Scripted("flaky", fail_first=True), Scripted("steady")
    reports: list[tuple[str, int | None]] = []
    done = threading.Event()

    def on_run(name: str, handled: int | None) -> None:
        reports.append((name, handled))
        if ("flaky", 1) in reports and ("steady", 1) in reports:
            done.set()

    jobs: list[tuple[sweeps.Sweep, timedelta]] = [
        (flaky, timedelta(seconds=0.05)),
        (steady, timedelta(seconds=0.05)),
    ]
    stop = threading.Event()
    process = scheduler.Reconciler(jobs, on_run=on_run)
    thread = threading.Thread(target=process.run, args=(stop,))
    thread.start()
    try:
        assert done.wait(PATIENCE_S), reports
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert ("flaky", None) in reports  # the failure was reported, then the schedule went on
    assert not flaky.overlapped and not steady.overlapped


def test_jobs_use_the_configured_intervals(box: Outbox) -> None:
    config = box.settings
    built = sweeps.build(box.engine, Registry(), config)
    intervals = {s.name: i for s, i in scheduler.jobs_for(built, config)}
    assert intervals == {
        "expire_leases": config.sweep_interval,
        "enforce_deadlines": config.sweep_interval,
        "run_lookups": config.sweep_interval,
        "match_webhooks": config.sweep_interval,
        "apply_retention": config.retention_interval,
    }
