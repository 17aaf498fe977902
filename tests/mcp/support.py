"""What the MCP and approval tests share: a test-only approval-required tool, helpers."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mcp_types as types
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field

import adapters
from outbox import db, schema, settings, tools
from outbox.delivery.dispatcher import Dispatcher
from outbox.service import Outbox
from tests.dispatcher.conftest import TEST_SETTINGS
from tests.dispatcher.support import Provider

TENANT = "acme"
OTHER = "globex"
OUTBOX_SCRIPT = str(Path(__import__("sys").executable).parent / "outbox")


class RefundArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    customer: str = Field(min_length=1, max_length=100)
    amount_cents: int = Field(ge=1, le=1_000_000)


def issue_refund(ctx: tools.ToolContext, args: RefundArgs) -> tools.ToolOutput:
    # No local row: the whole effect is the provider's (the fake helpdesk stands in).
    effect = tools.EffectSpec(
        effect="refund",
        adapter="helpdesk",
        payload={
            "subject": f"refund {args.amount_cents} to {args.customer}",
            "body": "",
            "priority": "high",
        },
    )
    receipt = {"operation_id": ctx.operation_id, "status": "created", "refund": args.amount_cents}
    return tools.ToolOutput(receipt=receipt, effects=[effect])


# Test-only: an approval-required, destructive tool.
REFUND = tools.Tool(
    name="issue_refund",
    payload_version=1,
    arguments=RefundArgs,
    handler=issue_refund,
    description="Refund a customer (test tool).",
    destructive=True,
    requires_approval=True,
)


def registry_with_refund() -> tools.Registry:
    registry = tools.default_registry()
    registry.register(REFUND)
    return registry


def make_box(url: str, **kwargs: Any) -> Outbox:
    box = Outbox(url, **kwargs)
    box.create_tenant(TENANT)
    box.create_tenant(OTHER)
    return box


@contextmanager
def dispatcher(url: str, provider: Provider) -> Iterator[Dispatcher]:
    engine = db.create_engine(settings.load(), url=url)
    d = Dispatcher(
        engine,
        adapters.Registry([provider.adapter()]),
        settings.load(**TEST_SETTINGS),
        worker_id="w1",
        rng=random.Random(7),
    )
    try:
        yield d
    finally:
        d.close()
        engine.dispose()


def drain(d: Dispatcher) -> int:
    """Dispatch until nothing is due (bounded by count)."""
    total = 0
    for _ in range(20):
        handled = d.run_once()
        total += handled
        if handled == 0:
            break
    return total


def count(box: Outbox, table: sa.Table) -> int:
    with db.read(box.engine) as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def tickets_for(provider: Provider, subject: str) -> int:
    return sum(1 for t in provider.app.state.ledger.tickets() if t.subject == subject)


def structured(result: types.CallToolResult) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


def outbox_rows(box: Outbox) -> list[Any]:
    with db.read(box.engine) as conn:
        return list(conn.execute(sa.select(schema.outbox).order_by(schema.outbox.c.id)))
