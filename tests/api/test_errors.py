"""The HTTP layer's own answers: key, auth, media type, size, JSON, plugged-in routes, health.

None of these depends on the database behind the app, so they run on SQLite only
(the PostgreSQL clone per test costs more than the checks themselves); the
contract tests in ``test_contract.py`` run on both.
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends

from outbox import errors, faults
from outbox.api import auth, create_app
from outbox.service import Outbox, Principal
from tests.api.conftest import (
    PROBLEM,
    Http,
    Tokens,
    asgi_http,
    assert_problem,
    written,
)

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


def test_a_bad_idempotency_key_is_400_and_is_checked_before_the_body(
    asgi: Http, tokens: Tokens, box: Outbox
) -> None:
    for bad in BAD_KEYS:
        response = asgi.post(
            "/v1/tasks",
            content=b"{not json",
            headers={**tokens.auth(tokens.acme), "Content-Type": "application/json", **bad},
        )
        assert_problem(response, 400, "invalid-operation-id", "after_fix")
    assert written(box)["operations"] == 0


def test_two_idempotency_keys_are_refused(asgi: Http, tokens: Tokens) -> None:
    response = asgi.post(
        "/v1/tasks",
        json=TASK,
        headers=[
            ("Authorization", f"Bearer {tokens.acme}"),
            ("Idempotency-Key", "a"),
            ("Idempotency-Key", "b"),
        ],
    )
    assert_problem(response, 400, "invalid-operation-id")


def test_unknown_tool_method_media_type_and_json_errors(
    asgi: Http, tokens: Tokens, box: Outbox
) -> None:
    headers = tokens.auth(tokens.acme, "op-1")
    assert_problem(
        asgi.post("/v1/tools/drop_tables", json=TASK, headers=headers), 404, "unknown-tool"
    )
    not_allowed = asgi.request("DELETE", "/v1/tasks", headers=headers)
    assert_problem(not_allowed, 405, "method-not-allowed", "never")
    assert not_allowed.headers["allow"] == "POST"
    assert_problem(
        asgi.post("/v1/tasks", data={"subject": "form"}, headers=headers),
        415,
        "unsupported-media-type",
        "after_fix",
    )
    latin1 = {**headers, "Content-Type": "application/json; charset=latin-1"}
    assert_problem(asgi.post("/v1/tasks", content=b"{}", headers=latin1), 415)
    as_json = {**headers, "Content-Type": "application/json"}
    for body in (b"", b"{", b'{"subject": "x"} trailing', b"\xff\xfe{}", b'{"subject": NaN}'):
        doc = assert_problem(
            asgi.post("/v1/tasks", content=body, headers=as_json), 400, "malformed-request"
        )
        assert doc["retry"] == "after_fix"
    assert_problem(
        asgi.post("/v1/tasks", content=b"[" * 20_000, headers=as_json), 400, "malformed-request"
    )
    assert_problem(asgi.get("/v1/nowhere", headers=headers), 404, "not-found")
    assert written(box) == {"tasks": 0, "operations": 0, "outbox": 0}


def test_a_body_over_64_kib_is_413_whether_declared_or_streamed(
    http: Http, tokens: Tokens, box: Outbox
) -> None:
    headers = {**tokens.auth(tokens.acme, "op-1"), "Content-Type": "application/json"}
    big = b'{"subject": "x", "body": "' + b"a" * 70_000 + b'"}'
    assert_problem(http.post("/v1/tasks", content=big, headers=headers), 413, "payload-too-large")

    def chunks() -> Any:  # no Content-Length: the server must count as it reads
        yield big[:40_000]
        yield big[40_000:]

    if http.base_url.startswith("http://127.0.0.1"):
        streamed = http.post("/v1/tasks", content=chunks(), headers=headers)
        assert_problem(streamed, 413, "payload-too-large")
    # Just under the limit is parsed (and refused only for its field's length).
    near = b'{"subject": "x", "body": "' + b"a" * 60_000 + b'"}'
    doc = assert_problem(http.post("/v1/tasks", content=near, headers=headers), 422)
    assert [e["field"] for e in doc["errors"]] == ["body"]
    assert written(box) == {"tasks": 0, "operations": 0, "outbox": 0}


def test_an_unexpected_error_is_an_opaque_500_problem(
    app: Any, tokens: Tokens, box: Outbox
) -> None:
    faults.arm(
        "create.after_operation_insert",
        RuntimeError("INSERT INTO operations ... password=hunter2"),
    )
    with asgi_http(app, raise_app_exceptions=False) as http:
        response = http.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    doc = assert_problem(response, 500, "internal", "same_key")
    for leak in ("INSERT", "hunter2", "Traceback", "RuntimeError", "operations"):
        assert leak not in response.text
    assert doc["detail"]
    assert written(box) == {"tasks": 0, "operations": 0, "outbox": 0}


def test_operator_routes_refuse_agent_tokens_and_plugged_in_errors_render_as_problems(
    box: Outbox, tokens: Tokens
) -> None:
    router = APIRouter()

    @router.post("/v1/review/{effect_id}/resolve")
    def resolve(
        effect_id: int, principal: Annotated[Principal, Depends(auth.require_operator)]
    ) -> dict[str, Any]:
        if effect_id == 2:
            raise errors.ReviewConflict(effect_id, "outcome_unknown", "succeeded")
        return {"effect_id": effect_id, "by": principal.tenant, "role": principal.role}

    app = create_app(box, routers=[router])
    with asgi_http(app) as http:
        ok = http.post("/v1/review/1/resolve", headers=tokens.auth(tokens.acme_operator))
        assert ok.json() == {"effect_id": 1, "by": "acme", "role": "operator"}
        assert_problem(
            http.post("/v1/review/1/resolve", headers=tokens.auth(tokens.acme)),
            403,
            "forbidden",
            "never",
        )
        assert_problem(http.post("/v1/review/1/resolve"), 401, "unauthenticated")
        assert_problem(
            http.post("/v1/review/2/resolve", headers=tokens.auth(tokens.acme_operator)),
            409,
            "review-conflict",
            "never",
        )


def test_routers_from_the_entry_point_group_are_mounted(
    box: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = APIRouter()

    @router.get("/v1/plugged")
    def plugged() -> dict[str, bool]:
        return {"plugged": True}

    class Entry:
        def load(self) -> Any:
            return lambda: [router]

    real = importlib.metadata.entry_points

    def entry_points(**kwargs: Any) -> Any:
        return [Entry()] if kwargs.get("group") == "outbox.routers" else real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    with asgi_http(create_app(box)) as http:
        assert http.get("/v1/plugged").json() == {"plugged": True}


def test_health_readiness_and_the_openapi_document(asgi: Http, tmp_path: Any) -> None:
    assert asgi.get("/healthz").json() == {"status": "ok"}
    ready = asgi.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    document = asgi.get("/openapi.json").json()
    assert {"/v1/tasks", "/v1/tools/{tool}", "/v1/operations/{operation_id}"} <= set(
        document["paths"]
    )


def test_readyz_is_503_on_a_database_that_is_not_migrated(tmp_path: Any) -> None:
    box = Outbox(f"sqlite:///{tmp_path / 'empty.db'}", check_schema=False)
    with box, asgi_http(create_app(box)) as http:
        assert http.get("/healthz").status_code == 200
        doc = assert_problem(http.get("/readyz"), 503, "schema", "after_fix")
        assert "outbox db upgrade" in doc["detail"]
        assert http.get("/readyz").headers["content-type"] == PROBLEM


@pytest.fixture
def db_url(sqlite_url: str) -> str:
    return sqlite_url
