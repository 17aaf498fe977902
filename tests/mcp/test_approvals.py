"""Approval-required tools: held until an operator decides, once, audited; MCP, HTTP and CLI."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta

import httpx
import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from outbox import cli, errors, schema, states
from outbox.api import create_app
from outbox.service import Outbox
from tests.dispatcher.support import Provider
from tests.mcp import support
from tests.support.servers import serve_in_thread

REFUND = {"customer": "c-42", "amount_cents": 1250}
SUBJECT = "refund 1250 to c-42"


@pytest.fixture
def base_url(box: Outbox) -> Iterator[str]:
    with serve_in_thread(create_app(box)) as url:
        yield url


@asynccontextmanager
async def session(base_url: str, token: str) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http,
        streamable_http_client(f"{base_url}/mcp", http_client=http) as (read, write),
        ClientSession(read, write, read_timeout_seconds=60) as client,
    ):
        await client.initialize()
        yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.anyio
async def test_held_until_one_approval_delivers_it_exactly_once(
    db_url: str,
    base_url: str,
    box: Outbox,
    agent_token: str,
    operator_token: str,
    provider: Provider,
):
    call = {"operation_id": "refund-1", **REFUND}
    async with session(base_url, agent_token) as client:
        created = support.structured(await client.call_tool("issue_refund", call))
    assert created["replayed"] is False
    assert created["receipt"]["status"] == "awaiting_approval"
    assert created["status_code"] == 202
    assert created["approval"] == {"status": "awaiting_approval", "decision": None}
    assert [e["status"] for e in created["effects"]] == ["held"]

    # Nothing reaches the provider while it is held, however often the dispatcher runs.
    with support.dispatcher(db_url, provider) as d:
        assert support.drain(d) == 0
    assert provider.transport.requests == []

    # The operator sees it, with what it would send.
    operator = httpx.AsyncClient(base_url=base_url, headers=bearer(operator_token))
    listed = (await operator.get("/v1/approvals")).json()
    assert [i["operation_id"] for i in listed["items"]] == ["refund-1"]
    assert listed["items"][0]["effects"][0]["payload"]["subject"] == SUBJECT

    # One approval releases it; a second changes nothing.
    url = "/v1/approvals/refund-1/approve"
    first = await operator.post(url, json={"actor": "ada"})
    second = await operator.post(url, json={"actor": "bob"})
    assert first.status_code == 200 and first.json()["changed"] is True
    assert first.headers["idempotent-replayed"] == "false"
    assert second.status_code == 200 and second.json()["changed"] is False
    assert second.headers["idempotent-replayed"] == "true"
    with support.dispatcher(db_url, provider) as d:
        support.drain(d)
        support.drain(d)
    assert support.tickets_for(provider, SUBJECT) == 1
    assert len(provider.transport.requests) == 1

    # The audit says who approved and when; one entry, the first operator's.
    shown = (await operator.get("/v1/approvals/refund-1")).json()
    await operator.aclose()
    decision = shown["decision"]
    assert decision["decision"] == "approve"
    # The authenticated token is the actor; the name the caller sent is only a note.
    assert decision["actor"].startswith("token:")
    assert decision["actor"].endswith("; note: ada")
    assert decision["at"]
    assert (decision["status_before"], decision["status_after"]) == (
        "awaiting_approval",
        "approved",
    )
    assert support.count(box, schema.approval_actions) == 1

    # The agent's retry with the same operation_id returns the current state.
    async with session(base_url, agent_token) as client:
        retried = support.structured(await client.call_tool("issue_refund", call))
    assert retried["replayed"] is True
    assert retried["receipt"] == created["receipt"]
    assert retried["approval"]["status"] == "approved"
    assert [e["status"] for e in retried["effects"]] == ["succeeded"]


@pytest.mark.anyio
async def test_a_rejected_one_is_never_sent(
    db_url: str, base_url: str, box: Outbox, agent_token: str, provider: Provider, capsys
):
    call = {"operation_id": "refund-2", **REFUND}
    async with session(base_url, agent_token) as client:
        await client.call_tool("issue_refund", call)
    argv = ["--database-url", db_url, "approvals"]
    assert cli.main([*argv, "reject", "--tenant", "acme", "refund-2", "--reason", "fraud"]) == 0
    rejected = json.loads(capsys.readouterr().out)
    assert rejected["changed"] is True and rejected["status"] == "rejected"
    assert rejected["decision"]["actor"].startswith("cli:")
    # Rejection is final: approving afterwards is a conflict and changes nothing.
    assert cli.main([*argv, "approve", "--tenant", "acme", "refund-2"]) == cli.EXIT_CONFLICT
    assert "approval-conflict" in capsys.readouterr().err
    # Repeating the rejection is fine.
    assert cli.main([*argv, "reject", "--tenant", "acme", "refund-2", "--reason", "again"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] is False
    with support.dispatcher(db_url, provider) as d:
        support.drain(d)
    assert provider.transport.requests == []
    [row] = support.outbox_rows(box)
    assert (row.status, row.reason, row.attempts) == ("failed", "rejected", 0)
    assert row.finished_at is not None and "fraud" in row.last_error
    async with session(base_url, agent_token) as client:
        retried = support.structured(await client.call_tool("issue_refund", call))
    assert retried["replayed"] is True
    assert retried["approval"]["status"] == "rejected"
    assert retried["approval"]["decision"]["reason"] == "fraud"
    assert [e["status"] for e in retried["effects"]] == ["failed"]


def test_cli_lists_and_a_rejection_needs_a_reason(db_url: str, box: Outbox, capsys):
    box.execute("acme", "refund-3", "issue_refund", REFUND)
    argv = ["--database-url", db_url, "approvals"]
    assert cli.main([*argv, "list", "--tenant", "acme"]) == 0
    assert [i["operation_id"] for i in json.loads(capsys.readouterr().out)] == ["refund-3"]
    assert cli.main([*argv, "list", "--tenant", "globex"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    with pytest.raises(SystemExit):
        cli.main([*argv, "reject", "--tenant", "acme", "refund-3"])
    with pytest.raises(errors.InvalidArguments):
        box.decide_approval("acme", "refund-3", "reject", actor="x", reason="  ")
    # Another tenant's operation is not found; an operation without approval is a conflict.
    with pytest.raises(errors.OperationNotFound):
        box.decide_approval("globex", "refund-3", "approve", actor="x")
    box.execute("acme", "plain", "create_support_task", {"subject": "s"})
    with pytest.raises(errors.ApprovalConflict, match="does not need approval"):
        box.decide_approval("acme", "plain", "approve", actor="x")
    assert support.count(box, schema.approval_actions) == 0


def test_http_is_for_operators_of_the_tenant(
    base_url: str, box: Outbox, agent_token: str, operator_token: str
):
    box.execute("acme", "refund-4", "issue_refund", REFUND)
    other_operator = box.create_token("globex", "operator")
    url = f"{base_url}/v1/approvals/refund-4/approve"
    assert httpx.post(url).status_code == 401
    assert httpx.post(url, headers=bearer(agent_token)).status_code == 403
    assert httpx.post(url, headers=bearer(other_operator)).status_code == 404
    reject = httpx.post(
        f"{base_url}/v1/approvals/refund-4/reject", headers=bearer(operator_token), json={}
    )
    assert reject.status_code == 422  # a rejection needs a reason
    assert support.count(box, schema.approval_actions) == 0
    [row] = support.outbox_rows(box)
    assert row.status == "held"


def test_two_operators_at_once_decide_exactly_once(db_url: str, box: Outbox):
    box.execute("acme", "refund-5", "issue_refund", REFUND)
    results: list[object] = []
    barrier = threading.Barrier(2)

    def act(decision: str, actor: str) -> None:
        barrier.wait()
        try:
            results.append(
                box.decide_approval("acme", "refund-5", decision, actor=actor, reason="r")
            )
        except errors.ApprovalConflict as error:
            results.append(error)

    threads = [
        threading.Thread(target=act, args=("approve", "ada")),
        threading.Thread(target=act, args=("reject", "bob")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    changed = [r for r in results if not isinstance(r, errors.ApprovalConflict)]
    assert len(results) == 2 and len(changed) == 1
    assert support.count(box, schema.approval_actions) == 1


def test_a_held_effect_outlives_its_deadline_and_gets_its_time_after_approval(
    db_url: str, provider: Provider
):
    from tests.conftest import Clock

    clock = Clock()
    box = support.make_box(db_url, registry=support.registry_with_refund(), clock=clock)
    try:
        box.execute("acme", "refund-6", "issue_refund", REFUND)
        [held] = support.outbox_rows(box)
        budget = held.deadline_at - held.created_at
        clock.advance(budget + timedelta(hours=1))  # a person took their time
        with support.dispatcher(db_url, provider) as d:
            assert support.drain(d) == 0
        from reconciler import sweeps

        sweeps.EnforceDeadlines(box.engine, box.settings).run_once(clock())
        [still] = support.outbox_rows(box)
        assert still.status == states.EffectStatus.HELD
        box.decide_approval("acme", "refund-6", "approve", actor="ada")
        [released] = support.outbox_rows(box)
        assert (released.status, released.reason) == ("pending", "approved")
        assert released.effect_key == held.effect_key
        assert released.deadline_at == clock() + budget
        assert released.next_attempt_at == clock()
    finally:
        box.close()


def test_the_http_api_answers_202_and_replays_it(base_url: str, agent_token: str):
    headers = {**bearer(agent_token), "Idempotency-Key": "refund-http"}
    url = f"{base_url}/v1/tools/issue_refund"
    first = httpx.post(url, headers=headers, json=REFUND)
    second = httpx.post(url, headers=headers, json=REFUND)
    assert (first.status_code, second.status_code) == (202, 202)
    assert first.content == second.content
    assert first.json()["status"] == "awaiting_approval"
    assert second.headers["idempotent-replayed"] == "true"
    read = httpx.get(f"{base_url}/v1/operations/refund-http", headers=bearer(agent_token))
    assert read.json()["approval"] == {"status": "awaiting_approval", "decision": None}
    assert [e["status"] for e in read.json()["effects"]] == ["held"]
