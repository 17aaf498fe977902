"""The caller's contract (DESIGN.md) over HTTP, on both transports and both databases."""

from __future__ import annotations

from outbox import errors, faults, schema
from outbox.service import Outbox
from tests.api.conftest import (
    Http,
    Tokens,
    assert_problem,
    count,
    written,
)
from tests.conftest import Clock

TASK = {"subject": "Late parcel", "body": "Order 4711 is a week late", "priority": "high"}


INVALID = [
    ({"subject": ""}, {"subject"}),
    ({"subject": "x", "priority": "urgent"}, {"priority"}),
    ({"subject": 42}, {"subject"}),
    ({"body": "no subject"}, {"subject"}),
    ({"subject": "x", "colour": "red"}, {"colour"}),
    ({"subject": "x", "helpdesk": "yes"}, {"helpdesk"}),
    ([1, 2, 3], {""}),
    ({"subject": "nul\u0000byte"}, {"subject"}),
    ({"subject": "", "priority": "urgent"}, {"subject", "priority"}),
]


BAD_KEYS: list[dict[str, str]] = [
    {},
    {"Idempotency-Key": ""},
    {"Idempotency-Key": "k" * 256},
    {"Idempotency-Key": "has space"},
    {"Idempotency-Key": "tab\tinside"},
]


def test_created_then_replayed_with_the_first_status_and_identical_bytes(
    http: Http, tokens: Tokens, box: Outbox
) -> None:
    first = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    assert first.status_code == 201
    assert first.headers["content-type"] == "application/json"
    assert first.headers["idempotent-replayed"] == "false"
    receipt = first.json()
    assert receipt["operation_id"] == "op-1"
    assert receipt["status"] == "created"

    for _ in range(3):
        again = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
        assert again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
    assert written(box) == {"tasks": 1, "operations": 1, "outbox": 1}


def test_the_tools_route_and_the_tasks_route_are_one_contract(
    asgi: Http, tokens: Tokens, box: Outbox
) -> None:
    first = asgi.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    again = asgi.post(
        "/v1/tools/create_support_task", json=TASK, headers=tokens.auth(tokens.acme, "op-1")
    )
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert count(box, schema.tasks) == 1


def test_same_key_other_arguments_is_a_conflict_and_writes_nothing(
    http: Http, tokens: Tokens, box: Outbox
) -> None:
    first = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    changed = {**TASK, "priority": "low"}
    conflict = http.post("/v1/tasks", json=changed, headers=tokens.auth(tokens.acme, "op-1"))
    assert_problem(conflict, 422, "idempotency-key-reused", "never")
    assert written(box) == {"tasks": 1, "operations": 1, "outbox": 1}
    # The conflict did not disturb the record: the original still replays.
    again = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    assert again.content == first.content


def test_a_new_key_with_the_same_subject_creates_a_second_task(
    http: Http, tokens: Tokens, box: Outbox
) -> None:
    a = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    b = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-2"))
    assert (a.status_code, b.status_code) == (201, 201)
    assert b.headers["idempotent-replayed"] == "false"
    assert a.json()["task_id"] != b.json()["task_id"]
    assert count(box, schema.tasks) == 2


def test_another_tenants_key_finds_nothing_and_never_their_receipt(
    http: Http, tokens: Tokens, box: Outbox
) -> None:
    acme = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "shared-key"))
    acme_task = acme.json()["task_id"]

    # globex reads acme's operation and task: 404, shaped exactly like a missing one.
    theirs = http.get("/v1/operations/shared-key", headers=tokens.auth(tokens.globex))
    missing = http.get("/v1/operations/no-such-key", headers=tokens.auth(tokens.globex))
    assert_problem(theirs, 404, "not-found", "never")
    assert {k: v for k, v in theirs.json().items() if k != "detail"} == {
        k: v for k, v in missing.json().items() if k != "detail"
    }
    their_task = http.get(f"/v1/tasks/{acme_task}", headers=tokens.auth(tokens.globex))
    missing_task = http.get("/v1/tasks/999999", headers=tokens.auth(tokens.globex))
    assert_problem(their_task, 404, "not-found", "never")
    assert their_task.json()["detail"].replace(str(acme_task), "N") == missing_task.json()[
        "detail"
    ].replace("999999", "N")
    for response in (theirs, their_task):
        assert "Late parcel" not in response.text

    # globex writes under acme's key: its own, new task; acme's receipt never comes back.
    mine = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.globex, "shared-key"))
    assert mine.status_code == 201
    assert mine.headers["idempotent-replayed"] == "false"
    assert mine.json()["task_id"] != acme_task
    assert mine.content != acme.content
    assert count(box, schema.tasks) == 2
    # and acme still sees only its own.
    again = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "shared-key"))
    assert again.content == acme.content


