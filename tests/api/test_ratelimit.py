"""Per-tenant rate limits: 429 with Retry-After and RateLimit headers, per tenant, changeable.

Limits here are per hour, so a test never depends on how fast the machine
sends its few requests; the gate's trust window runs on an injected clock.
"""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI

from outbox import cli
from outbox.api import create_app
from outbox.service import Outbox
from tests.api.conftest import Http, Tokens, asgi_http, assert_problem, written

POLICY = re.compile(r'^"tenant";q=(\d+);w=(\d+)$')
REMAINING = re.compile(r'^"tenant";r=(\d+);t=(\d+)$')


class Ticks:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ticks(app: FastAPI) -> Ticks:
    ticks = Ticks()
    app.state.rate_limiter.monotonic = ticks
    return ticks


def _read(http: Http, token: str, tokens: Tokens):
    return http.get("/v1/tasks/999", headers=tokens.auth(token))


def test_over_its_limit_a_tenant_gets_429_with_retry_after_and_ratelimit_headers(
    box: Outbox, tokens: Tokens, http: Http
):
    box.update_tenant("acme", rate_limit="3/hour")
    for remaining in (2, 1, 0):
        answer = _read(http, tokens.acme, tokens)
        assert answer.status_code == 404  # counted, and answered as usual
        policy = POLICY.match(answer.headers["RateLimit-Policy"])
        assert policy and policy.groups() == ("3", "3600")
        left = REMAINING.match(answer.headers["RateLimit"])
        assert left and int(left.group(1)) == remaining
    before = written(box)
    refused = http.post(
        "/v1/tasks",
        headers=tokens.auth(tokens.acme, "op-limited"),
        json={"subject": "over the limit"},
    )
    doc = assert_problem(refused, 429, "too-many-requests", "same_key")
    assert "3/hour" in doc["detail"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 3600
    assert POLICY.match(refused.headers["RateLimit-Policy"])
    left = REMAINING.match(refused.headers["RateLimit"])
    assert left and left.group(1) == "0" and int(left.group(2)) >= 1
    assert written(box) == before  # nothing was stored


def test_one_tenant_over_its_limit_does_not_limit_another(box: Outbox, tokens: Tokens, asgi: Http):
    box.update_tenant("acme", rate_limit="1/hour")
    assert _read(asgi, tokens.acme, tokens).status_code == 404
    assert _read(asgi, tokens.acme, tokens).status_code == 429
    for _ in range(5):
        assert _read(asgi, tokens.globex, tokens).status_code == 404


def test_the_default_limit_comes_from_settings(db_url: str, make_settings, clock):
    with Outbox(db_url, config=make_settings(rate_limit="2/hour"), clock=clock) as box:
        box.create_tenant("acme")
        token = box.create_token("acme", "agent")
        with asgi_http(create_app(box)) as http:
            answers = [
                http.get("/v1/tasks/1", headers={"Authorization": f"Bearer {token}"})
                for _ in range(3)
            ]
    assert [a.status_code for a in answers] == [404, 404, 429]
    assert answers[2].headers["RateLimit-Policy"] == '"tenant";q=2;w=3600'


def test_a_changed_limit_applies_within_the_gate_trust_window(
    box: Outbox, tokens: Tokens, asgi: Http, app: FastAPI, ticks: Ticks
):
    box.update_tenant("acme", rate_limit="1/hour")
    assert _read(asgi, tokens.acme, tokens).status_code == 404
    assert _read(asgi, tokens.acme, tokens).status_code == 429  # refused by the gate
    box.update_tenant("acme", rate_limit="none")
    ticks.now += app.state.rate_limiter.trust_seconds  # the gate looks again
    answers = [_read(asgi, tokens.acme, tokens).status_code for _ in range(5)]
    assert answers == [404] * 5
    assert "RateLimit" not in _read(asgi, tokens.acme, tokens).headers  # no limit, no headers


def test_a_revoked_token_over_the_limit_is_unauthenticated_after_the_trust_window(
    box: Outbox, tokens: Tokens, asgi: Http, app: FastAPI, ticks: Ticks
):
    box.update_tenant("acme", rate_limit="1/hour")
    token = box.create_token("acme", "agent", "soon revoked")
    assert _read(asgi, token, tokens).status_code == 404
    assert _read(asgi, token, tokens).status_code == 429
    box.revoke_token(token)
    ticks.now += app.state.rate_limiter.trust_seconds
    assert_problem(_read(asgi, token, tokens), 401, "unauthenticated")


def test_unknown_tokens_spend_no_tenant_quota(box: Outbox, tokens: Tokens, asgi: Http):
    box.update_tenant("acme", rate_limit="2/hour")
    for _ in range(5):
        assert_problem(_read(asgi, "obx_not_a_token", tokens), 401)
    assert _read(asgi, tokens.acme, tokens).status_code == 404


def test_invalid_limits_are_refused(box: Outbox, tokens: Tokens):
    from outbox import errors

    for bad in ("fast", "0/second", "10/second;100/minute", ""):
        with pytest.raises(errors.InvalidArguments):
            box.update_tenant("acme", rate_limit=bad)
    with pytest.raises(errors.UnknownTenant):
        box.update_tenant("nobody", rate_limit="1/second")


def test_cli_sets_and_updates_a_tenant_limit(sqlite_url: str, capsys):
    url = ["--database-url", sqlite_url]
    assert cli.main([*url, "db", "upgrade"]) == 0
    assert cli.main([*url, "tenants", "create", "acme", "--rate-limit", "10/second"]) == 0
    with Outbox(sqlite_url) as box:
        assert box.get_tenant("acme")["rate_limit"] == "10/second"
    assert cli.main([*url, "tenants", "update", "acme", "--rate-limit", "5/minute"]) == 0
    assert '"rate_limit": "5/minute"' in capsys.readouterr().out
    assert cli.main([*url, "tenants", "update", "acme", "--rate-limit", "default"]) == 0
    with Outbox(sqlite_url) as box:
        tenant = box.get_tenant("acme")
    assert tenant["rate_limit"] is None
    assert tenant["effective_rate_limit"] == box.settings.rate_limit
    assert cli.main([*url, "tenants", "update", "acme", "--rate-limit", "lots"]) == 2
