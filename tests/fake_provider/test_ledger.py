"""The store on its own: durable on a file, reopen semantics, the in-process transport."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from fake_provider import ConnectionDropped, DropMode, FaultSpec, Ledger, Outcome
from fake_provider.ledger import ClaimStatus, NewTicket

from .conftest import AppFactory, FakeClock, ticket_body

FIELDS = NewTicket("subject", "body", "normal", "ref-1")


def test_a_file_ledger_keeps_tickets_and_completed_keys_across_reopen(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = str(tmp_path / "ledger.db")
    ledger = Ledger(path)
    assert (
        ledger.claim_key("k", "d", now=clock(), retention=timedelta(hours=1)).status
        is ClaimStatus.CLAIMED
    )
    ticket, reply = ledger.create_ticket(
        FIELDS,
        idempotency_key="k",
        request_digest="d",
        outcome="ok",
        now=clock(),
        complete_key=True,
    )
    assert (
        ledger.claim_key("pending", "d", now=clock(), retention=timedelta(hours=1)).status
        is ClaimStatus.CLAIMED
    )
    ledger.close()

    reopened = Ledger(path)
    try:
        assert reopened.get_ticket(ticket.id) == ticket
        claim = reopened.claim_key("k", "d", now=clock(), retention=timedelta(hours=1))
        assert (claim.status, claim.status_code, claim.response_body) == (
            ClaimStatus.REPLAY,
            201,
            reply,
        )
        # A claim left by a process that is gone is freed on open.
        assert reopened.key_state("pending") is None
    finally:
        reopened.close()


def test_the_database_refuses_a_completed_key_without_a_reply(clock: FakeClock) -> None:
    import sqlite3

    ledger = Ledger()
    try:
        with pytest.raises(sqlite3.IntegrityError, match="ck_idempotency_keys_completed_has_reply"):
            ledger._conn.execute(
                "INSERT INTO idempotency_keys (key, request_digest, state, created_at) "
                "VALUES ('k', 'd', 'completed', '2026-01-01')"
            )
    finally:
        ledger.close()


def test_timestamps_must_be_aware(clock: FakeClock) -> None:
    ledger = Ledger()
    try:
        with pytest.raises(ValueError, match="timezone-aware"):
            ledger.create_ticket(
                FIELDS,
                idempotency_key=None,
                request_digest="d",
                outcome="ok",
                now=clock().replace(tzinfo=None),
                complete_key=False,
            )
    finally:
        ledger.close()


@pytest.mark.anyio
async def test_plain_asgi_transport_surfaces_the_drop_as_connection_dropped(
    make_app: AppFactory,
) -> None:
    """Without ProviderTransport there is no socket to close: the app's exception shows."""
    app = make_app(faults=FaultSpec(script=(Outcome.DROP_AFTER_COMMIT,)), drop_mode=DropMode.ABORT)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://provider.test") as client:
        with pytest.raises(ConnectionDropped) as dropped:
            await client.post("/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"})
    [ticket] = app.state.ledger.tickets()
    assert dropped.value.ticket_id == ticket.id
