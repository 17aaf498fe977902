"""The review queue over HTTP: operator tokens only, scoped to the token's tenant,
mounted through the ``outbox.routers`` entry point like in production."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from outbox import Outbox, schema, states
from outbox.api import create_app
from tests.conftest import Clock
from tests.reconciler.support import create_effect, put_unknown, row, rows, snapshot
from tests.support.servers import serve_in_thread

S = states.EffectStatus
PROBLEM = "application/problem+json"


class Api:
    def __init__(self, client: httpx.Client, token: str) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {token}"}

    def get(self, url: str, **kw: Any) -> Any:
        return self.client.get(url, headers=self.headers, **kw)

    def post(self, url: str, json: Any, **headers: str) -> Any:
        return self.client.post(url, json=json, headers=self.headers | headers)


@pytest.fixture
def client(box: Outbox) -> Iterator[httpx.Client]:
    # The real app, with the review routes loaded from the entry point group.
    with serve_in_thread(create_app(box)) as base_url, httpx.Client(base_url=base_url) as c:
        yield c


@pytest.fixture
def operator(box: Outbox, client: httpx.Client) -> Api:
    return Api(client, box.create_token("acme", "operator", "alice's laptop"))


@pytest.fixture
def effect(box: Outbox, clock: Clock) -> int:
    e = create_effect(box)
    put_unknown(box.engine, e, at=clock(), needs_review=True)
    return e


def test_agents_get_403_and_strangers_401(box: Outbox, client: httpx.Client, effect: int) -> None:
    agent = Api(client, box.create_token("acme", "agent"))
    for response in (
        agent.get("/v1/review"),
        agent.get(f"/v1/review/{effect}"),
        agent.post(f"/v1/review/{effect}/resolve", {"choice": "happened", "reason": "x"}),
    ):
        assert response.status_code == 403
        assert response.headers["content-type"].startswith(PROBLEM)
    assert client.get("/v1/review").status_code == 401
    assert row(box.engine, effect).status == S.OUTCOME_UNKNOWN


def test_list_and_show(box: Outbox, clock: Clock, operator: Api, effect: int) -> None:
    other = create_effect(box, "op-g", tenant="globex")
    put_unknown(box.engine, other, at=clock(), needs_review=True)

    listed = operator.get("/v1/review")
    assert listed.status_code == 200
    assert [i["id"] for i in listed.json()["items"]] == [effect]  # not globex's
    assert operator.get("/v1/review", params={"group": "awaiting_lookup"}).json() == {"items": []}
    shown = operator.get(f"/v1/review/{effect}")
    assert shown.status_code == 200
    body = shown.json()
    assert body["effect_key"] == row(box.engine, effect).effect_key
    assert body["attempts_detail"][0]["outcome"] == "ambiguous"
    assert operator.get(f"/v1/review/{other}").status_code == 404
    assert operator.get("/v1/review/0").status_code == 422


def test_resolve_records_the_action_and_a_repeat_replays_it(
    box: Outbox, operator: Api, effect: int
) -> None:
    body = {
        "choice": "happened",
        "provider_ref": "T-7",
        "reason": "found it in the helpdesk",
        "actor": "alice",
    }
    first = operator.post(f"/v1/review/{effect}/resolve", body, **{"Idempotency-Key": "a-1"})
    assert first.status_code == 200, first.text
    assert first.headers["Idempotent-Replayed"] == "false"
    result = first.json()
    assert (result["status_before"], result["status_after"], result["action_id"]) == (
        "outcome_unknown",
        "succeeded",
        "a-1",
    )
    # The authenticated token is the actor; the caller's "alice" is only a note.
    assert result["actor"].startswith("token:") and result["actor"].endswith(" (alice's laptop)")
    assert result["actor_note"] == "alice"
    after = snapshot(box.engine, effect)

    again = operator.post(f"/v1/review/{effect}/resolve", body, **{"Idempotency-Key": "a-1"})
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == result | {"replayed": True}
    assert snapshot(box.engine, effect) == after


def test_a_stale_resolve_is_409_and_changes_nothing(
    box: Outbox, operator: Api, effect: int
) -> None:
    ok = operator.post(
        f"/v1/review/{effect}/resolve",
        {"choice": "not_happened_abandon", "reason": "customer withdrew", "action_id": "a-1"},
    )
    assert ok.status_code == 200
    before = snapshot(box.engine, effect)
    stale = operator.post(
        f"/v1/review/{effect}/resolve",
        {"choice": "not_happened_requeue", "reason": "try again", "action_id": "b-1"},
    )
    assert stale.status_code == 409
    assert stale.headers["content-type"].startswith(PROBLEM)
    problem = stale.json()
    assert (problem["type"].endswith("review-conflict"), problem["retry"]) == (True, "never")
    assert "failed" in problem["detail"]
    assert snapshot(box.engine, effect) == before
    assert len(rows(box.engine, schema.review_actions, effect)) == 1


INVALID_ACTIONS: list[dict[str, Any]] = [
    {"choice": "happened", "reason": "no reference given"},
    {"choice": "happened", "provider_ref": "T-1", "reason": ""},
    {"choice": "not_happened_requeue", "reason": "x", "provider_ref": "T-1"},
    {"choice": "maybe", "reason": "x"},
    {"choice": "happened", "provider_ref": "T-1", "reason": "x", "expected_status": "pending"},
    {"choice": "happened", "provider_ref": "T-1", "reason": "x", "surprise": 1},
    {"choice": "happened", "provider_ref": "T-1", "reason": "nul \u0000 inside"},
]


def test_invalid_actions_are_422_and_change_nothing(
    box: Outbox, operator: Api, effect: int
) -> None:
    before = snapshot(box.engine, effect)
    for body in INVALID_ACTIONS:
        response = operator.post(f"/v1/review/{effect}/resolve", body)
        assert response.status_code == 422, (body, response.text)
        assert response.headers["content-type"].startswith(PROBLEM)
    assert snapshot(box.engine, effect) == before


def test_another_tenants_effect_is_not_found(box: Outbox, clock: Clock, operator: Api) -> None:
    other = create_effect(box, "op-g", tenant="globex")
    put_unknown(box.engine, other, at=clock(), needs_review=True)
    before = snapshot(box.engine, other)
    response = operator.post(
        f"/v1/review/{other}/resolve", {"choice": "not_happened_abandon", "reason": "mine now"}
    )
    assert response.status_code == 404
    assert snapshot(box.engine, other) == before
