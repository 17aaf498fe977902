"""Fixtures of the reconciler tests: an ``Outbox`` on the test database with the
test clock, one tenant, and small lookup limits so every path is short."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from outbox import Outbox, settings
from tests.conftest import Clock
from tests.reconciler.support import TENANT

LOOKUP_MAX_TRIES = 3
LOOKUP_BACKOFF = timedelta(seconds=10)


@pytest.fixture
def config(db_url: str) -> settings.Settings:
    return settings.load(
        database_url=db_url,
        lookup_max_tries=LOOKUP_MAX_TRIES,
        lookup_backoff=LOOKUP_BACKOFF,
        effect_deadline=timedelta(minutes=15),
    )


@pytest.fixture
def box(db_url: str, config: settings.Settings, clock: Clock) -> Iterator[Outbox]:
    b = Outbox(db_url, config=config, clock=clock)
    b.create_tenant(TENANT)
    b.create_tenant("globex")
    yield b
    b.close()
