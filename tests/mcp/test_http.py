"""MCP over streamable HTTP at /mcp (``outbox serve``), with bearer tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from outbox import schema
from outbox.api import create_app
from outbox.service import Outbox
from tests.dispatcher.support import Provider
from tests.mcp import support
from tests.support.servers import serve_in_thread

pytestmark = pytest.mark.anyio

ARGS = {"subject": "Over HTTP", "body": "", "priority": "normal"}


@pytest.fixture
def base_url(box: Outbox) -> Iterator[str]:
    with serve_in_thread(create_app(box)) as url:
        yield url


@asynccontextmanager
async def session(base_url: str, token: str) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=60) as http,
        streamable_http_client(f"{base_url}/mcp", http_client=http) as (read, write),
        ClientSession(read, write, read_timeout_seconds=60) as client,
    ):
        await client.initialize()
        yield client


async def test_the_same_contract_over_streamable_http(
    db_url: str, base_url: str, agent_token: str, box: Outbox, provider: Provider
):
    call = {"operation_id": "http-op-1", **ARGS}
    async with session(base_url, agent_token) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        # Every registered tool is listed, the test-only one too: nothing is hard-coded.
        assert {"create_support_task", "issue_refund", "get_operation", "get_task"} <= set(listed)
        assert "list_review_items" not in listed  # operators only
        tool = listed["create_support_task"]
        assert tool.input_schema["required"][0] == "operation_id"
        assert tool.annotations is not None and tool.annotations.idempotent_hint is True
        refund = listed["issue_refund"].annotations
        assert refund is not None and refund.destructive_hint is True

        first = await client.call_tool("create_support_task", call)
        second = await client.call_tool("create_support_task", call)
        one, two = support.structured(first), support.structured(second)
        assert (one["replayed"], two["replayed"]) == (False, True)
        assert one["receipt"] == two["receipt"]
        changed = await client.call_tool("create_support_task", {**call, "subject": "Else"})
        assert changed.is_error is True
        assert support.structured(changed)["retry"] == "never"
    assert support.count(box, schema.tasks) == 1
    with support.dispatcher(db_url, provider) as d:
        support.drain(d)
    assert support.tickets_for(provider, "Over HTTP") == 1


async def test_another_tenant_finds_nothing_of_the_first(
    base_url: str, agent_token: str, other_token: str, box: Outbox
):
    call = {"operation_id": "shared-id", **ARGS}
    async with session(base_url, agent_token) as client:
        mine = support.structured(await client.call_tool("create_support_task", call))
    async with session(base_url, other_token) as client:
        read = await client.call_tool("get_operation", {"operation_id": "shared-id"})
        task = await client.call_tool("get_task", {"task_id": mine["receipt"]["task_id"]})
        # The same key under another tenant is another operation, not the first's receipt.
        theirs = support.structured(await client.call_tool("create_support_task", call))
    assert read.is_error is True and support.structured(read)["type"] == "/problems/not-found"
    assert task.is_error is True and support.structured(task)["type"] == "/problems/not-found"
    assert theirs["replayed"] is False
    assert theirs["receipt"]["task_id"] != mine["receipt"]["task_id"]


async def test_operators_also_get_the_review_queue(base_url: str, operator_token: str):
    async with session(base_url, operator_token) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert "list_review_items" in listed
        hints = listed["list_review_items"].annotations
        assert hints is not None and hints.read_only_hint is True
        items = await client.call_tool("list_review_items", {})
    assert items.is_error is False
    assert support.structured(items)["items"] == []


def test_a_request_without_a_valid_token_gets_401(base_url: str, box: Outbox):
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream"}
    for auth in ({}, {"Authorization": "Bearer obx_unknown"}, {"Authorization": "Basic x"}):
        response = httpx.post(f"{base_url}/mcp", json=body, headers={**headers, **auth})
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["type"] == "/problems/unauthenticated"
    assert support.count(box, schema.operations) == 0
