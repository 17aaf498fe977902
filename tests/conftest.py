"""Shared fixtures: a fresh, migrated database per test, on SQLite and on PostgreSQL.

Backend choice is a test parameter (``db_url``), not a code path in tests.
PostgreSQL runs wherever ``OUTBOX_TEST_POSTGRES_URL`` is set (``make test`` sets
it when the local server answers). In CI (``CI=true``) a missing server is a
failure, never a silent skip.

PostgreSQL isolation: one template database per test session is migrated once;
each test gets ``CREATE DATABASE ... TEMPLATE`` of it, dropped afterwards.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import db, faults, logs, settings
from outbox.creating import create

POSTGRES_URL = os.environ.get("OUTBOX_TEST_POSTGRES_URL", "")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

_counter = itertools.count()


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _admin_engine() -> sa.Engine:
    url = db.normalise_url(POSTGRES_URL)
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


def _pg_url(name: str) -> str:
    return db.normalise_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[str]:
    """A migrated template database; tests clone it."""
    if not POSTGRES_URL:
        if IN_CI:
            pytest.fail(
                "CI=true but OUTBOX_TEST_POSTGRES_URL is not set: PostgreSQL tests must run"
            )
        pytest.skip("OUTBOX_TEST_POSTGRES_URL is not set")
    name = f"outbox_tmpl_{_worker()}_{uuid.uuid4().hex[:8]}"
    admin = _admin_engine()
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except sa.exc.OperationalError as exc:
        if IN_CI:
            pytest.fail(f"PostgreSQL at OUTBOX_TEST_POSTGRES_URL does not answer: {exc}")
        pytest.skip(f"PostgreSQL does not answer: {exc}")
    engine = db.create_engine(settings.load(), url=_pg_url(name), poolclass=sa.pool.NullPool)
    db.upgrade(engine)
    engine.dispose()
    yield name
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def postgres_url(postgres_template: str) -> Iterator[str]:
    name = f"outbox_t_{_worker()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    admin = _admin_engine()
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE "{postgres_template}"')
    try:
        yield _pg_url(name)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    engine = db.create_engine(settings.load(), url=url)
    db.upgrade(engine)
    engine.dispose()
    return url


@pytest.fixture(
    params=[
        pytest.param("sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def db_url(request: pytest.FixtureRequest) -> str:
    """A fresh, migrated database: SQLite file or PostgreSQL clone."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def backend(db_url: str) -> str:
    return "sqlite" if db_url.startswith("sqlite") else "postgres"


class Clock:
    """A clock the test moves by hand. Always timezone-aware UTC."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, delta: timedelta | float) -> datetime:
        self.now += delta if isinstance(delta, timedelta) else timedelta(seconds=delta)
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_settings() -> Callable[..., settings.Settings]:
    def make(**overrides: object) -> settings.Settings:
        return settings.load(**overrides)

    return make


@pytest.fixture(autouse=True)
def _logging_put_back() -> Iterator[None]:
    """A command run in-process (``reconciler``, ``mcp``) configures logging as a
    process does: a root handler on the stderr of its moment, which pytest closes
    after the test. Left in place, it would fail the next test that logs."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    quieted = {name: logging.getLogger(name).level for name in logs.QUIETED}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in quieted.items():
        logging.getLogger(name).setLevel(was)


@pytest.fixture(autouse=True)
def _no_armed_faults() -> Iterator[None]:
    yield
    faults.disarm()


@pytest.fixture(autouse=True)
def _replays_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no history of replays: the create path it takes
    (optimistic, or lookup first) is then the test's, not its predecessors'."""
    monkeypatch.setattr(create, "_REPLAYS", create._ReplayShare())
