"""Fixtures for the HTTP API: an ``Outbox`` per database, tokens, and two ways to reach the app.

``http`` is parametrised: ``asgi`` goes through httpx's ASGI transport in
process, ``uvicorn`` through a real server on an ephemeral loopback port. Both
are driven through the same synchronous facade, so one test body proves both.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio.from_thread
import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI

from outbox import schema
from outbox.api import create_app
from outbox.service import Outbox
from tests.conftest import Clock
from tests.support.servers import serve_in_thread

PROBLEM = "application/problem+json"


@dataclass(frozen=True)
class Tokens:
    acme: str  # agent of tenant acme
    acme_operator: str
    globex: str  # agent of tenant globex
    revoked: str  # was an acme agent token

    def auth(self, token: str, key: str | None = None, **extra: str) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {token}", **extra}
        if key is not None:
            headers["Idempotency-Key"] = key
        return headers


class Http:
    """A synchronous httpx-like facade over either transport."""

    def __init__(self, send: Any, base_url: str) -> None:
        self._send = send
        self.base_url = base_url

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        response: httpx.Response = self._send(method, url, **kwargs)
        return response

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)


@pytest.fixture
def box(db_url: str, clock: Clock) -> Iterator[Outbox]:
    with Outbox(db_url, clock=clock) as box:
        yield box


@pytest.fixture
def tokens(box: Outbox) -> Tokens:
    box.create_tenant("acme")
    box.create_tenant("globex")
    revoked = box.create_token("acme", "agent", "revoked")
    box.revoke_token(revoked)
    return Tokens(
        acme=box.create_token("acme", "agent"),
        acme_operator=box.create_token("acme", "operator"),
        globex=box.create_token("globex", "agent"),
        revoked=revoked,
    )


@pytest.fixture
def app(box: Outbox) -> FastAPI:
    return create_app(box)


@contextlib.contextmanager
def asgi_http(app: FastAPI, *, raise_app_exceptions: bool = True) -> Iterator[Http]:
    """httpx's ASGI transport, driven from sync code through an event loop in a portal thread."""
    base_url = "http://testserver"
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    with anyio.from_thread.start_blocking_portal() as portal:
        client = httpx.AsyncClient(transport=transport, base_url=base_url, timeout=30)

        def send(method: str, url: str, **kwargs: Any) -> httpx.Response:
            response: httpx.Response = portal.call(
                functools.partial(client.request, method, url, **kwargs)
            )
            return response

        try:
            yield Http(send, base_url)
        finally:
            portal.call(client.aclose)


@contextlib.contextmanager
def live_http(app: FastAPI) -> Iterator[Http]:
    with serve_in_thread(app) as base_url, httpx.Client(base_url=base_url, timeout=30) as client:
        yield Http(client.request, base_url)


@pytest.fixture(params=["asgi", "uvicorn"])
def http(request: pytest.FixtureRequest, app: FastAPI) -> Iterator[Http]:
    """The app over httpx's ASGI transport, and over a real uvicorn server on loopback."""
    factory = asgi_http if request.param == "asgi" else live_http
    with factory(app) as client:
        yield client


@pytest.fixture
def asgi(app: FastAPI) -> Iterator[Http]:
    with asgi_http(app) as client:
        yield client


def count(box: Outbox, table: sa.Table) -> int:
    with box.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def written(box: Outbox) -> dict[str, int]:
    """Rows the create path writes: all zero after a request that must store nothing."""
    return {t.name: count(box, t) for t in (schema.tasks, schema.operations, schema.outbox)}


def assert_problem(
    response: httpx.Response, status: int, kind: str | None = None, retry: str | None = None
) -> dict[str, Any]:
    """The answer is a problem document of this status (and slug, and retry advice)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    doc: dict[str, Any] = response.json()
    assert {"type", "title", "status", "detail", "retry"} <= doc.keys()
    assert doc["status"] == status
    if kind is not None:
        # ``type`` is a URI reference to the server's page about the problem.
        assert doc["type"] == f"/problems/{kind}", doc
    if retry is not None:
        assert doc["retry"] == retry, doc
    return doc
