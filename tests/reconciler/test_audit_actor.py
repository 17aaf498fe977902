"""Audit integrity: the actor of an operator action is the authenticated principal.

Whatever the caller writes in ``actor`` (even another operator's name or token
id) is kept as a note; the recorded actor is the token that made the request,
by id and label. On the command line, which authenticates no token, it is the
OS account.
"""

from __future__ import annotations

import getpass
import json
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa

from outbox import Outbox, cli, db, schema
from outbox.api import create_app
from tests.conftest import Clock
from tests.reconciler.support import create_effect, put_unknown
from tests.support.servers import serve_in_thread


@pytest.fixture
def client(box: Outbox) -> Iterator[httpx.Client]:
    with serve_in_thread(create_app(box)) as base_url, httpx.Client(base_url=base_url) as c:
        yield c


def _token_id(box: Outbox, token: str) -> int:
    principal = box.authenticate(token)
    assert principal is not None
    return principal.token_id


def _audit(box: Outbox, effect: int) -> list[sa.Row]:
    ra = schema.review_actions
    with db.read(box.engine) as conn:
        return list(conn.execute(sa.select(ra).where(ra.c.effect_id == effect)).all())


@pytest.mark.parametrize(
    "claimed",
    [None, "alice", "token:1 (admin)", "bob (token:999)"],
    ids=["no-actor", "a-name", "another-token", "spoofed-shape"],
)
def test_the_audit_entry_names_the_token_whatever_actor_the_caller_sent(
    box: Outbox, clock: Clock, client: httpx.Client, claimed: str | None
) -> None:
    box.create_token("acme", "operator", "admin")  # token 1: the one a spoofer names
    token = box.create_token("acme", "operator", "carol's laptop")
    token_id = _token_id(box, token)
    effect = create_effect(box)
    put_unknown(box.engine, effect, at=clock(), needs_review=True)
    body = {"choice": "not_happened_abandon", "reason": "customer cancelled"}
    if claimed is not None:
        body["actor"] = claimed

    answer = client.post(
        f"/v1/review/{effect}/resolve",
        json=body,
        headers={"Authorization": f"Bearer {token}", "Idempotency-Key": "act-1"},
    )

    assert answer.status_code == 200, answer.text
    expected = f"token:{token_id} (carol's laptop)"
    [entry] = _audit(box, effect)
    assert (entry.actor, entry.actor_token_id, entry.actor_note) == (expected, token_id, claimed)
    assert answer.json()["actor"] == expected
    shown = client.get(f"/v1/review/{effect}", headers={"Authorization": f"Bearer {token}"})
    [audit] = shown.json()["audit"]
    assert (audit["actor"], audit["actor_token_id"], audit["actor_note"]) == (
        expected,
        token_id,
        claimed,
    )


def test_a_replay_from_another_token_with_the_same_action_id_is_not_taken_as_its_own(
    box: Outbox, clock: Clock, client: httpx.Client
) -> None:
    first = box.create_token("acme", "operator", "first")
    second = box.create_token("acme", "operator", "second")
    effect = create_effect(box)
    put_unknown(box.engine, effect, at=clock(), needs_review=True)
    body = {"choice": "not_happened_abandon", "reason": "customer cancelled", "actor": "same"}
    ok = client.post(
        f"/v1/review/{effect}/resolve",
        json=body,
        headers={"Authorization": f"Bearer {first}", "Idempotency-Key": "act-1"},
    )
    assert ok.status_code == 200
    other = client.post(
        f"/v1/review/{effect}/resolve",
        json=body,
        headers={"Authorization": f"Bearer {second}", "Idempotency-Key": "act-1"},
    )
    # Another principal reusing the action id is a conflict, never a replay in its name.
    assert other.status_code == 409, other.text
    [entry] = _audit(box, effect)
    assert entry.actor_token_id == _token_id(box, first)


def test_on_the_command_line_the_actor_is_the_os_account(
    box: Outbox, clock: Clock, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    effect = create_effect(box)
    put_unknown(box.engine, effect, at=clock(), needs_review=True)
    argv = ["--database-url", db_url, "review", "resolve", str(effect), "--not-happened"]
    argv += ["--abandon", "--reason", "customer cancelled", "--actor", "token:1 (admin)"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    [entry] = _audit(box, effect)
    assert entry.actor == result["actor"] == f"os:{getpass.getuser()}"
    assert (entry.actor_token_id, entry.actor_note) == (None, "token:1 (admin)")
