"""The console without a browser: tenant isolation, and the audit actor of a console action.

An operator of one tenant gets "not found" for another tenant's effect, and an
action from the console records the signed-in token as the actor; the name
typed at sign-in is only a note.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa

from outbox import Outbox, db, schema
from outbox.api import create_app
from reconciler import review
from tests.conftest import Clock
from tests.reconciler.support import create_effect, put_unknown
from tests.support.servers import serve_in_thread

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
def box(sqlite_url: str, clock: Clock) -> Iterator[Outbox]:
    with Outbox(sqlite_url, clock=clock) as box:
        box.create_tenant("acme")
        box.create_tenant("globex")
        yield box


def _signed_in(client: httpx.Client, token: str, name: str) -> None:
    page = client.get("/console/sign-in")
    csrf = CSRF.search(page.text)
    assert csrf, page.text[:500]
    answer = client.post(
        "/console/sign-in", data={"token": token, "name": name, "csrf": csrf.group(1)}
    )
    assert answer.status_code in (200, 303), answer.text[:500]


def test_another_tenants_effect_is_not_found_in_the_console(box: Outbox, clock: Clock) -> None:
    theirs = create_effect(box, "op-g", tenant="globex")
    put_unknown(box.engine, theirs, at=clock(), needs_review=True)
    token = box.create_token("acme", "operator", "acme console")
    with serve_in_thread(create_app(box)) as url, httpx.Client(base_url=url) as client:
        _signed_in(client, token, "Alice")
        assert client.get(f"/console/items/{theirs}").status_code == 404
        queue = client.get("/console/queue")
        assert queue.status_code == 200
        assert f"/console/items/{theirs}" not in queue.text


def test_a_console_action_names_the_signed_in_token(box: Outbox, clock: Clock) -> None:
    effect = create_effect(box)
    put_unknown(box.engine, effect, at=clock(), needs_review=True)
    token = box.create_token("acme", "operator", "acme console")
    principal = box.authenticate(token)
    assert principal is not None
    with serve_in_thread(create_app(box)) as url, httpx.Client(base_url=url) as client:
        _signed_in(client, token, "token:1 (admin)")
        page = client.get(f"/console/items/{effect}")
        csrf = CSRF.search(page.text)
        assert csrf
        form = {
            "csrf": csrf.group(1),
            "choice": "not_happened_abandon",
            "reason": "customer cancelled",
            "action_id": "console-1",
            "expected_status": "outcome_unknown",
            "expected_attempts": str(review.show(box.engine, effect, tenant="acme")["attempts"]),
            "confirm": "yes",
        }
        answer = client.post(f"/console/items/{effect}/resolve", data=form)
        assert answer.status_code in (200, 303), answer.text[:800]
    ra = schema.review_actions
    with db.read(box.engine) as conn:
        [entry] = conn.execute(sa.select(ra).where(ra.c.effect_id == effect)).all()
    assert entry.actor == f"token:{principal.token_id} (acme console)"
    assert (entry.actor_token_id, entry.actor_note) == (principal.token_id, "token:1 (admin)")