def test_invalid_fields_are_422_after_fix_with_per_field_errors_and_nothing_stored(
    http: Http, tokens: Tokens, box: Outbox
) -> None:
    for arguments, fields in INVALID:
        response = http.post("/v1/tasks", json=arguments, headers=tokens.auth(tokens.acme, "op-1"))
        doc = assert_problem(response, 422, "invalid-arguments", "after_fix")
        assert {e["field"] for e in doc["errors"]} == fields, arguments
        assert all(e["message"] for e in doc["errors"])
    assert written(box) == {"tasks": 0, "operations": 0, "outbox": 0}
    # Nothing was stored, so the same key with fixed arguments creates.
    fixed = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    assert fixed.status_code == 201
    assert fixed.headers["idempotent-replayed"] == "false"


def test_a_255_character_key_is_accepted(http: Http, tokens: Tokens) -> None:
    key = "".join(chr(0x21 + i % 94) for i in range(255))
    response = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, key))
    assert response.status_code == 201
    assert response.json()["operation_id"] == key
    # The read route takes it back, percent-encoded (it contains '/', '?', '#', '%').
    read = http.get(response.headers["location"], headers=tokens.auth(tokens.acme))
    assert read.status_code == 200
    assert read.json()["operation_id"] == key


def test_authentication_comes_first_even_on_a_replay(http: Http, tokens: Tokens) -> None:
    created = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    assert created.status_code == 201
    for authorization in (
        None,
        "Bearer obx_not-a-token",
        f"Bearer {tokens.revoked}",
        "Basic YWNtZTphY21l",
        "Bearer",
        f"bearer  {tokens.acme}x",
    ):
        headers = {"Idempotency-Key": "op-1"}
        if authorization is not None:
            headers["Authorization"] = authorization
        replay = http.post("/v1/tasks", json=TASK, headers=headers)
        assert_problem(replay, 401, "unauthenticated", "after_fix")
        assert replay.headers["www-authenticate"] == "Bearer"
        assert created.content not in replay.content
        assert_problem(http.get("/v1/operations/op-1", headers=headers), 401, "unauthenticated")


def test_a_token_revoked_after_creation_no_longer_replays(
    asgi: Http, tokens: Tokens, box: Outbox
) -> None:
    token = box.create_token("acme", "agent")
    assert asgi.post("/v1/tasks", json=TASK, headers=tokens.auth(token, "op-1")).status_code == 201
    box.revoke_token(token)
    assert_problem(asgi.post("/v1/tasks", json=TASK, headers=tokens.auth(token, "op-1")), 401)


def test_an_expired_key_is_410_reconcile_never_a_second_task(
    asgi: Http, tokens: Tokens, box: Outbox, clock: Clock
) -> None:
    # No helpdesk effect: retention waits for effects to be terminal, and none is here.
    local = {"subject": "Late parcel", "helpdesk": False}
    first = asgi.post("/v1/tasks", json=local, headers=tokens.auth(tokens.acme, "op-1"))
    assert first.status_code == 201
    clock.advance(box.settings.retention.total_seconds() + 1)
    assert box.prune().tombstoned == 1
    late = asgi.post("/v1/tasks", json=local, headers=tokens.auth(tokens.acme, "op-1"))
    assert_problem(late, 410, "operation-expired", "reconcile")
    read = asgi.get("/v1/operations/op-1", headers=tokens.auth(tokens.acme))
    assert_problem(read, 410, "operation-expired", "reconcile")
    assert count(box, schema.tasks) == 1


def test_busy_is_503_same_key_with_retry_after_and_the_same_key_then_creates(
    asgi: Http, tokens: Tokens, box: Outbox
) -> None:
    faults.arm("create.after_task_insert", errors.Busy())
    busy = asgi.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    assert_problem(busy, 503, "busy", "same_key")
    assert busy.headers["retry-after"] == "1"
    assert written(box) == {"tasks": 0, "operations": 0, "outbox": 0}
    faults.disarm()
    retried = asgi.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    assert retried.status_code == 201
    assert retried.headers["idempotent-replayed"] == "false"


def test_get_operation_shows_the_receipt_and_each_effect(asgi: Http, tokens: Tokens) -> None:
    created = asgi.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    view = asgi.get("/v1/operations/op-1", headers=tokens.auth(tokens.acme))
    assert view.status_code == 200
    doc = view.json()
    assert doc["receipt"] == created.json()
    assert doc["created_at"].endswith("+00:00")
    [effect] = doc["effects"]
    assert effect["effect"] == "open_ticket"
    assert effect["adapter"] == "helpdesk"
    assert effect["status"] == "pending"
    assert effect["attempts"] == 0
    assert effect["provider_ref"] is None
    assert effect["last_error"] is None
    assert effect["awaiting_review"] is False

    task = asgi.get(f"/v1/tasks/{doc['task_id']}", headers=tokens.auth(tokens.acme))
    assert task.status_code == 200
    assert task.json()["subject"] == "Late parcel"
    assert_problem(asgi.get("/v1/tasks/0", headers=tokens.auth(tokens.acme)), 422)
    assert_problem(asgi.get(f"/v1/tasks/{2**64}", headers=tokens.auth(tokens.acme)), 422)
