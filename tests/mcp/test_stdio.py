"""`outbox mcp` over stdio, driven by the SDK's own client, as an agent host drives it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from outbox import schema
from outbox.service import Outbox
from tests.dispatcher.support import Provider
from tests.mcp import support

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def session(
    db_url: str, token: str, *, command: list[str] | None = None
) -> AsyncIterator[ClientSession]:
    command = command or [support.OUTBOX_SCRIPT]
    params = StdioServerParameters(
        command=command[0],
        args=[*command[1:], "--database-url", db_url, "mcp"],
        env={"OUTBOX_TOKEN": token, "OUTBOX_LOG_LEVEL": "WARNING"},
        cwd=str(ROOT),
    )
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write, read_timeout_seconds=30) as client,
    ):
        await client.initialize()
        yield client


ARGS = {"subject": "Parcel late", "body": "order 17", "priority": "high"}


async def test_list_tools_shows_operation_id_required_and_the_annotations(
    db_url: str, agent_token: str
):
    async with session(db_url, agent_token) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
    # Every tool of the registry the process loads, and the read tools; no review for agents.
    assert set(listed) == {"create_support_task", "get_operation", "get_task"}
    tool = listed["create_support_task"]
    assert "operation_id" in tool.input_schema["required"]
    assert "subject" in tool.input_schema["required"]
    described = tool.input_schema["properties"]["operation_id"]["description"]
    assert "once per intended action" in described and "every retry" in described
    assert "approval" in described
    hints = tool.annotations
    assert hints is not None
    assert hints.idempotent_hint is True
    assert hints.open_world_hint is True
    assert hints.destructive_hint is False
    assert hints.read_only_hint is False
    assert tool.output_schema is not None and "replayed" in tool.output_schema["required"]
    for name in ("get_operation", "get_task"):
        read = listed[name]
        assert read.annotations is not None and read.annotations.read_only_hint is True
        assert read.output_schema is not None


async def test_one_operation_id_twice_is_one_task_and_one_ticket(
    db_url: str, agent_token: str, box: Outbox, provider: Provider
):
    call = {"operation_id": "agent-op-1", **ARGS}
    async with session(db_url, agent_token) as client:
        first = await client.call_tool("create_support_task", call)
        second = await client.call_tool("create_support_task", call)
    assert first.is_error is False and second.is_error is False
    one, two = support.structured(first), support.structured(second)
    assert one["replayed"] is False and two["replayed"] is True
    assert one["receipt"] == two["receipt"]
    assert one["receipt"]["status"] == "created"
    assert [e["status"] for e in one["effects"]] == ["pending"]
    assert support.count(box, schema.tasks) == 1
    with support.dispatcher(db_url, provider) as d:
        support.drain(d)
    assert support.tickets_for(provider, "Parcel late") == 1
    # The effect's state follows the delivery; the receipt stays what it was.
    async with session(db_url, agent_token) as client:
        third = support.structured(await client.call_tool("create_support_task", call))
        read = await client.call_tool("get_operation", {"operation_id": "agent-op-1"})
    assert third["replayed"] is True and third["receipt"] == one["receipt"]
    assert [e["status"] for e in third["effects"]] == ["succeeded"]
    assert support.structured(read)["effects"][0]["provider_ref"]
    assert support.tickets_for(provider, "Parcel late") == 1


async def test_changed_arguments_under_one_operation_id_is_an_error_never_to_retry(
    db_url: str, agent_token: str, box: Outbox
):
    async with session(db_url, agent_token) as client:
        await client.call_tool("create_support_task", {"operation_id": "op-x", **ARGS})
        changed = await client.call_tool(
            "create_support_task", {"operation_id": "op-x", **ARGS, "subject": "Other"}
        )
        missing = await client.call_tool("create_support_task", ARGS)
        bad = await client.call_tool("create_support_task", {"operation_id": "op-y"})
    assert changed.is_error is True
    problem = support.structured(changed)
    assert problem["type"] == "idempotency-key-reused"
    assert problem["retry"] == "never"
    assert set(problem) >= {"type", "title", "detail", "retry", "retry_after"}
    assert support.structured(missing)["type"] == "invalid-operation-id"
    assert support.structured(missing)["retry"] == "after_fix"
    assert support.structured(bad)["type"] == "invalid-arguments"
    assert support.count(box, schema.tasks) == 1


async def test_killed_after_commit_and_restarted_the_retry_still_gives_one_ticket(
    db_url: str, agent_token: str, box: Outbox, provider: Provider
):
    call = {"operation_id": "agent-op-crash", **ARGS, "subject": "Crash window"}
    crashing = [sys.executable, "-m", "tests.mcp.crashing_server"]
    async with session(db_url, agent_token, command=crashing) as client:
        # The server commits, then dies before it answers: the host sees no reply.
        with pytest.raises(Exception):  # noqa: B017 - how the SDK reports a dead server varies
            await client.call_tool("create_support_task", call)
    assert support.count(box, schema.tasks) == 1
    # The host restarts the server and retries with the same operation_id.
    async with session(db_url, agent_token) as client:
        retried = await client.call_tool("create_support_task", call)
    answer = support.structured(retried)
    assert retried.is_error is False and answer["replayed"] is True
    assert support.count(box, schema.tasks) == 1
    with support.dispatcher(db_url, provider) as d:
        support.drain(d)
    assert support.tickets_for(provider, "Crash window") == 1


async def test_a_revoked_or_missing_token_is_refused(db_url: str, agent_token: str, box: Outbox):
    params = StdioServerParameters(
        command=support.OUTBOX_SCRIPT,
        args=["--database-url", db_url, "mcp"],
        env={"OUTBOX_TOKEN": ""},
    )
    with pytest.raises(Exception):  # noqa: B017 - the process exits before the handshake
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
    # Revoked mid-session: the next call is refused, nothing is written.
    async with session(db_url, agent_token) as client:
        assert box.revoke_token(agent_token)
        refused = await client.call_tool("create_support_task", {"operation_id": "r", **ARGS})
    assert refused.is_error is True
    assert support.structured(refused)["type"] == "unauthenticated"
    assert support.count(box, schema.tasks) == 0
