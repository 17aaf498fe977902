"""Fixtures for the dispatcher tests: an engine per backend, dispatchers, the fake provider."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy.engine import Engine

import adapters
from fake_provider import Mode, ProviderConfig, create_app
from outbox import db, settings
from outbox.delivery.dispatcher import Dispatcher
from tests.dispatcher.support import Provider, provider_on

# Small, explicit numbers so a test can reason about every retry.
TEST_SETTINGS: dict[str, Any] = {
    "backoff_initial": 1,
    "backoff_max": 30,
    "lease_duration": 60,
    "lease_renew_interval": 20,
    "max_attempts": 5,
    "claim_batch_size": 100,
    "concurrency": 4,
    "breaker_failure_threshold": 1000,
    "retry_budget_min_per_window": 1000,
}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = db.create_engine(settings.load(), url=db_url)
    yield engine
    engine.dispose()


MakeDispatcher = Callable[..., Dispatcher]


@pytest.fixture
def make_dispatcher(engine: Engine) -> Iterator[MakeDispatcher]:
    made: list[Dispatcher] = []

    def make(
        *adapter_list: adapters.Adapter, worker_id: str = "w1", seed: int = 7, **overrides: Any
    ) -> Dispatcher:
        config = settings.load(**{**TEST_SETTINGS, **overrides})
        dispatcher = Dispatcher(
            engine,
            adapters.Registry(list(adapter_list)),
            config,
            worker_id=worker_id,
            rng=random.Random(seed),
        )
        made.append(dispatcher)
        return dispatcher

    yield make
    for dispatcher in made:
        dispatcher.close()


@pytest.fixture(params=["asgi", "http"])
def transport_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


MakeProvider = Callable[..., Provider]


@pytest.fixture
def make_provider(transport_kind: str) -> Iterator[MakeProvider]:
    """``make_provider(mode="honour"|"ignore", **ProviderConfig fields)``: started, closed after."""
    stack: list[Any] = []

    def make(**fields: Any) -> Provider:
        if "mode" in fields:
            fields["mode"] = Mode(fields["mode"])
        app = create_app(ProviderConfig(**{"seed": 0, **fields}))
        context = provider_on(app, transport_kind)
        provider = context.__enter__()
        stack.append(context)
        return provider

    yield make
    for context in reversed(stack):
        context.__exit__(None, None, None)
