"""Each fault outcome, over both transports, checked against the provider's ledger."""

from __future__ import annotations

import email.utils
from typing import Any

import httpx
import pytest

from fake_provider import DropMode, FaultSpec, Outcome, RetryAfterFormat

from .conftest import AppFactory, open_client, ticket_body

pytestmark = pytest.mark.anyio

# outcome -> (status the client sees, tickets the ledger holds afterwards)
ANSWERED = {
    Outcome.OK: (201, 1),
    Outcome.FAIL_BEFORE_COMMIT: (500, 0),
    Outcome.FAIL_AFTER_COMMIT: (500, 1),
    Outcome.RATE_LIMIT: (429, 0),
    Outcome.UNAVAILABLE: (503, 0),
    Outcome.REJECT: (400, 0),
}


def scripted(*outcomes: Outcome) -> FaultSpec:
    return FaultSpec(script=outcomes)


async def post_ticket(
    client: httpx.AsyncClient, key: str = "key-1", **kwargs: Any
) -> httpx.Response:
    return await client.post(
        "/v1/tickets", json=ticket_body(key), headers={"Idempotency-Key": key}, **kwargs
    )


@pytest.mark.parametrize("outcome", list(ANSWERED), ids=str)
async def test_answered_outcome_matches_ledger(
    make_app: AppFactory, transport: str, outcome: Outcome
) -> None:
    app = make_app(faults=scripted(outcome))
    status, tickets = ANSWERED[outcome]
    async with open_client(app, transport) as client:
        response = await post_ticket(client)
        stats = (await client.get("/_admin/stats")).json()
    assert response.status_code == status
    assert stats["tickets"] == tickets
    assert stats["requests"][outcome.value] == 1
    effects = app.state.ledger.tickets()
    assert [ticket.outcome for ticket in effects] == [outcome.value] * tickets
    if status == 201:
        assert response.json()["id"] == effects[0].id
        assert response.json()["client_reference"] == "key-1"
    else:
        assert response.json()["error"]["type"]


@pytest.mark.parametrize("outcome", [Outcome.RATE_LIMIT, Outcome.UNAVAILABLE], ids=str)
async def test_retry_after_in_seconds(
    make_app: AppFactory, transport: str, outcome: Outcome
) -> None:
    app = make_app(faults=scripted(outcome), retry_after_seconds=7)
    async with open_client(app, transport) as client:
        response = await post_ticket(client)
    assert response.headers["Retry-After"] == "7"


async def test_retry_after_as_http_date(make_app: AppFactory, clock: Any) -> None:
    app = make_app(
        faults=scripted(Outcome.UNAVAILABLE),
        retry_after_seconds=30,
        retry_after_format=RetryAfterFormat.HTTP_DATE,
    )
    async with open_client(app, "asgi") as client:
        response = await post_ticket(client)
    when = email.utils.parsedate_to_datetime(response.headers["Retry-After"])
    assert (when - clock.now).total_seconds() == 30


async def test_drop_after_commit_abort_loses_the_reply_not_the_ticket(
    make_app: AppFactory, transport: str
) -> None:
    app = make_app(faults=scripted(Outcome.DROP_AFTER_COMMIT), drop_mode=DropMode.ABORT)
    async with open_client(app, transport) as client:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await post_ticket(client)
        # The key was completed with the ticket: the retry is a replay.
        retry = await post_ticket(client)
    [ticket] = app.state.ledger.tickets()
    assert ticket.outcome == "drop_after_commit"
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json()["id"] == ticket.id


async def test_drop_after_commit_hold_outlasts_the_read_timeout(
    make_app: AppFactory, transport: str
) -> None:
    app = make_app(
        faults=scripted(Outcome.DROP_AFTER_COMMIT), drop_mode=DropMode.HOLD, hold_seconds=30
    )
    async with open_client(app, transport) as client:
        with pytest.raises(httpx.ReadTimeout):
            await post_ticket(client, timeout=httpx.Timeout(5.0, read=0.2))
        effects = (await client.get("/_admin/effects")).json()["effects"]
    assert [effect["outcome"] for effect in effects] == ["drop_after_commit"]


async def test_drop_after_commit_hold_answers_when_the_client_waits(make_app: AppFactory) -> None:
    app = make_app(
        faults=scripted(Outcome.DROP_AFTER_COMMIT), drop_mode=DropMode.HOLD, hold_seconds=0.05
    )
    async with open_client(app, "http") as client:
        response = await post_ticket(client)
    assert response.status_code == 201


async def test_timeout_before_commit_hangs_and_stores_nothing(
    make_app: AppFactory, transport: str
) -> None:
    app = make_app(faults=scripted(Outcome.TIMEOUT_BEFORE_COMMIT), hold_seconds=30)
    async with open_client(app, transport) as client:
        with pytest.raises(httpx.ReadTimeout):
            await post_ticket(client, timeout=httpx.Timeout(5.0, read=0.2))
        retry = await post_ticket(client)
    # Nothing was stored and no key was claimed, so the retry creates the ticket.
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry.headers
    assert len(app.state.ledger.tickets()) == 1


async def test_timeout_before_commit_answers_504_after_the_hold(
    make_app: AppFactory, transport: str
) -> None:
    app = make_app(faults=scripted(Outcome.TIMEOUT_BEFORE_COMMIT), hold_seconds=0.05)
    async with open_client(app, transport) as client:
        response = await post_ticket(client)
    assert response.status_code == 504
    assert app.state.ledger.tickets() == []


async def test_fail_after_commit_then_retry_with_the_same_key_is_one_ticket(
    make_app: AppFactory, transport: str
) -> None:
    app = make_app(faults=scripted(Outcome.FAIL_AFTER_COMMIT))
    async with open_client(app, transport) as client:
        first = await post_ticket(client)
        retry = await post_ticket(client)
        stats = (await client.get("/_admin/stats")).json()
    assert first.status_code == 500
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert stats["tickets"] == 1
    assert stats["duplicates"] == {}


async def test_before_commit_faults_leave_the_key_free(make_app: AppFactory) -> None:
    app = make_app(faults=scripted(Outcome.RATE_LIMIT, Outcome.UNAVAILABLE, Outcome.REJECT))
    async with open_client(app, "asgi") as client:
        statuses = [(await post_ticket(client)).status_code for _ in range(4)]
    assert statuses == [429, 503, 400, 201]
    assert app.state.ledger.key_state("key-1") == "completed"


async def test_latency_delays_the_reply(make_app: AppFactory) -> None:
    app = make_app(faults=FaultSpec(latency_min_ms=150, latency_max_ms=150))
    async with open_client(app, "asgi") as client:
        with pytest.raises(httpx.ReadTimeout):
            await post_ticket(client, timeout=httpx.Timeout(5.0, read=0.05))
        # Cancelled before its commit: no ticket, and the claim was released.
        assert app.state.ledger.tickets() == []
        assert app.state.ledger.key_state("key-1") is None
        response = await post_ticket(client)
    assert response.status_code == 201
