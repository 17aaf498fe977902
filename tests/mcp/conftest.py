"""Fixtures for the MCP surface and approvals: a database with two tenants, tokens, a provider."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fake_provider import ProviderConfig, create_app
from outbox.service import Outbox
from tests.dispatcher.support import Provider, provider_on
from tests.mcp import support


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def box(db_url: str) -> Iterator[Outbox]:
    box = support.make_box(db_url, registry=support.registry_with_refund())
    yield box
    box.close()


@pytest.fixture
def agent_token(box: Outbox) -> str:
    return box.create_token(support.TENANT, "agent", "mcp test agent")


@pytest.fixture
def operator_token(box: Outbox) -> str:
    return box.create_token(support.TENANT, "operator", "mcp test operator")


@pytest.fixture
def other_token(box: Outbox) -> str:
    return box.create_token(support.OTHER, "agent", "another tenant's agent")


@pytest.fixture
def provider() -> Iterator[Provider]:
    app = create_app(ProviderConfig(seed=0))
    with provider_on(app, "asgi") as provider:
        yield provider
    app.state.ledger.close()
