"""HTTP conventions: the Idempotency-Key as a structured-field string, problem type URIs that
resolve, ``/docs``, and an OpenAPI document that says every status, header and content type.

The HTTP layer only: SQLite (the contract suite covers both databases).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox.api import create_app, keys, problems
from outbox.client import AsyncClient, Outcome, Result, Retry
from outbox.service import Outbox
from tests.api.conftest import PROBLEM, Http, Tokens, asgi_http, assert_problem, written

TASK = {"subject": "Late parcel", "body": "Order 4711 is a week late", "priority": "high"}
ROOT = Path(__file__).resolve().parents[2]
WRITES = ["/v1/tasks", "/v1/tools/create_support_task"]


@pytest.fixture
def db_url(sqlite_url: str) -> str:
    return sqlite_url


# --- Idempotency-Key ------------------------------------------------------------------


@pytest.mark.parametrize("path", WRITES)
@pytest.mark.parametrize(
    ("first", "again"),
    [("abc", '"abc"'), ('"abc"', "abc"), ('"abc"', '"abc";v=1'), ("a\\b", '"a\\\\b"')],
    ids=["bare-then-quoted", "quoted-then-bare", "parameters-ignored", "escapes-undone"],
)
def test_a_quoted_key_and_the_bare_key_name_one_operation(
    asgi: Http, tokens: Tokens, box: Outbox, path: str, first: str, again: str
) -> None:
    created = asgi.post(path, json=TASK, headers=tokens.auth(tokens.acme, first))
    replay = asgi.post(path, json=TASK, headers=tokens.auth(tokens.acme, again))
    assert (created.status_code, replay.status_code) == (201, 201), replay.text
    assert created.headers["Idempotent-Replayed"] == "false"
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.content == created.content
    assert written(box) == {"tasks": 1, "operations": 1, "outbox": 1}
    # Both read back under the unquoted id.
    assert created.headers["Location"] == replay.headers["Location"]
    read = asgi.get(created.headers["Location"], headers=tokens.auth(tokens.acme))
    assert read.status_code == 200
    assert read.json()["operation_id"] == keys.parse(first)


@pytest.mark.parametrize(
    "bad",
    [
        '"abc',
        '"abc" x',
        '"a b"',
        '""',
        '"caf\u00e9"'.encode("latin-1"),
        '"abc", "def"',
        '"' + "k" * 256 + '"',
    ],
    ids=["unterminated", "trailing", "space", "empty", "non-ascii", "list", "too-long"],
)
def test_a_malformed_structured_key_is_400_and_writes_nothing(
    asgi: Http, tokens: Tokens, box: Outbox, bad: str | bytes
) -> None:
    headers: dict[str, str | bytes] = {**tokens.auth(tokens.acme), "Idempotency-Key": bad}
    response = asgi.post("/v1/tasks", json=TASK, headers=headers)
    assert_problem(response, 400, "invalid-operation-id", "after_fix")
    assert written(box) == {"tasks": 0, "operations": 0, "outbox": 0}


def test_bare_keys_that_are_not_structured_tokens_keep_their_meaning() -> None:
    # A UUID starts with a digit and "a;b" has a parameter delimiter: neither is an sf-token,
    # and both named records before the header was parsed; they still name the same ones.
    for key in ("550e8400-e29b-41d4-a716-446655440000", "a;b", "?1", "x,y", "*"):
        assert keys.parse(key) == key
    assert keys.parse('"order-4711"') == "order-4711"
    assert keys.parse(' "order-4711" ') == "order-4711"


# --- problem types ----------------------------------------------------------------------


def test_a_problem_type_is_a_uri_the_server_answers_with_its_page(
    asgi: Http, tokens: Tokens
) -> None:
    asgi.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, "op-1"))
    conflict = asgi.post(
        "/v1/tasks", json={**TASK, "subject": "Other"}, headers=tokens.auth(tokens.acme, "op-1")
    )
    doc = assert_problem(conflict, 422, "idempotency-key-reused", "never")
    # A relative reference: resolved against the request's URL it is this server's page.
    page = asgi.get(doc["type"])
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert doc["title"] in page.text
    assert "retry: never" in page.text
    index = asgi.get("/problems")
    assert index.status_code == 200
    assert 'href="/problems/idempotency-key-reused"' in index.text
    assert_problem(asgi.get("/problems/no-such-thing"), 404, "not-found", "never")


def test_every_problem_type_has_a_page_and_a_section_in_the_docs(asgi: Http) -> None:
    catalogue = problems.catalogue()
    # What the handlers may send: every error class, Starlette's statuses, and the fallbacks.
    assert {
        "idempotency-key-reused",
        "invalid-request",
        "internal",
        "http-error",
        "payload-too-large",
        "unauthenticated",
        "review-conflict",
    } <= catalogue.keys()
    for slug, problem in catalogue.items():
        page = asgi.get(problem.uri)
        assert page.status_code == 200, slug
        assert problem.retry in page.text
    text = (ROOT / "docs" / "problems.md").read_text(encoding="utf-8")
    assert text == problems.markdown(), (
        "docs/problems.md is out of date: python -c 'from outbox.api import problems; "
        'print(problems.markdown(), end="")\' > docs/problems.md'
    )


# --- /docs and /openapi.json ------------------------------------------------------------


def test_docs_answers_200_with_every_operation(http: Http) -> None:
    # ``http`` is the app in process and behind a real uvicorn server: what `curl /docs` gets.
    response = http.get("/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    for needle in (
        "POST /v1/tasks",
        "GET /v1/review/{effect_id}",
        "Idempotency-Key",
        "/openapi.json",
    ):
        assert needle in response.text
    assert "<script" not in response.text  # no third-party code on the console's origin


def _operations(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{method.upper()} {path}", op)
        for path, methods in schema["paths"].items()
        for method, op in methods.items()
    ]


def test_openapi_documents_the_key_every_status_and_every_problem_content_type(
    box: Outbox,
) -> None:
    with asgi_http(create_app(box)) as client:
        schema = client.get("/openapi.json").json()
    operations = dict(_operations(schema))
    assert {"GET /v1/review", "POST /v1/review/{effect_id}/resolve"} <= operations.keys()
    for name in ("POST /v1/tasks", "POST /v1/tools/{tool}"):
        op = operations[name]
        (key,) = [p for p in op["parameters"] if p["name"] == "Idempotency-Key"]
        assert key["in"] == "header" and key["required"] is True
        assert {"400", "401", "404", "410", "413", "415", "422", "500", "503"} <= op[
            "responses"
        ].keys()
        assert set(op["responses"]["201"]["headers"]) == {"Idempotent-Replayed", "Location"}
    resolve = operations["POST /v1/review/{effect_id}/resolve"]
    assert "Idempotency-Key" in {p["name"] for p in resolve["parameters"]}
    assert "Idempotent-Replayed" in resolve["responses"]["200"]["headers"]
    for name, op in _operations(schema):
        answers = op["responses"]
        assert {"400", "413", "500"} <= answers.keys(), name
        if op.get("security"):
            assert {"401", "503"} <= answers.keys(), name
            assert answers["401"]["headers"]["WWW-Authenticate"]["required"] is True
        for code, answer in answers.items():
            if int(code) >= 400:
                assert list(answer["content"]) == [PROBLEM], (name, code)
            if code in ("429", "503"):
                assert "Retry-After" in answer["headers"], (name, code)
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    problem = schema["components"]["schemas"]["Problem"]
    assert problem["properties"]["type"]["format"] == "uri-reference"


def test_the_answers_carry_the_headers_the_document_promises(asgi: Http, tokens: Tokens) -> None:
    unauthenticated = asgi.post("/v1/tasks", json=TASK, headers={"Idempotency-Key": "k"})
    assert_problem(unauthenticated, 401, "unauthenticated")
    assert unauthenticated.headers["WWW-Authenticate"] == "Bearer"
    created = asgi.post("/v1/tasks", json=TASK, headers=tokens.auth(tokens.acme, '"k-1"'))
    assert created.status_code == 201
    assert created.headers["Location"] == "/v1/operations/k-1"
    assert created.headers["Idempotent-Replayed"] == "false"


# --- the client against the app ----------------------------------------------------------


def test_the_async_client_writes_replays_and_reads_through_the_app(
    box: Outbox, tokens: Tokens
) -> None:
    app = create_app(box)

    async def main() -> list[Result]:
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://testserver", tokens.acme, transport=transport) as c:
            first = await c.create_task("order-4711", TASK)
            again = await c.create_task("order-4711", TASK, deadline=5)
            assert first.data is not None
            return [
                first,
                again,
                await c.get_operation("order-4711"),
                await c.get_task(int(first.data["task_id"])),
                await c.get_operation("never-made"),
                await c.create_task("order-4711", {**TASK, "subject": "Other"}),
            ]

    first, again, operation, task, missing, reused = asyncio.run(main())
    assert (first.outcome, again.outcome) == (Outcome.CREATED, Outcome.REPLAYED)
    assert again.body == first.body
    assert operation.outcome is task.outcome is Outcome.FOUND
    assert operation.data is not None and operation.data["receipt"] == first.receipt
    assert (missing.outcome, missing.problem_type) == (Outcome.REJECTED, "/problems/not-found")
    assert (reused.problem_slug, reused.retry) == ("idempotency-key-reused", Retry.NEVER)
    assert written(box) == {"tasks": 1, "operations": 1, "outbox": 1}
