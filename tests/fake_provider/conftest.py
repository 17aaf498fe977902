"""Fixtures for the fake provider: a movable clock, app factories, both transports.

Every outcome test runs twice: in-process (httpx over ASGI, through
``ProviderTransport``) and over real HTTP (uvicorn on an ephemeral loopback
port), because aborted connections and read timeouts only really exist on a
socket.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from fake_provider import ProviderConfig, create_app
from fake_provider.testing import ProviderTransport
from tests.support.servers import serve_in_thread

TRANSPORTS = ["asgi", "http"]


class FakeClock:
    """A clock that moves only when told to, so lag and retention need no sleeps."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


AppFactory = Callable[..., Starlette]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_app(clock: FakeClock) -> Iterator[AppFactory]:
    """Build providers from ``ProviderConfig`` fields (seed 0 unless given); closes them."""
    apps: list[Starlette] = []

    def factory(**fields: Any) -> Starlette:
        app = create_app(ProviderConfig(**{"seed": 0, **fields}), clock=clock)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.state.ledger.close()


@asynccontextmanager
async def open_client(
    app: Starlette, transport: str, **kwargs: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """An async client to ``app``, in-process (``asgi``) or over loopback HTTP (``http``)."""
    kwargs.setdefault("timeout", 5.0)
    if transport == "asgi":
        async with httpx.AsyncClient(
            transport=ProviderTransport(app), base_url="http://provider.test", **kwargs
        ) as client:
            yield client
        return
    with serve_in_thread(app) as base_url:
        async with httpx.AsyncClient(base_url=base_url, **kwargs) as client:
            yield client


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def ticket_body(reference: str | None = "ref-1", **overrides: Any) -> dict[str, Any]:
    """The body our adapter sends: the client reference is the effect key."""
    return {
        "subject": "Printer on fire",
        "body": "Third floor.",
        "priority": "high",
        "client_reference": reference,
        **overrides,
    }
