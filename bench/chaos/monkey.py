"""The faults of the run's process side: kill -9, restarts, dropped database connections.

``Monkey`` runs on its own thread while the load runs. It kills (SIGKILL, the
whole process group) a random dispatcher or the API, or restarts the
reconciler (SIGKILL or SIGTERM), and starts the victim again at once. Its
quota of kills is spread over the load: the interval is recomputed before each
kill from the load's progress, so a run of any size gets its kills while the
callers and the dispatchers are busy. If the load ends first, the remaining
kills land on the dispatchers' backlog, a little apart. Without a time bound
(``stop_at=None``, the test suite's runs) the kills are paced by the load's
progress alone: kill i of n lands once i/(n+1) of the calls are answered, so a
slow machine gets the same kills at the same points of the load. On PostgreSQL it also
terminates the service's connections (``pg_terminate_backend``) every couple
of seconds. A child that died on its own is restarted and counted as an
unexpected exit: it would be a crash we did not cause.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import sqlalchemy as sa

from bench.chaos.procs import Child, Supervisor

KILL_INTERVAL_MIN_S = 0.6
KILL_INTERVAL_MAX_S = 6.0
PG_TERMINATE_EVERY_S = (1.0, 3.0)
HARNESS_APPLICATION_NAME = "outbox_chaos"


class Monkey:
    def __init__(
        self,
        supervisor: Supervisor,
        *,
        kills: int,
        rng: random.Random,
        progress: Callable[[], float | None],
        stop_at: float | None,
        pg_admin: sa.Engine | None = None,
        pg_database: str | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.quota = kills
        self.rng = rng
        self.progress = progress  # fraction of the load done, None once it has ended
        self.stop_at = stop_at
        self.pg_admin = pg_admin
        self.pg_database = pg_database
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-monkey", daemon=True)
        self._started = 0.0
        self._plan = self._targets()

    @property
    def kills(self) -> int:
        return sum(n for k, n in self.counts.items() if k.startswith("kill -9"))

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def finish(self, timeout: float | None) -> None:
        """Wait for the quota (bounded by ``timeout`` and ``stop_at``, when given), then stop."""
        self._thread.join(None if timeout is None else max(0.0, timeout))
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        next_kill = time.monotonic() + self._interval()
        next_pg = time.monotonic() + self.rng.uniform(*PG_TERMINATE_EVERY_S)
        while not self._stop.is_set() and (self.stop_at is None or time.monotonic() < self.stop_at):
            if self.kills >= self.quota:
                return
            now = time.monotonic()
            try:
                self._revive()
                if self._due(now, next_kill):
                    self._strike()
                    next_kill = time.monotonic() + self._interval()
                if self.pg_admin is not None and now >= next_pg:
                    self._terminate_backends()
                    next_pg = time.monotonic() + self.rng.uniform(*PG_TERMINATE_EVERY_S)
            except Exception as exc:  # noqa: BLE001 - recorded, and the run fails on it
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.05)

    def _due(self, now: float, next_kill: float) -> bool:
        if self.stop_at is not None:
            return now >= next_kill
        done = self.progress()
        return done is None or done >= (self.kills + 1) / (self.quota + 1)

    def _interval(self) -> float:
        left = max(1, self.quota - self.kills)
        done = self.progress()
        elapsed = time.monotonic() - self._started
        if done is None:
            base = KILL_INTERVAL_MIN_S * 1.5
        elif done < 0.05 or elapsed < 1.0:
            base = 1.5
        else:
            remaining = elapsed / done - elapsed
            base = remaining / (left + 0.5)
        base = min(max(base, KILL_INTERVAL_MIN_S), KILL_INTERVAL_MAX_S)
        return base * self.rng.uniform(0.6, 1.4)

    def _targets(self) -> list[str]:
        """The victims of the quota, shuffled: mostly dispatchers, the API and the
        reconciler at least once each when the quota allows."""
        others = max(1, round(self.quota * 0.2)) if self.quota >= 3 else 0
        targets = ["api"] * others + ["reconciler"] * others
        targets += ["dispatcher"] * max(0, self.quota - len(targets))
        self.rng.shuffle(targets)
        return targets

    def _strike(self) -> None:
        target = self._plan[self.kills % len(self._plan)] if self._plan else "dispatcher"
        if target == "dispatcher":
            self._kill(self.rng.choice(self.supervisor.named("dispatcher")), "dispatcher")
        elif target == "api":
            self._kill(self.supervisor.named("api")[0], "api")
        else:
            reconciler = self.supervisor.named("reconciler")[0]
            self._kill(reconciler, "reconciler")
        if self.rng.random() < 0.15:
            # A clean restart too: SIGTERM lets a pass in progress finish first.
            reconciler = self.supervisor.named("reconciler")[0]
            reconciler.stop()
            self.counts["SIGTERM reconciler"] += 1
            reconciler.start()
            self.counts["restarts"] += 1

    def _kill(self, child: Child, kind: str) -> None:
        child.kill()
        self.counts[f"kill -9 {kind}"] += 1
        child.start()
        self.counts["restarts"] += 1

    def _revive(self) -> None:
        for child in list(self.supervisor.children.values()):
            if child.restart_if_dead():
                self.counts[f"unexpected exit {child.name}"] += 1
                self.counts["restarts"] += 1

    def _terminate_backends(self) -> None:
        assert self.pg_admin is not None
        with self.pg_admin.connect() as conn:
            killed = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :db AND pid <> pg_backend_pid() "
                    "AND application_name <> :ours"
                ),
                {"db": self.pg_database, "ours": HARNESS_APPLICATION_NAME},
            ).scalar_one()
        self.counts["pg_terminate_backend rounds"] += 1
        self.counts["pg backends terminated"] += int(killed)
