"""Hostile input and credentials, kept as regression tests (docs/security.md names them).

- 413 for an oversized body, answered from its Content-Length before a byte of
  it is read;
- 400 for JSON nested too deeply;
- 415 for anything but application/json in UTF-8;
- 422 for server-owned fields (mass assignment), naming each one;
- tokens: only a SHA-256 is stored, and an expired token authenticates nothing.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import sqlalchemy as sa

from outbox import errors, schema
from outbox.api import create_app
from outbox.service import Outbox
from tests.api.conftest import Http, Tokens, assert_problem, written
from tests.conftest import Clock
from tests.support.servers import serve_in_thread

NOTHING = {"tasks": 0, "operations": 0, "outbox": 0}
SERVER_OWNED = ["id", "tenant", "status", "operation_id", "created_at", "updated_at", "task_id"]


def test_an_oversized_body_is_413_before_it_is_read(box: Outbox, tokens: Tokens) -> None:
    """Declared 100 MB, none of it sent: the answer cannot have waited for the body."""
    with serve_in_thread(create_app(box)) as base_url:
        host, port = base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(
                b"POST /v1/tasks HTTP/1.1\r\nHost: outbox\r\n"
                b"Authorization: Bearer " + tokens.acme.encode() + b"\r\n"
                b"Idempotency-Key: op-huge\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000000\r\n\r\n"
            )
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]
    assert written(box) == NOTHING


def test_deeply_nested_json_is_400(asgi: Http, tokens: Tokens, box: Outbox) -> None:
    headers = {**tokens.auth(tokens.acme, "op-deep"), "Content-Type": "application/json"}
    for body in (b"[" * 20_000 + b"]" * 20_000, b'{"a":' * 5_000 + b"1" + b"}" * 5_000):
        doc = assert_problem(
            asgi.post("/v1/tasks", content=body, headers=headers), 400, "malformed-request"
        )
        assert doc["retry"] == "after_fix"
    assert written(box) == NOTHING


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1", ""],
)
def test_a_wrong_content_type_is_415(
    asgi: Http, tokens: Tokens, box: Outbox, content_type: str
) -> None:
    headers = {**tokens.auth(tokens.acme, "op-type"), "Content-Type": content_type}
    assert_problem(
        asgi.post("/v1/tasks", content=b'{"subject": "x"}', headers=headers),
        415,
        "unsupported-media-type",
    )
    assert written(box) == NOTHING


@pytest.mark.parametrize("field", SERVER_OWNED)
def test_server_owned_fields_are_422_mass_assignment(
    asgi: Http, tokens: Tokens, box: Outbox, field: str
) -> None:
    body = {"subject": "hello", field: "acme-or-anything"}
    doc = assert_problem(
        asgi.post("/v1/tasks", json=body, headers=tokens.auth(tokens.acme, f"op-{field}")),
        422,
        retry="after_fix",
    )
    assert [e["field"] for e in doc["errors"]] == [field]
    assert written(box) == NOTHING


def test_review_actions_refuse_server_owned_fields(box: Outbox, tokens: Tokens, asgi: Http):
    body = {"choice": "happened", "reason": "x", "provider_ref": "T", "status_after": "failed"}
    answer = asgi.post("/v1/review/1/resolve", json=body, headers=tokens.auth(tokens.acme_operator))
    doc = assert_problem(answer, 422)
    assert "status_after" in {e["field"].split(".")[-1] for e in doc["errors"]}


def test_tokens_are_stored_only_as_their_sha256(box: Outbox, tokens: Tokens) -> None:
    with box.engine.connect() as conn:
        stored = conn.execute(sa.select(schema.api_tokens)).all()
    for row in stored:
        assert tokens.acme not in [str(v) for v in row]
        assert len(row.token_sha256) == 64
    assert any(row.token_sha256 == schema_hash(tokens.acme) for row in stored)


def schema_hash(token: str) -> str:
    from outbox.service import hash_token

    return hash_token(token)


def test_an_expired_token_authenticates_nothing(
    box: Outbox, tokens: Tokens, asgi: Http, clock: Clock
) -> None:
    token = box.create_token("acme", "agent", "ci", expires_in=timedelta(hours=1))
    assert asgi.get("/v1/tasks/999", headers=tokens.auth(token)).status_code == 404
    clock.advance(timedelta(hours=1))
    assert_problem(asgi.get("/v1/tasks/999", headers=tokens.auth(token)), 401, "unauthenticated")
    assert box.authenticate(token) is None
    with pytest.raises(errors.InvalidArguments):
        box.create_token("acme", "agent", expires_in=timedelta(0))


def test_tokens_create_expires_in_on_the_command_line(sqlite_url: str, capsys) -> None:
    from outbox import cli

    url = ["--database-url", sqlite_url]
    assert cli.main([*url, "db", "upgrade"]) == 0
    assert cli.main([*url, "tenants", "create", "acme"]) == 0
    capsys.readouterr()
    assert (
        cli.main(
            [*url, "tokens", "create", "--tenant", "acme", "--role", "agent", "--expires-in", "30d"]
        )
        == 0
    )
    token = capsys.readouterr().out.strip().splitlines()[-1]
    with Outbox(sqlite_url) as box, box.engine.connect() as conn:
        row = conn.execute(sa.select(schema.api_tokens)).one()
        assert box.authenticate(token) is not None
    assert row.expires_at is not None
    assert timedelta(days=29) < row.expires_at - row.created_at <= timedelta(days=30)
    assert (
        cli.main(
            [
                *url,
                "tokens",
                "create",
                "--tenant",
                "acme",
                "--role",
                "agent",
                "--expires-in",
                "soon",
            ]
        )
        == 2
    )


@pytest.mark.parametrize("field", ["adapter", "base_url", "url", "callback_url", "headers"])
def test_a_caller_cannot_choose_where_an_effect_is_sent(
    asgi: Http, tokens: Tokens, box: Outbox, field: str
) -> None:
    """SSRF: destinations come from the operator's adapters file, never from a request."""
    body = {"subject": "hello", field: "http://169.254.169.254/latest/meta-data/"}
    doc = assert_problem(
        asgi.post("/v1/tasks", json=body, headers=tokens.auth(tokens.acme, f"op-{field}")), 422
    )
    assert [e["field"] for e in doc["errors"]] == [field]
    assert written(box) == NOTHING
