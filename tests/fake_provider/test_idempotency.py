"""Honour mode deduplicates by Idempotency-Key; ignore mode creates a ticket per POST."""

from __future__ import annotations

import threading
from datetime import timedelta

import anyio
import httpx
import pytest

from fake_provider import FaultSpec, Ledger, Mode
from fake_provider.ledger import ClaimStatus

from .conftest import AppFactory, FakeClock, open_client, ticket_body

pytestmark = pytest.mark.anyio


async def wait_for_claim(ledger: Ledger, key: str) -> None:
    """Bounded wait until a request holds ``key`` (the app offers no event to await)."""
    with anyio.fail_after(5):
        # The claim is a row in SQLite, written by the app: nothing to await.
        while ledger.key_state(key) != "in_progress":  # noqa: ASYNC110
            await anyio.sleep(0.001)


async def test_same_key_same_body_replays_the_stored_reply(
    make_app: AppFactory, transport: str
) -> None:
    app = make_app()
    async with open_client(app, transport) as client:
        first = await client.post(
            "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
        )
        # Same JSON value, other key order and spacing: still the same body.
        reordered = b'{ "client_reference":"ref-1", "priority":"high", "body":"Third floor.", "subject":"Printer on fire" }'
        replay = await client.post(
            "/v1/tickets",
            content=reordered,
            headers={"Idempotency-Key": "k", "Content-Type": "application/json"},
        )
    assert first.status_code == replay.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.content == first.content
    assert len(app.state.ledger.tickets()) == 1


async def test_same_key_different_body_is_422_and_stores_nothing(
    make_app: AppFactory, transport: str
) -> None:
    app = make_app()
    async with open_client(app, transport) as client:
        await client.post("/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"})
        changed = await client.post(
            "/v1/tickets", json=ticket_body(subject="Other"), headers={"Idempotency-Key": "k"}
        )
    assert changed.status_code == 422
    assert changed.json()["error"]["type"] == "idempotency_key_reused"
    assert len(app.state.ledger.tickets()) == 1


async def test_key_in_progress_is_409(make_app: AppFactory) -> None:
    app = make_app(faults=FaultSpec(latency_min_ms=300, latency_max_ms=300))
    async with open_client(app, "asgi") as client, anyio.create_task_group() as tg:
        results: dict[str, httpx.Response] = {}

        async def first() -> None:
            results["first"] = await client.post(
                "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
            )

        tg.start_soon(first)
        await wait_for_claim(app.state.ledger, "k")
        second = await client.post(
            "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
        )
        assert second.status_code == 409
        assert second.json()["error"]["type"] == "idempotency_key_in_use"
    assert results["first"].status_code == 201
    assert len(app.state.ledger.tickets()) == 1


async def test_different_body_while_in_progress_is_422(make_app: AppFactory) -> None:
    app = make_app(faults=FaultSpec(latency_min_ms=300, latency_max_ms=300))
    async with open_client(app, "asgi") as client, anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: client.post("/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"})
        )
        await wait_for_claim(app.state.ledger, "k")
        other = await client.post(
            "/v1/tickets", json=ticket_body(subject="Other"), headers={"Idempotency-Key": "k"}
        )
    assert other.status_code == 422


@pytest.mark.parametrize("latency_ms", [0, 200])
async def test_fifty_concurrent_posts_with_one_key_make_one_ticket(
    make_app: AppFactory, transport: str, latency_ms: int
) -> None:
    app = make_app(faults=FaultSpec(latency_min_ms=latency_ms, latency_max_ms=latency_ms))
    limits = httpx.Limits(max_connections=50)
    async with open_client(app, transport, limits=limits) as client:
        responses: list[httpx.Response] = []

        async def post() -> None:
            responses.append(
                await client.post(
                    "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
                )
            )

        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(post)
    [ticket] = app.state.ledger.tickets()
    created = [
        r for r in responses if r.status_code == 201 and "Idempotent-Replayed" not in r.headers
    ]
    replayed = [r for r in responses if r.headers.get("Idempotent-Replayed") == "true"]
    conflicts = [r for r in responses if r.status_code == 409]
    assert len(created) == 1
    assert len(created) + len(replayed) + len(conflicts) == 50
    assert {r.json()["id"] for r in created + replayed} == {ticket.id}
    if latency_ms:
        assert conflicts, "with a processing window, some requests must meet the claim"


def test_concurrent_claims_on_threads_have_one_winner(clock: FakeClock) -> None:
    ledger = Ledger()
    barrier = threading.Barrier(20)
    statuses: list[ClaimStatus] = []

    def claim() -> None:
        barrier.wait(5)
        statuses.append(
            ledger.claim_key("k", "digest", now=clock(), retention=timedelta(hours=1)).status
        )

    threads = [threading.Thread(target=claim) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    ledger.close()
    assert sorted(statuses).count(ClaimStatus.CLAIMED) == 1
    assert statuses.count(ClaimStatus.IN_PROGRESS) == 19


async def test_keys_expire_after_the_retention_window(
    make_app: AppFactory, clock: FakeClock
) -> None:
    app = make_app(key_retention_seconds=60)
    async with open_client(app, "asgi") as client:
        first = await client.post(
            "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
        )
        clock.advance(seconds=59)
        inside = await client.post(
            "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
        )
        clock.advance(seconds=2)
        after = await client.post(
            "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
        )
    assert inside.headers["Idempotent-Replayed"] == "true"
    assert inside.json()["id"] == first.json()["id"]
    assert "Idempotent-Replayed" not in after.headers
    assert after.json()["id"] != first.json()["id"]
    assert len(app.state.ledger.tickets()) == 2


async def test_without_a_key_honour_mode_creates_every_time(make_app: AppFactory) -> None:
    app = make_app()
    async with open_client(app, "asgi") as client:
        for _ in range(3):
            assert (await client.post("/v1/tickets", json=ticket_body())).status_code == 201
    assert len(app.state.ledger.tickets()) == 3


async def test_ignore_mode_n_requests_make_n_tickets(make_app: AppFactory, transport: str) -> None:
    app = make_app(mode=Mode.IGNORE)
    async with open_client(app, transport) as client:
        responses = [
            await client.post("/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"})
            for _ in range(10)
        ]
        stats = (await client.get("/_admin/stats")).json()
    assert [r.status_code for r in responses] == [201] * 10
    assert len({r.json()["id"] for r in responses}) == 10
    assert not any("Idempotent-Replayed" in r.headers for r in responses)
    assert stats["tickets"] == 10
    assert stats["distinct_references"] == 1
    assert stats["distinct_keys"] == 1
    assert stats["duplicates"] == {"ref-1": 10}


async def test_ignore_mode_concurrent_requests_all_create(make_app: AppFactory) -> None:
    app = make_app(mode=Mode.IGNORE, faults=FaultSpec(latency_min_ms=10, latency_max_ms=10))
    async with open_client(app, "asgi") as client, anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(
                lambda: client.post(
                    "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
                )
            )
    assert len(app.state.ledger.tickets()) == 20


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"body": "no subject"}',
        b'{"subject": "s", "priority": 3}',
        b'{"subject": "s", "client_reference": 5}',
    ],
)
async def test_invalid_bodies_are_400_and_store_nothing(make_app: AppFactory, body: bytes) -> None:
    app = make_app()
    async with open_client(app, "asgi") as client:
        response = await client.post(
            "/v1/tickets",
            content=body,
            headers={"Content-Type": "application/json", "Idempotency-Key": "k"},
        )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request"
    assert app.state.ledger.tickets() == []
    assert app.state.ledger.key_state("k") is None
