"""The ledger and fault control endpoints under /_admin."""

from __future__ import annotations

import pytest

from fake_provider import FaultSpec, Mode, Outcome

from .conftest import AppFactory, FakeClock, open_client, ticket_body

pytestmark = pytest.mark.anyio


async def test_stats_and_effects_count_duplicates(make_app: AppFactory, clock: FakeClock) -> None:
    app = make_app(mode=Mode.IGNORE)
    async with open_client(app, "asgi") as client:
        for reference, key in [("a", "a"), ("a", "a"), ("a", "a2"), ("b", "b"), (None, None)]:
            headers = {"Idempotency-Key": key} if key else {}
            await client.post("/v1/tickets", json=ticket_body(reference), headers=headers)
            clock.advance(seconds=1)
        stats = (await client.get("/_admin/stats")).json()
        effects = (await client.get("/_admin/effects")).json()["effects"]
    assert stats == {
        "tickets": 5,
        "distinct_references": 2,
        "distinct_keys": 3,
        "duplicates": {"a": 3},
        "duplicate_keys": {"a": 2},
        "requests": {outcome.value: (5 if outcome is Outcome.OK else 0) for outcome in Outcome},
    }
    assert [(e["client_reference"], e["idempotency_key"]) for e in effects] == [
        ("a", "a"),
        ("a", "a"),
        ("a", "a2"),
        ("b", "b"),
        (None, None),
    ]
    assert set(effects[0]) == {"id", "idempotency_key", "client_reference", "created_at", "outcome"}
    assert effects[0]["created_at"] == "2026-01-01T12:00:00.000000+00:00"
    assert effects[1]["created_at"] == "2026-01-01T12:00:01.000000+00:00"


async def test_reset_empties_the_store_and_restarts_the_plan(make_app: AppFactory) -> None:
    app = make_app(faults=FaultSpec(script=(Outcome.FAIL_AFTER_COMMIT,)))
    async with open_client(app, "asgi") as client:
        first = await client.post(
            "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
        )
        old_id = (await client.get("/_admin/effects")).json()["effects"][0]["id"]
        assert (await client.post("/_admin/reset")).json() == {"reset": True}
        stats = (await client.get("/_admin/stats")).json()
        again = await client.post(
            "/v1/tickets", json=ticket_body(), headers={"Idempotency-Key": "k"}
        )
        stale = await client.get(f"/v1/tickets/{old_id}")
    assert first.status_code == 500
    assert stats["tickets"] == 0
    assert set(stats["requests"].values()) == {0}
    # The configured script runs again, and the key is new again.
    assert again.status_code == 500
    assert stale.status_code == 404


async def test_set_and_get_faults(make_app: AppFactory) -> None:
    app = make_app()
    async with open_client(app, "asgi") as client:
        plan = {
            "rates": {"rate_limit": 0.25, "drop_after_commit": 0.1},
            "script": ["reject", "ok"],
            "latency_ms": {"min": 0, "max": 3},
            "seed": 7,
        }
        set_reply = await client.post("/_admin/faults", json=plan)
        assert set_reply.status_code == 200
        await client.post("/v1/tickets", json=ticket_body())
        current = (await client.get("/_admin/faults")).json()
    assert current["rates"] == {"rate_limit": 0.25, "drop_after_commit": 0.1}
    assert current["script"] == ["ok"]  # "reject" was used by the POST
    assert current["latency_ms"] == {"min": 0, "max": 3}
    assert current["seed"] == 7
    assert current["decisions"] == 1
    assert current["counts"]["reject"] == 1


@pytest.mark.parametrize(
    "plan",
    [
        {"rates": {"explode": 0.5}},
        {"rates": {"ok": 0.5}},
        {"rates": {"reject": 0.7, "rate_limit": 0.7}},
        {"rates": {"reject": -0.1}},
        {"script": ["ok", "nope"]},
        {"script": "ok"},
        {"latency_ms": {"min": 5, "max": 1}},
        {"seed": "seven"},
        {"rate": {"reject": 0.5}},
        [],
    ],
)
async def test_bad_fault_plans_are_refused_and_change_nothing(
    make_app: AppFactory, plan: object
) -> None:
    app = make_app(faults=FaultSpec(script=(Outcome.REJECT,)))
    async with open_client(app, "asgi") as client:
        before = (await client.get("/_admin/faults")).json()
        reply = await client.post("/_admin/faults", json=plan)
        after = (await client.get("/_admin/faults")).json()
    assert reply.status_code == 400
    assert reply.json()["error"]["message"]
    assert after == before


async def test_admin_and_reads_are_never_faulted(make_app: AppFactory) -> None:
    app = make_app(faults=FaultSpec(rates={Outcome.UNAVAILABLE: 1.0}))
    async with open_client(app, "asgi") as client:
        for path in ["/_admin/health", "/_admin/stats", "/_admin/effects", "/_admin/faults"]:
            assert (await client.get(path)).status_code == 200
        assert (
            await client.get("/v1/tickets", params={"client_reference": "x"})
        ).status_code == 200
        assert (await client.post("/v1/tickets", json=ticket_body())).status_code == 503
        assert (await client.get("/_admin/stats")).json()["requests"]["unavailable"] == 1


async def test_health_describes_the_provider(make_app: AppFactory) -> None:
    app = make_app(mode=Mode.IGNORE, lookup_enabled=False)
    async with open_client(app, "asgi") as client:
        health = (await client.get("/_admin/health")).json()
    assert health == {
        "status": "ok",
        "mode": "ignore",
        "lookup_enabled": False,
        "lookup_lag_ms": 0,
        "drop_mode": "abort",
        "durable": False,
    }
