"""Reads: a ticket by id, lookups by client reference or key, lag, and --no-lookup."""

from __future__ import annotations

import pytest

from fake_provider import Mode

from .conftest import AppFactory, FakeClock, open_client, ticket_body

pytestmark = pytest.mark.anyio


async def test_get_ticket_by_id(make_app: AppFactory, transport: str) -> None:
    app = make_app()
    async with open_client(app, transport) as client:
        created = (await client.post("/v1/tickets", json=ticket_body())).json()
        found = await client.get(f"/v1/tickets/{created['id']}")
        missing = await client.get("/v1/tickets/tkt_999999")
        malformed = await client.get("/v1/tickets/nonsense")
    assert found.status_code == 200
    assert found.json() == created
    assert set(created) == {
        "id",
        "subject",
        "body",
        "priority",
        "status",
        "client_reference",
        "created_at",
    }
    assert missing.status_code == malformed.status_code == 404


async def test_lookup_by_reference_and_by_key(make_app: AppFactory, transport: str) -> None:
    app = make_app()
    async with open_client(app, transport) as client:
        mine = (
            await client.post(
                "/v1/tickets", json=ticket_body("r1"), headers={"Idempotency-Key": "k1"}
            )
        ).json()
        await client.post("/v1/tickets", json=ticket_body("r2"), headers={"Idempotency-Key": "k2"})
        by_reference = await client.get("/v1/tickets", params={"client_reference": "r1"})
        by_key = await client.get("/v1/tickets", params={"idempotency_key": "k1"})
        none = await client.get("/v1/tickets", params={"client_reference": "unknown"})
        neither = await client.get("/v1/tickets")
    assert by_reference.json() == {"tickets": [mine]}
    assert by_key.json() == {"tickets": [mine]}
    assert none.status_code == 200
    assert none.json() == {"tickets": []}
    assert neither.status_code == 400


async def test_lookup_lists_duplicates_in_ignore_mode(make_app: AppFactory) -> None:
    app = make_app(mode=Mode.IGNORE)
    async with open_client(app, "asgi") as client:
        ids = [
            (
                await client.post(
                    "/v1/tickets", json=ticket_body("r1"), headers={"Idempotency-Key": "r1"}
                )
            ).json()["id"]
            for _ in range(3)
        ]
        found = (await client.get("/v1/tickets", params={"client_reference": "r1"})).json()
    assert [ticket["id"] for ticket in found["tickets"]] == ids


async def test_lookup_lag_hides_new_tickets_until_it_passes(
    make_app: AppFactory, clock: FakeClock, transport: str
) -> None:
    app = make_app(lookup_lag_ms=500)
    async with open_client(app, transport) as client:
        created = (await client.post("/v1/tickets", json=ticket_body("r1"))).json()

        async def lookup() -> list[str]:
            for params in ({"client_reference": "r1"}, {"idempotency_key": "r1"}):
                assert (await client.get("/v1/tickets", params=params)).status_code == 200
            body = (await client.get("/v1/tickets", params={"client_reference": "r1"})).json()
            return [ticket["id"] for ticket in body["tickets"]]

        assert await lookup() == []
        clock.advance(milliseconds=499)
        assert await lookup() == []
        # The ticket itself exists: a read by id is not subject to the lag.
        assert (await client.get(f"/v1/tickets/{created['id']}")).status_code == 200
        clock.advance(milliseconds=1)
        assert await lookup() == [created["id"]]


async def test_no_lag_means_visible_at_once(make_app: AppFactory) -> None:
    app = make_app()
    async with open_client(app, "asgi") as client:
        created = (await client.post("/v1/tickets", json=ticket_body("r1"))).json()
        found = (await client.get("/v1/tickets", params={"client_reference": "r1"})).json()
    assert [ticket["id"] for ticket in found["tickets"]] == [created["id"]]


async def test_no_lookup_answers_501_but_reads_by_id_work(
    make_app: AppFactory, transport: str
) -> None:
    app = make_app(lookup_enabled=False)
    async with open_client(app, transport) as client:
        created = (await client.post("/v1/tickets", json=ticket_body("r1"))).json()
        by_reference = await client.get("/v1/tickets", params={"client_reference": "r1"})
        by_key = await client.get("/v1/tickets", params={"idempotency_key": "r1"})
        by_id = await client.get(f"/v1/tickets/{created['id']}")
    assert by_reference.status_code == by_key.status_code == 501
    assert by_reference.json()["error"]["type"] == "not_implemented"
    assert by_id.status_code == 200
