"""One chaos phase, from an empty database to checked invariants.

A phase is one whole stack on its own scratch database: a fake provider in
one mode, the API, K dispatchers and a reconciler, all started from their
command lines. The bundled tool sends every effect to the adapter named
``helpdesk`` and a process reads its adapters once, at start, so the provider
mode (honour; ignore with lookup; ignore without lookup) is a property of the
stack: one phase per mode, one after the other, each with its own
``OUTBOX_ADAPTERS`` file. Running them one after another, not side by side,
keeps every phase's processes on the machine's cores alone, so its kills land
on busy processes and its figures are its own.

Steps: migrate; create the tenant and an agent token (Python API); start the
provider and set its fault plan; start the API, the dispatchers and the
reconciler; run the load while the monkey kills and restarts; stop the faults;
drain (reconciler passes, then the automatic operator until nothing is left
unknown); stop everything; check.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import httpx
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bench.chaos import invariants, load, monkey, operator, procs
from outbox import db, schema, settings
from outbox.service import Outbox
from outbox.states import EffectStatus

S = EffectStatus
TENANT = "chaos"
PG_ADMIN_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"

# Short settings for a fast run; every process of the phase gets them.
SERVICE_ENV = {
    "OUTBOX_LEASE_DURATION": "3s",
    "OUTBOX_LEASE_RENEW_INTERVAL": "1s",
    "OUTBOX_SWEEP_INTERVAL": "1s",
    "OUTBOX_POLL_INTERVAL": "0.1s",
    "OUTBOX_EFFECT_DEADLINE": "20s",  # shorter than a phase: rows live past theirs
    "OUTBOX_BACKOFF_INITIAL": "0.05s",
    "OUTBOX_BACKOFF_MAX": "1s",
    "OUTBOX_LOOKUP_BACKOFF": "1s",
    "OUTBOX_BREAKER_COOLDOWN": "0.5s",
    "OUTBOX_BREAKER_COOLDOWN_MAX": "2s",
    # The budget is proven by its own tests; here it would only stretch the drain.
    "OUTBOX_RETRY_BUDGET_MIN_PER_WINDOW": "100000",
    "OUTBOX_SHUTDOWN_GRACE": "2s",
    # One tenant calls as fast as the workers go: the chaos run is about crashes and
    # faults; rate limits have their own tests (tests/api/test_ratelimit.py; the fairness figure: make bench-flood).
    "OUTBOX_RATE_LIMIT": "none",
    "OUTBOX_LOG_LEVEL": "WARNING",
}
LEASE_S = 3.0
SWEEP_S = 1.0
RESTART_ALLOWANCE_S = 3.0  # a killed reconciler is back within this
DEADLINE_TOLERANCE = timedelta(seconds=SWEEP_S + LEASE_S + RESTART_ALLOWANCE_S)

# The providers' fault plan while the load runs (the rest of each POST is "ok").
FAULT_RATES = {
    "drop_after_commit": 0.04,  # ticket committed, connection aborted: ambiguous
    "fail_after_commit": 0.04,  # ticket committed, then a 500: ambiguous
    "fail_before_commit": 0.04,  # a 500 with nothing stored: ambiguous to us
    "rate_limit": 0.05,  # 429 with Retry-After
    "unavailable": 0.02,  # 503 with Retry-After
    "reject": 0.01,  # 400: permanent, nothing stored
}
LATENCY_MS = {"min": 0, "max": 30}


@dataclass(frozen=True)
class Phase:
    name: str
    mode: str  # the provider's: honour | ignore
    lookup: bool

    @property
    def honours_keys(self) -> bool:
        return self.mode == "honour"


PHASES = {
    "honour": Phase("honour", "honour", True),
    "ignore_lookup": Phase("ignore_lookup", "ignore", True),
    "ignore_nolookup": Phase("ignore_nolookup", "ignore", False),
}


@dataclass
class PhaseResult:
    database: str
    phase: str
    figures: dict[str, Any] = field(default_factory=dict)
    violations: list[invariants.Violation] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.violations


@dataclass(frozen=True)
class PhaseOptions:
    database: str  # sqlite | postgres
    operations: int
    kills: int
    # The phase's time bound. None: bounded by count alone, for the test suite on a
    # busy machine: every planned call is made, every kill lands (paced by the load's
    # progress, not the clock), and the drain waits for the rows to settle.
    seconds: float | None
    seed: int
    dispatchers: int
    workers: int
    run_dir: Path
    pg_admin_url: str = PG_ADMIN_URL_DEFAULT
    # How late past its deadline an effect may still be moving before it counts as a
    # breach. The default is the promise (one sweep, one lease, one restart); a run on a
    # machine whose speed we do not know can only check that it is finite.
    deadline_tolerance: timedelta = field(default_factory=lambda: DEADLINE_TOLERANCE)
    # A safety net for count-bounded runs, never reached on a working stack: a drain
    # still moving after this long reports "incomplete" instead of hanging.
    drain_limit_s: float = 600.0
    # The infrastructure scenarios (``bench.chaos.scenarios``): given the scratch
    # database's direct URL, the URL the service's processes use (a pooler's) and
    # their extra OUTBOX_* settings; settings stored on the scratch database;
    # whether the monkey also terminates backends; a disturbance started with the load.
    service: Callable[[str], tuple[str, Mapping[str, str]]] | None = None
    database_settings: Mapping[str, str] = field(default_factory=dict)
    terminate_backends: bool = True
    disturbance: Callable[[Callable[[], float | None]], Disturbance] | None = None


class Disturbance(Protocol):
    """Something done to the infrastructure while the load runs (a failover)."""

    def start(self) -> None: ...

    def finish(self, timeout: float) -> None: ...

    def figures(self) -> dict[str, Any]: ...

    @property
    def errors(self) -> list[str]: ...


# --- scratch databases ----------------------------------------------------------------


class ScratchDatabase:
    """A migrated database for one phase; ``drop()`` removes it (PostgreSQL)."""

    def __init__(self, options: PhaseOptions, phase: Phase) -> None:
        self.kind = options.database
        self.admin: Engine | None = None
        self.name = ""
        if self.kind == "sqlite":
            self.url = f"sqlite:///{options.run_dir / f'{phase.name}.db'}"
        else:
            self.name = f"outbox_chaos_{os.getpid()}_{phase.name}_{uuid.uuid4().hex[:6]}"
            admin_url = db.normalise_url(options.pg_admin_url)
            self.admin = sa.create_engine(
                admin_url,
                isolation_level="AUTOCOMMIT",
                poolclass=sa.pool.NullPool,
                connect_args={"application_name": monkey.HARNESS_APPLICATION_NAME},
            )
            with self.admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{self.name}"')
                for name, value in options.database_settings.items():
                    # Session settings a transaction pooler cannot carry: the database's own.
                    conn.exec_driver_sql(f"ALTER DATABASE \"{self.name}\" SET {name} = '{value}'")
            self.url = admin_url.set(database=self.name).render_as_string(hide_password=False)
        engine = db.create_engine(settings.load(), url=self.url, poolclass=sa.pool.NullPool)
        try:
            db.upgrade(engine)
        finally:
            engine.dispose()

    def harness_engine(self) -> Engine:
        """Our own reads and review actions: a connection the monkey never terminates."""
        if self.kind == "sqlite":
            return db.create_engine(settings.load(), url=self.url, poolclass=sa.pool.NullPool)
        return sa.create_engine(
            db.normalise_url(self.url),
            pool_pre_ping=True,
            connect_args={
                "options": "-c timezone=UTC",
                "application_name": monkey.HARNESS_APPLICATION_NAME,
            },
        )

    def drop(self) -> None:
        if self.admin is None:
            return
        try:
            with self.admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        finally:
            self.admin.dispose()


# --- watching the database while the phase runs ----------------------------------------


class Watcher:
    """Samples the outbox every half second: first-seen keys, unknown outcomes, deadlines."""

    def __init__(self, engine: Engine, tolerance: timedelta = DEADLINE_TOLERANCE) -> None:
        self.engine = engine
        self.tolerance = tolerance
        self.keys: dict[int, str] = {}
        self.unknown: set[int] = set()
        self.breaches: dict[int, dict[str, Any]] = {}
        self.errors = 0
        self._last_id = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sample()  # one last look, with everything settled

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a terminated backend: the next sample
                self.errors += 1

    def sample(self) -> None:
        out = schema.outbox
        now = datetime.now(UTC)
        with db.read(self.engine) as conn:
            for row in conn.execute(
                sa.select(out.c.id, out.c.effect_key)
                .where(out.c.id > self._last_id)
                .order_by(out.c.id)
            ):
                self.keys.setdefault(row.id, row.effect_key)
                self._last_id = max(self._last_id, row.id)
            self.unknown.update(
                conn.execute(sa.select(out.c.id).where(out.c.status == S.OUTCOME_UNKNOWN))
                .scalars()
                .all()
            )
            late = conn.execute(
                sa.select(out.c.id, out.c.status, out.c.deadline_at, out.c.attempts).where(
                    out.c.status.in_([S.PENDING, S.IN_FLIGHT]),
                    out.c.deadline_at < now - self.tolerance,
                )
            ).all()
        for row in late:
            self.breaches.setdefault(
                row.id,
                {
                    "effect_id": row.id,
                    "status": str(row.status),
                    "deadline_at": row.deadline_at.isoformat(),
                    "seen_at": now.isoformat(),
                    "attempts": row.attempts,
                },
            )


# --- the stack ---------------------------------------------------------------------------


def _adapters_toml(path: Path, base_url: str, phase: Phase) -> None:
    path.write_text(
        "[adapters.helpdesk]\n"
        'kind = "helpdesk"\n'
        f'base_url = "{base_url}"\n'
        f"honours_idempotency_keys = {'true' if phase.honours_keys else 'false'}\n"
        f"supports_lookup = {'true' if phase.lookup else 'false'}\n"
        "lookup_settle_seconds = 1.0\n"
        "connect_timeout = 1.0\n"
        "read_timeout = 5.0\n"
        "total_timeout = 5.0\n",
        encoding="utf-8",
    )


def _status_counts(engine: Engine) -> Counter[str]:
    out = schema.outbox
    with db.read(engine) as conn:
        rows = conn.execute(
            sa.select(out.c.status, out.c.needs_review, sa.func.count()).group_by(
                out.c.status, out.c.needs_review
            )
        ).all()
    counts: Counter[str] = Counter()
    for status, needs_review, n in rows:
        key = str(status)
        if status == S.OUTCOME_UNKNOWN:
            key += ":review" if needs_review else ":lookup"
        counts[key] += n
    return counts


def run_phase(phase: Phase, options: PhaseOptions, log: Any = print) -> PhaseResult:
    result = PhaseResult(options.database, phase.name)
    started = time.monotonic()
    phase_dir = options.run_dir / f"{options.database}-{phase.name}"
    phase_dir.mkdir(parents=True, exist_ok=True)
    scratch: ScratchDatabase | None = None
    supervisor: procs.Supervisor | None = None
    engine: Engine | None = None
    try:
        scratch = ScratchDatabase(options, phase)
        engine = scratch.harness_engine()
        with Outbox(scratch.url) as box:
            box.create_tenant(TENANT)
            token = box.create_token(TENANT, "agent", "chaos load")

        provider_port, api_port = procs.free_port(), procs.free_port()
        provider_url = f"http://{procs.HOST}:{provider_port}"
        api_url = f"http://{procs.HOST}:{api_port}"
        adapters_file = phase_dir / "adapters.toml"
        _adapters_toml(adapters_file, provider_url, phase)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update(SERVICE_ENV)
        service_url, service_env = (
            options.service(scratch.url) if options.service else (scratch.url, {})
        )
        env.update(
            {
                "OUTBOX_DATABASE_URL": service_url,
                "OUTBOX_ADAPTERS": str(adapters_file),
                "PYTHONUNBUFFERED": "1",
                **service_env,
            }
        )
        supervisor = procs.Supervisor(phase_dir, env)
        provider_args = [
            "serve",
            "--host",
            procs.HOST,
            "--port",
            str(provider_port),
            "--mode",
            phase.mode,
            "--db",
            str(phase_dir / "provider.db"),
            "--seed",
            str(options.seed),
            "--log-level",
            "warning",
        ]
        if not phase.lookup:
            provider_args.append("--no-lookup")
        provider = supervisor.add("provider", procs.python_module("fake_provider", *provider_args))
        procs.wait_http(f"{provider_url}/_admin/health", child=provider)
        cli = ("outbox.cli", "--database-url", service_url)
        api = supervisor.add("api", procs.python_module(*cli, "serve", "--port", str(api_port)))
        for i in range(options.dispatchers):
            supervisor.add(f"dispatcher-{i}", procs.python_module(*cli, "dispatcher"))
        supervisor.add("reconciler", procs.python_module(*cli, "reconciler"))
        procs.wait_http(f"{api_url}/healthz", child=api)
        set_faults(provider_url, FAULT_RATES, LATENCY_MS, seed=options.seed)
        result.figures["start-up seconds"] = round(time.monotonic() - started, 1)

        if options.seconds is None:
            load_stop_at = monkey_stop_at = None
            drain_until = time.monotonic() + options.drain_limit_s
        else:
            load_stop_at = started + options.seconds * 0.55
            monkey_stop_at = started + options.seconds * 0.65
            drain_until = started + options.seconds - 5.0
        jobs, keys = load.build_plan(options.operations, options.seed, phase.name)
        generator = load.LoadGenerator(
            api_url,
            token,
            jobs,
            keys,
            workers=options.workers,
            stop_at=load_stop_at,
        )
        load_done = threading.Event()

        def progress() -> float | None:
            if load_done.is_set():
                return None
            return generator.done_calls / max(1, generator.report.planned_calls)

        pg_admin = (
            scratch.admin if options.database == "postgres" and options.terminate_backends else None
        )
        chaos = monkey.Monkey(
            supervisor,
            kills=options.kills,
            rng=random.Random(f"{options.seed}:{phase.name}:monkey"),
            progress=progress,
            stop_at=monkey_stop_at,
            pg_admin=pg_admin,
            pg_database=scratch.name or None,
        )
        watcher = Watcher(engine, options.deadline_tolerance)
        watcher.start()
        chaos.start()
        disturbance = options.disturbance(progress) if options.disturbance else None
        if disturbance is not None:
            disturbance.start()
        log(f"  [{options.database}/{phase.name}] load: {len(jobs)} jobs, {len(keys)} keys")
        report = generator.run()
        load_done.set()
        load_end = time.monotonic()
        chaos.finish(None if monkey_stop_at is None else monkey_stop_at - time.monotonic())
        if disturbance is not None:
            disturbance.finish(
                timeout=600.0 if monkey_stop_at is None else monkey_stop_at - time.monotonic()
            )
        set_faults(provider_url, {}, {"min": 0, "max": 0})
        faults_seen = httpx.get(f"{provider_url}/_admin/faults", timeout=10).json()["counts"]
        log(
            f"  [{options.database}/{phase.name}] load done in {report.seconds:.1f}s, "
            f"{chaos.kills} kills; draining"
        )

        drained, operator_counts = drain(engine, supervisor, provider_url, api_url, drain_until)
        drain_end = time.monotonic()
        tickets = operator.ledger(provider_url)
        # A clean stop of every process ends the phase: nothing may move while we check.
        for child in supervisor.children.values():
            child.stop()
        watcher.stop()

        evidence = invariants.Evidence(
            honours_keys=phase.honours_keys,
            keys=keys,
            tables=invariants.read_tables(engine),
            tickets=tickets,
            key_snapshots=watcher.keys,
            deadline_breaches=list(watcher.breaches.values()),
            unknown_seen=watcher.unknown,
        )
        checked = invariants.check(evidence)
        result.figures.update(checked.figures)
        result.violations = checked.violations
        injected = {k: v for k, v in faults_seen.items() if k != "ok" and v}
        effects = result.figures.get("effects", 0)
        result.figures.update(
            {
                "calls made": report.calls_made,
                "calls skipped (time bound)": report.calls_skipped,
                "HTTP requests (client retries included)": report.http_attempts,
                "calls made again after the client gave up": report.recalls,
                "calls never answered": report.unavailable_final,
                "kills (kill -9)": chaos.kills,
                "kills by target": {
                    k.removeprefix("kill -9 "): v
                    for k, v in sorted(chaos.counts.items())
                    if k.startswith("kill -9")
                },
                "reconciler SIGTERM restarts": chaos.counts.get("SIGTERM reconciler", 0),
                "restarts": chaos.counts.get("restarts", 0),
                "unexpected exits": {
                    k.removeprefix("unexpected exit "): v
                    for k, v in sorted(chaos.counts.items())
                    if k.startswith("unexpected exit")
                },
                "pg backends terminated": chaos.counts.get("pg backends terminated", 0),
                "provider faults injected": sum(injected.values()),
                "provider faults by kind": injected,
                "operator actions": dict(sorted(operator_counts.items())),
                "load seconds": round(report.seconds, 1),
                "drain seconds": round(drain_end - load_end, 1),
                "phase seconds": round(time.monotonic() - started, 1),
                "throughput: calls per second": round(report.calls_made / report.seconds, 1)
                if report.seconds
                else 0.0,
                "throughput: effects settled per second": round(effects / (drain_end - started), 1),
            }
        )
        if disturbance is not None:
            result.figures.update(disturbance.figures())
        if chaos.errors:
            result.error = "harness errors in the monkey: " + "; ".join(chaos.errors[:5])
        if disturbance is not None and disturbance.errors:
            result.error = "disturbance failed: " + "; ".join(disturbance.errors[:5])
        if not drained:
            result.figures["drain"] = "incomplete within the time bound"
    except Exception as exc:  # noqa: BLE001 - reported as the phase's error
        result.error = f"{type(exc).__name__}: {exc}"
        if supervisor is not None:
            for child in supervisor.children.values():
                result.error += f"\n--- {child.name} (last lines)\n{child.log_tail(15)}"
    finally:
        if supervisor is not None:
            supervisor.close()
        if engine is not None:
            engine.dispose()
        if scratch is not None:
            scratch.drop()
    return result


def set_faults(
    provider_url: str, rates: dict[str, float], latency: dict[str, int], seed: int | None = None
) -> None:
    body: dict[str, Any] = {"rates": rates, "latency_ms": latency}
    if seed is not None:
        body["seed"] = seed
    response = httpx.post(f"{provider_url}/_admin/faults", json=body, timeout=10)
    response.raise_for_status()


def drain(
    engine: Engine,
    supervisor: procs.Supervisor,
    provider_url: str,
    api_url: str,
    deadline: float,
) -> tuple[bool, Counter[str]]:
    """Until nothing is pending, in flight or unknown: the reconciler's passes settle
    what they can, then the operator resolves what only a person could. Bounded."""
    for child in supervisor.children.values():
        child.restart_if_dead()
    procs.wait_http(f"{api_url}/healthz", child=supervisor.named("api")[0])
    effect_deadline = settings.parse_duration(SERVICE_ENV["OUTBOX_EFFECT_DEADLINE"])
    actions: Counter[str] = Counter()
    while time.monotonic() < deadline:
        for child in supervisor.children.values():
            child.restart_if_dead()
        try:
            counts = _status_counts(engine)
        except Exception:  # noqa: BLE001 - a blink of the database: look again
            time.sleep(0.5)
            continue
        moving = counts[S.PENDING] + counts[S.IN_FLIGHT] + counts[f"{S.OUTCOME_UNKNOWN}:lookup"]
        if not moving:
            if not counts[f"{S.OUTCOME_UNKNOWN}:review"]:
                return True, actions
            actions += operator.resolve_pass(engine, provider_url, effect_deadline)
        time.sleep(0.3)
    return False, actions
