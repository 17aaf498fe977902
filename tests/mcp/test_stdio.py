"""`outbox mcp` over stdio, driven by the SDK's own client, as an agent host drives it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from outbox import cli, schema
from outbox.service import Outbox
from tests.dispatcher.support import Provider
from tests.mcp import support

# SQLite only: the processes are the point here; the MCP layer above the database is the
# same code on PostgreSQL, which the HTTP tests (in-process, both backends) cover.

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
        ClientSession(read, write, read_timeout_seconds=90) as client,
    ):
        await client.initialize()
        yield client


@pytest.fixture
def db_url(sqlite_url: str) -> str:
    return sqlite_url


ARGS = {"subject": "Parcel late", "body": "order 17", "priority": "high"}


@pytest.mark.anyio
@pytest.mark.e2e
async def test_one_session_lists_replays_refuses_and_follows_the_delivery(
    sqlite_url: str, agent_token: str, box: Outbox, provider: Provider
):
    db_url = sqlite_url
    call = {"operation_id": "agent-op-1", **ARGS}
    async with session(db_url, agent_token) as client:
        # list_tools: every tool of the registry the process loads, and the read tools
        # (no review queue for an agent token).
        listed = {t.name: t for t in (await client.list_tools()).tools}
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

        # Two calls with one operation_id: one task; the second is a replay of the first.
        first = await client.call_tool("create_support_task", call)
        second = await client.call_tool("create_support_task", call)
        assert first.is_error is False and second.is_error is False
        one, two = support.structured(first), support.structured(second)
        assert one["replayed"] is False and two["replayed"] is True
        assert one["receipt"] == two["receipt"]
        assert one["receipt"]["status"] == "created"
        assert [e["status"] for e in one["effects"]] == ["pending"]
        assert support.count(box, schema.tasks) == 1

        # Changed arguments under the same operation_id: an error, never to retry.
        changed = await client.call_tool(
            "create_support_task", {**call, "subject": "Something else"}
        )
        assert changed.is_error is True
        problem = support.structured(changed)
        assert problem["type"] == "/problems/idempotency-key-reused"
        assert problem["retry"] == "never"
        assert set(problem) >= {"type", "title", "detail", "retry", "retry_after"}
        missing = support.structured(await client.call_tool("create_support_task", ARGS))
        assert (missing["type"], missing["retry"]) == (
            "/problems/invalid-operation-id",
            "after_fix",
        )
        bad = await client.call_tool("create_support_task", {"operation_id": "op-y"})
        assert support.structured(bad)["type"] == "/problems/invalid-arguments"
        assert support.count(box, schema.tasks) == 1

        # Delivered once; a later retry shows the effect's state, the receipt unchanged.
        with support.dispatcher(db_url, provider) as d:
            support.drain(d)
        assert support.tickets_for(provider, "Parcel late") == 1
        third = support.structured(await client.call_tool("create_support_task", call))
        assert third["replayed"] is True and third["receipt"] == one["receipt"]
        assert [e["status"] for e in third["effects"]] == ["succeeded"]
        read = support.structured(
            await client.call_tool("get_operation", {"operation_id": "agent-op-1"})
        )
        assert read["effects"][0]["provider_ref"]
        task = support.structured(
            await client.call_tool("get_task", {"task_id": one["receipt"]["task_id"]})
        )
        assert task["subject"] == "Parcel late"
        assert support.tickets_for(provider, "Parcel late") == 1

        # The token is checked on every request: revoked mid-session, refused at once.
        assert box.revoke_token(agent_token)
        refused = await client.call_tool("create_support_task", {**call, "operation_id": "r"})
        assert refused.is_error is True
        assert support.structured(refused)["type"] == "/problems/unauthenticated"
    assert support.count(box, schema.tasks) == 1


@pytest.mark.anyio
@pytest.mark.e2e
async def test_killed_after_commit_and_restarted_the_retry_still_gives_one_ticket(
    sqlite_url: str, agent_token: str, box: Outbox, provider: Provider
):
    db_url = sqlite_url
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


def test_without_a_token_it_says_what_to_set(sqlite_url: str, monkeypatch, capsys):
    monkeypatch.delenv("OUTBOX_TOKEN", raising=False)
    assert cli.main(["--database-url", sqlite_url, "mcp"]) == 2
    assert "OUTBOX_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("OUTBOX_TOKEN", "obx_not_a_token")
    assert cli.main(["--database-url", sqlite_url, "mcp"]) == 2
    assert "unknown or revoked" in capsys.readouterr().err


def test_help_documents_both_transports(capsys):
    with pytest.raises(SystemExit):
        cli.main(["mcp", "--help"])
    text = capsys.readouterr().out
    assert "stdio" in text and "OUTBOX_TOKEN" in text
    assert "streamable HTTP" in text and "/mcp" in text and "Bearer" in text
    assert "operation_id" in text
