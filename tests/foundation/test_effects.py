"""A tool that enqueues several effects, or none: every row commits with the record, once.

On PostgreSQL the operation record and the outbox rows are one statement (a
data-modifying CTE); these pin its semantics to those of the separate inserts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from outbox import Outbox, db, schema, tools
from tests.foundation.conftest import counts


class TwoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    subject: str
    effects: int = 2


def _handler(ctx: tools.ToolContext, args: TwoArgs) -> tools.ToolOutput:
    output = tools.create_support_task(ctx, tools.SupportTaskArgs(subject=args.subject))
    effects = [
        tools.EffectSpec(effect=f"notify_{i}", adapter="helpdesk", payload={"n": i})
        for i in range(args.effects)
    ]
    return tools.ToolOutput(output.receipt, effects, output.task_id)


@pytest.fixture
def multi_box(db_url: str, clock) -> Iterator[Outbox]:
    registry = tools.default_registry()
    registry.register(tools.Tool("notify_many", 1, TwoArgs, _handler))
    with Outbox(db_url, clock=clock, registry=registry) as box:
        box.create_tenant("acme")
        yield box
        assert db.in_use(box.engine) == 0


def _effects(box: Outbox) -> list[tuple[str, str, str]]:
    out = schema.outbox
    with db.read(box.engine) as conn:
        rows = conn.execute(
            sa.select(out.c.operation_id, out.c.effect, out.c.payload).order_by(out.c.id)
        ).all()
    return [tuple(r) for r in rows]


def test_several_effects_commit_with_their_record_once(multi_box: Outbox):
    first = multi_box.execute("acme", "op-1", "notify_many", {"subject": "three", "effects": 3})
    assert first.created
    assert _effects(multi_box) == [
        ("op-1", "notify_0", '{"n":0}'),
        ("op-1", "notify_1", '{"n":1}'),
        ("op-1", "notify_2", '{"n":2}'),
    ]
    again = multi_box.execute("acme", "op-1", "notify_many", {"subject": "three", "effects": 3})
    assert again.replayed and again.receipt_json == first.receipt_json
    assert counts(multi_box) == {"tasks": 1, "operations": 1, "outbox": 3}


def test_no_effect_writes_the_record_alone(multi_box: Outbox):
    result = multi_box.execute("acme", "op-0", "notify_many", {"subject": "none", "effects": 0})
    assert result.created
    assert counts(multi_box) == {"tasks": 1, "operations": 1, "outbox": 0}
    assert multi_box.execute(
        "acme", "op-0", "notify_many", {"subject": "none", "effects": 0}
    ).replayed


def test_racing_creators_of_several_effects_write_one_set(multi_box: Outbox):
    start = threading.Barrier(8)

    def call(_: int) -> str:
        start.wait(timeout=10)
        return multi_box.execute(
            "acme", "op-race", "notify_many", {"subject": "race", "effects": 2}
        ).receipt_json

    with ThreadPoolExecutor(max_workers=8) as pool:
        receipts = list(pool.map(call, range(8)))
    assert len(set(receipts)) == 1
    assert counts(multi_box) == {"tasks": 1, "operations": 1, "outbox": 2}
