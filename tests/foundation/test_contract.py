"""The caller's contract (DESIGN.md 1-9) through the Python API, on SQLite and PostgreSQL.

The first seven are the tests the design grew from: the lost response,
rollback before commit, changed arguments, separate intents with matching
subjects, tenant scope, invalid input, concurrent delivery (in test_concurrency).
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from outbox import Outbox, db, errors, faults, schema
from outbox.creating import create
from tests.foundation.conftest import counts

TOOL = "create_support_task"
ARGS = {"subject": "Check delayed delivery", "body": "Order 1234", "priority": "high"}


class LostReply(TimeoutError):
    """Stands for the reply that never reached the caller."""


def test_lost_response_then_retry_through_a_new_connection_replays(box: Outbox, db_url, clock):
    def call_and_lose_the_reply() -> None:
        box.execute("acme", "op-1", TOOL, ARGS)
        raise LostReply("committed, but the response was lost")

    with pytest.raises(LostReply):
        call_and_lose_the_reply()
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}

    # The retry comes through a different engine: nothing lives in process memory.
    with Outbox(db_url, clock=clock) as other:
        retry = other.execute("acme", "op-1", TOOL, ARGS)
    assert retry.replayed and retry.status_code == 201
    assert retry.receipt == {"operation_id": "op-1", "status": "created", "task_id": 1}
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}


@pytest.mark.parametrize(
    "window",
    ["create.after_task_insert", "create.after_operation_insert", "create.after_outbox_insert"],
)
def test_rollback_before_commit_leaves_nothing(box: Outbox, window: str):
    faults.arm(window, faults.InjectedFault(window))
    with pytest.raises(faults.InjectedFault):
        box.execute("acme", "op-1", TOOL, ARGS)
    faults.disarm()
    assert counts(box) == {"tasks": 0, "operations": 0, "outbox": 0}
    # And the key is still free: the retry creates.
    assert box.execute("acme", "op-1", TOOL, ARGS).created


def test_changed_arguments_conflict_and_write_nothing(box: Outbox):
    first = box.execute("acme", "op-1", TOOL, ARGS)
    with pytest.raises(errors.IdempotencyKeyReused) as caught:
        box.execute("acme", "op-1", TOOL, {**ARGS, "subject": "Something else"})
    assert caught.value.operation_id == "op-1" and caught.value.status == 422
    assert caught.value.retry == "never"
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}
    assert box.execute("acme", "op-1", TOOL, ARGS).receipt_json == first.receipt_json


def test_separate_intents_with_matching_subjects_are_two_tasks(box: Outbox):
    a = box.execute("acme", "op-1", TOOL, ARGS)
    b = box.execute("acme", "op-2", TOOL, ARGS)
    assert a.created and b.created
    assert a.receipt["task_id"] != b.receipt["task_id"]
    assert counts(box) == {"tasks": 2, "operations": 2, "outbox": 2}


def test_tenant_scope_one_key_two_tenants(box: Outbox):
    a = box.execute("acme", "shared-key", TOOL, ARGS)
    b = box.execute("globex", "shared-key", TOOL, {**ARGS, "subject": "Globex only"})
    assert a.created and b.created and a.receipt["task_id"] != b.receipt["task_id"]
    # Neither tenant can read the other's receipt or task.
    assert box.get_operation("acme", "shared-key")["receipt"] == a.receipt
    with pytest.raises(errors.TaskNotFound):
        box.get_task("acme", b.receipt["task_id"])
    with pytest.raises(errors.TaskNotFound):
        box.get_task("globex", a.receipt["task_id"])
    with pytest.raises(errors.OperationNotFound):
        box.get_operation("globex", "op-of-acme-only")
    assert box.get_task("globex", b.receipt["task_id"])["subject"] == "Globex only"


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({}, "subject"),
        ({"subject": "   "}, "subject"),
        ({"subject": "x" * 201}, "subject"),
        ({"subject": "ok", "body": "b" * 10_001}, "body"),
        ({"subject": "ok", "priority": "urgent"}, "priority"),
        ({"subject": "ok", "helpdesk": "yes"}, "helpdesk"),
        ({"subject": 42}, "subject"),
        ({"subject": "ok", "colour": "red"}, "colour"),
        ({"subject": "nul\x00inside"}, "subject"),
        ({"subject": "ok", "body": "lone \ud800 surrogate"}, "body"),
    ],
)
def test_invalid_input_names_the_field_and_writes_nothing(box: Outbox, arguments, field):
    with pytest.raises(errors.InvalidArguments) as caught:
        box.execute("acme", "op-1", TOOL, arguments)
    assert [e["field"] for e in caught.value.errors] == [field]
    assert caught.value.retry == "after_fix"
    assert counts(box) == {"tasks": 0, "operations": 0, "outbox": 0}


@pytest.mark.parametrize("operation_id", ["", " x", "a" * 256, "tab\tkey", "é"])
def test_invalid_operation_id_is_refused(box: Outbox, operation_id):
    with pytest.raises(errors.InvalidOperationId):
        box.execute("acme", operation_id, TOOL, ARGS)
    assert counts(box)["operations"] == 0


def test_not_an_object_is_invalid(box: Outbox):
    with pytest.raises(errors.InvalidArguments):
        box.execute("acme", "op-1", TOOL, ["subject"])


def test_unknown_tool_and_unknown_tenant(box: Outbox):
    with pytest.raises(errors.UnknownTool) as caught:
        box.execute("acme", "op-1", "send_money", ARGS)
    assert "create_support_task" in str(caught.value)
    with pytest.raises(errors.UnknownTenant):
        box.execute("initech", "op-1", TOOL, ARGS)
    assert counts(box) == {"tasks": 0, "operations": 0, "outbox": 0}


def test_replayed_receipt_is_byte_identical_and_keeps_first_status(box: Outbox):
    first = box.execute("acme", "op-1", TOOL, ARGS)
    for _ in range(3):
        again = box.execute("acme", "op-1", TOOL, dict(reversed(list(ARGS.items()))))
        assert again.receipt_json == first.receipt_json
        assert again.status_code == first.status_code == 201
        assert again.replayed


def test_replay_after_restart_with_a_new_engine(box: Outbox, db_url, clock):
    first = box.execute("acme", "op-1", TOOL, ARGS)
    box.engine.dispose()
    with Outbox(db_url, clock=clock) as restarted:
        assert restarted.execute("acme", "op-1", TOOL, ARGS).receipt_json == first.receipt_json


def test_receipt_is_what_happened_not_current_state(box: Outbox):
    first = box.execute("acme", "op-1", TOOL, ARGS)
    with db.write(box.engine) as conn:
        conn.execute(sa.update(schema.tasks).values(status="closed"))
    again = box.execute("acme", "op-1", TOOL, ARGS)
    assert again.receipt_json == first.receipt_json  # still "created"
    assert box.get_task("acme", first.receipt["task_id"])["status"] == "closed"


def test_normalised_arguments_replay(box: Outbox):
    first = box.execute("acme", "op-1", TOOL, {"subject": "  Late parcel "})
    again = box.execute(
        "acme", "op-1", TOOL, {"subject": "Late parcel", "priority": "normal", "body": ""}
    )
    assert again.replayed and again.receipt_json == first.receipt_json


def test_no_helpdesk_means_no_outbox_row(box: Outbox):
    box.execute("acme", "op-1", TOOL, {"subject": "Local only", "helpdesk": False})
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 0}


def test_operation_read_shows_receipt_and_effects(box: Outbox):
    box.execute("acme", "op-1", TOOL, ARGS)
    view = box.get_operation("acme", "op-1")
    assert view["receipt"]["status"] == "created"
    [effect] = view["effects"]
    assert effect["effect"] == "open_ticket" and effect["adapter"] == "helpdesk"
    assert effect["status"] == "pending" and effect["attempts"] == 0
    assert effect["awaiting_review"] is False


def test_effect_key_is_stored_once_and_unique(box: Outbox):
    for i in range(5):
        box.execute("acme", f"op-{i}", TOOL, ARGS)
    with db.read(box.engine) as conn:
        keys = conn.execute(sa.select(schema.outbox.c.effect_key)).scalars().all()
    assert len(set(keys)) == 5 and all(k.startswith("obx_") for k in keys)


def test_an_effect_key_is_obx_and_a_random_version_4_uuid():
    """The key a provider sees: ``obx_`` and 32 hex digits of a version 4 UUID, as
    ``uuid.uuid4().hex`` writes them (the form every earlier key has)."""
    keys = [create.new_effect_key() for _ in range(2_000)]
    assert len(set(keys)) == len(keys)
    for key in keys:
        prefix, digits = key[:4], key[4:]
        parsed = uuid.UUID(hex=digits)
        assert prefix == "obx_" and digits == parsed.hex
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
    # Random apart from the six fixed bits: every hex digit but those two takes many values.
    for position in set(range(32)) - {12}:
        assert len({key[4 + position] for key in keys}) >= 4, position
