"""The console's Groups and Bulk pages and the item page's provider events, over HTTP."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
import sqlalchemy as sa

from outbox import Outbox, db, schema, settings, states
from outbox.api import create_app
from tests.conftest import Clock
from tests.support.servers import serve_in_thread

S = states.EffectStatus
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
def signed_in(sqlite_url: str, clock: Clock) -> Iterator[tuple[Outbox, httpx.Client]]:
    config = settings.load(database_url=sqlite_url, console_secure_cookies=False)
    box = Outbox(sqlite_url, config=config, clock=clock)
    box.create_tenant("acme")
    token = box.create_token("acme", "operator")
    with serve_in_thread(create_app(box)) as url, httpx.Client(base_url=url) as client:
        page = client.get("/console/sign-in")
        csrf = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
        reply = client.post(
            "/console/sign-in",
            data={"csrf": csrf, "token": token, "name": "ops"},
        )
        assert reply.status_code == 303
        yield box, client
    box.close()


def _unknown(box: Outbox, clock: Clock, count: int) -> list[int]:
    for i in range(count):
        box.execute("acme", f"op-{i}", "create_support_task", {"subject": f"s{i}"})
    out = schema.outbox
    with db.write(box.engine) as conn:
        conn.execute(
            sa.update(out).values(
                status=S.OUTCOME_UNKNOWN,
                reason=states.Reason.REVIEW_NO_LOOKUP,
                maybe_sent=True,
                needs_review=True,
                review_since=clock() - timedelta(hours=2),
                updated_at=clock(),
            )
        )
        return list(conn.execute(sa.select(out.c.id).order_by(out.c.id)).scalars())


def test_bulk_page_counts_then_applies_once(signed_in, clock: Clock) -> None:
    box, client = signed_in
    ids = _unknown(box, clock, 4)
    page = client.get("/console/bulk")
    assert page.status_code == 200
    csrf = CSRF.search(page.text).group(1)  # type: ignore[union-attr]
    form = {
        "csrf": csrf,
        "action": "abandon",
        "older_than": "1h",
        "reason": "never happened",
        "step": "preview",
    }
    preview = client.post("/console/bulk", data=form)
    assert preview.status_code == 200
    assert "<strong>4</strong> items selected" in preview.text
    bulk_id = re.search(r'name="bulk_id" value="([^"]+)"', preview.text).group(1)  # type: ignore[union-attr]
    applied = client.post("/console/bulk", data={**form, "step": "apply", "bulk_id": bulk_id})
    assert applied.status_code == 200 and "4 applied, 0 skipped of 4 selected" in applied.text
    again = client.post("/console/bulk", data={**form, "step": "apply", "bulk_id": bulk_id})
    assert "Already recorded" in again.text
    with db.read(box.engine) as conn:
        statuses = conn.execute(sa.select(schema.outbox.c.status)).scalars().all()
    assert statuses == [S.FAILED] * len(ids)


def test_groups_page_and_item_page(signed_in, clock: Clock) -> None:
    box, client = signed_in
    page = client.get("/console/groups")
    assert page.status_code == 200 and "No ordering group is held back" in page.text
    (effect_id, *_) = _unknown(box, clock, 1)
    item = client.get(f"/console/items/{effect_id}")
    assert item.status_code == 200 and "Provider events" in item.text
