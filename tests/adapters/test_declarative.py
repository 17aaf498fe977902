"""Declarative adapters: templates, form bodies, auth, secrets, lookup rules, overrides, limits.

Everything here is configured the way a user writes it (a TOML table through
``build_adapter`` or ``load_registry``) and checked on the wire with respx.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest
import respx

from adapters import (
    ConfigError,
    DeliveryRequest,
    HttpAdapter,
    LookupStatus,
    Outcome,
    PayloadError,
    build_adapter,
    load_registry,
)
from adapters import templates as tpl
from adapters.auth import OAuth2ClientCredentials

KEY = "ek_0123456789abcdef"
URL = "https://provider.test/v1/things"


@pytest.fixture
def router() -> Iterator[respx.Router]:
    yield respx.Router(assert_all_called=False)


def make(router: respx.Router, env: dict[str, str] | None = None, **table: Any) -> HttpAdapter:
    table = {"kind": "http", "url": URL, "honours_idempotency_keys": True, **table}
    adapter = build_adapter(
        "crm", table, env=env or {}, transport=httpx.MockTransport(router.handler)
    )
    assert isinstance(adapter, HttpAdapter)
    return adapter


def req(payload: dict[str, Any], key: str = KEY) -> DeliveryRequest:
    return DeliveryRequest(7, key, "acme", "op-7", "open_thing", payload, 1)


# --- templates -------------------------------------------------------------------------


def test_whole_value_substitution_keeps_types_and_text_interpolates() -> None:
    values = {"payload": {"n": 3, "tags": ["a"], "ok": True, "name": "Ada"}, "effect_key": "k"}
    assert tpl.compile_text("{{ payload.n }}").render(values) == 3
    assert tpl.compile_text("{{ payload.tags }}").render(values) == ["a"]
    assert tpl.compile_text("{{payload.ok}}").render(values) is True
    assert (
        tpl.compile_text("Hi {{ payload.name }} ({{ payload.n }})").render(values) == "Hi Ada (3)"
    )
    assert tpl.compile_text('{{ payload.missing | default("x") }}').render(values) == "x"
    assert tpl.compile_text("{{ payload.n | string }}").render(values) == "3"
    assert tpl.compile_text("{{ payload.tags | json }}").render(values) == '["a"]'
    assert tpl.compile_text("{{ effect_key }}").render(values) == "k"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ }}", "empty"),
        ("{{ os.system }}", "must start with one of"),
        ("{{ payload.__class__ }}", "must start with one of")
        if False
        else ("{{ payload.a b }}", "field name"),
        ("{{ payload.a | upper }}", "unknown filter"),
        ("{{ payload.a | default(nope) }}", "JSON literal"),
        ("{{ payload.a", "unbalanced"),
    ],
)
def test_bad_templates_are_refused(source: str, message: str) -> None:
    with pytest.raises(tpl.TemplateError, match=message):
        tpl.compile_text(source)


def test_a_template_naming_a_missing_field_is_a_start_up_error(router: respx.Router) -> None:
    with pytest.raises(ConfigError) as info:
        make(
            router,
            body={"title": "{{ payload.subject }}", "note": "{{ payload.nope }}"},
            sample_payload={"subject": "x"},
        )
    text = str(info.value)
    assert "crm.body.note" in text and "payload.nope" in text and "sample_payload" in text
    assert "\n" not in text


def test_a_missing_field_at_send_time_is_a_payload_error_before_sending(
    router: respx.Router,
) -> None:
    route = router.post(URL).respond(200, json={"id": "1"})
    adapter = make(router, body={"title": "{{ payload.subject }}"})
    with pytest.raises(PayloadError, match=r"body\.title.*payload\.subject"):
        adapter.deliver(req({"other": 1}))
    assert not route.called


def test_json_body_template_with_the_key_and_url_template(router: respx.Router) -> None:
    route = router.post("https://provider.test/v1/accounts/a%2Fb/things").respond(
        201, json={"data": {"id": "t-1"}}
    )
    adapter = make(
        router,
        url="https://provider.test/v1/accounts/{{ payload.account }}/things",
        body={
            "title": "{{ payload.subject }}",
            "amount": "{{ payload.amount }}",
            "meta": {"ref": "{{ effect_key }}"},
        },
        client_reference_field="meta.ref",
        reference_field="data.id",
    )
    result = adapter.deliver(req({"subject": "Hi", "amount": 12.5, "account": "a/b"}))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "t-1")
    body = json.loads(route.calls.last.request.content)
    assert body == {"title": "Hi", "amount": 12.5, "meta": {"ref": KEY}}


# --- form + basic auth (the documented shape of a Twilio-style API) ----------------------


def test_form_encoded_basic_auth_adapter_delivers_exact_body_and_headers(
    router: respx.Router,
) -> None:
    route = router.post(URL).respond(201, json={"sid": "SM1"})
    adapter = make(
        router,
        env={"USER": "AC123", "PASS": "s3cr3t-pass"},
        auth={"type": "basic", "username": "${USER}", "password": "${PASS}"},
        body_format="form",
        body={
            "To": "{{ payload.to }}",
            "Body": "{{ payload.text }}",
            "Tags": ["a", "b"],
            "Meta": {"k": "{{ effect_key }}"},
        },
        client_reference_field=False,
        idempotency_header="I-Twilio-Idempotency-Token",
        reference_field="sid",
    )
    result = adapter.deliver(req({"to": "+15558675310", "text": "héllo & bye"}))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "SM1")
    sent = route.calls.last.request
    assert (
        sent.headers["Authorization"] == "Basic " + base64.b64encode(b"AC123:s3cr3t-pass").decode()
    )
    assert sent.headers["Content-Type"] == "application/x-www-form-urlencoded"
    assert sent.headers["I-Twilio-Idempotency-Token"] == KEY
    assert parse_qsl(sent.content.decode()) == [
        ("To", "+15558675310"),
        ("Body", "héllo & bye"),
        ("Tags[0]", "a"),
        ("Tags[1]", "b"),
        ("Meta[k]", KEY),
    ]
    # Every attempt sends the same bytes.
    adapter.deliver(req({"to": "+15558675310", "text": "héllo & bye"}))
    assert route.calls[0].request.content == route.calls[1].request.content


# --- OAuth2 client credentials ---------------------------------------------------------

TOKEN_URL = "https://auth.provider.test/oauth/token"


def test_oauth2_token_is_fetched_once_reused_and_refreshed_after_expiry(
    router: respx.Router,
) -> None:
    tokens = iter(["tok-one-aaaa", "tok-two-bbbb"])

    def issue(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={"access_token": next(tokens), "token_type": "Bearer", "expires_in": 3600},
        )

    token_route = router.post(TOKEN_URL).mock(side_effect=issue)
    api = router.post(URL).respond(201, json={"id": "r"})
    adapter = make(
        router,
        env={"CID": "client-1", "CSECRET": "client-secret-xyz"},
        auth={
            "type": "oauth2_client_credentials",
            "token_url": TOKEN_URL,
            "client_id": "${CID}",
            "client_secret": "${CSECRET}",
            "scope": "things:write",
        },
    )
    oauth = adapter.auth
    assert isinstance(oauth, OAuth2ClientCredentials)
    clock = [1000.0]
    oauth.clock = lambda: clock[0]

    for _ in range(3):
        assert adapter.deliver(req({"a": 1})).outcome is Outcome.DELIVERED
    assert token_route.call_count == 1
    assert [c.request.headers["Authorization"] for c in api.calls] == ["Bearer tok-one-aaaa"] * 3
    token_request = token_route.calls[0].request
    assert token_request.headers["Authorization"] == (
        "Basic " + base64.b64encode(b"client-1:client-secret-xyz").decode()
    )
    assert dict(parse_qsl(token_request.content.decode())) == {
        "grant_type": "client_credentials",
        "scope": "things:write",
    }

    clock[0] += 3600 - 31  # still inside expires_in minus the refresh leeway
    adapter.deliver(req({"a": 1}))
    assert token_route.call_count == 1
    clock[0] += 2  # within the leeway of expiry: a new token
    adapter.deliver(req({"a": 1}))
    assert token_route.call_count == 2
    assert api.calls.last.request.headers["Authorization"] == "Bearer tok-two-bbbb"


def test_oauth2_token_is_shared_by_threads_and_fetched_once(router: respx.Router) -> None:
    gate = threading.Event()

    def issue(request: httpx.Request) -> httpx.Response:
        gate.wait(5)
        return httpx.Response(200, json={"access_token": "tok-shared", "expires_in": 60})

    token_route = router.post(TOKEN_URL).mock(side_effect=issue)
    router.post(URL).respond(201, json={"id": "r"})
    adapter = make(
        router,
        env={"CS": "secret-value-1"},
        auth={
            "type": "oauth2_client_credentials",
            "token_url": TOKEN_URL,
            "client_id": "c",
            "client_secret": "${CS}",
            "client_auth": "body",
        },
    )
    results: list[Outcome] = []
    threads = [
        threading.Thread(target=lambda: results.append(adapter.deliver(req({})).outcome))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert results == [Outcome.DELIVERED] * 4
    assert token_route.call_count == 1
    form = dict(parse_qsl(token_route.calls[0].request.content.decode()))
    assert form["client_secret"] == "secret-value-1"  # client_secret_post


def test_oauth2_token_failure_is_not_sent_and_a_401_drops_the_token(router: respx.Router) -> None:
    token_route = router.post(TOKEN_URL).mock(
        side_effect=[
            httpx.Response(400, json={"error": "invalid_client"}),
            httpx.Response(200, json={"access_token": "tok-a-1111", "expires_in": 3600}),
            httpx.Response(200, json={"access_token": "tok-b-2222", "expires_in": 3600}),
        ]
    )
    api = router.post(URL).mock(
        side_effect=[httpx.Response(401, json={}), httpx.Response(201, json={"id": "r"})]
    )
    adapter = make(
        router,
        env={"CS": "secret-value-2"},
        auth={
            "type": "oauth2_client_credentials",
            "token_url": TOKEN_URL,
            "client_id": "c",
            "client_secret": "${CS}",
        },
    )
    first = adapter.deliver(req({}))
    assert first.outcome is Outcome.NOT_SENT and not api.called
    assert "secret-value-2" not in (first.error or "")
    assert adapter.deliver(req({})).status_code == 401
    assert adapter.deliver(req({})).outcome is Outcome.DELIVERED
    assert api.calls.last.request.headers["Authorization"] == "Bearer tok-b-2222"
    assert token_route.call_count == 3


# --- api key, bearer, secrets -----------------------------------------------------------


def test_api_key_in_query_and_header(router: respx.Router) -> None:
    route = router.post(URL).respond(201, json={"id": "1"})
    in_query = make(
        router,
        env={"K": "query-key-123"},
        auth={"type": "api_key", "name": "api_key", "value": "${K}", "in": "query"},
    )
    in_query.deliver(req({}))
    assert route.calls.last.request.url.params["api_key"] == "query-key-123"
    in_header = make(
        router,
        env={"K": "header-key-123"},
        auth={"type": "api_key", "name": "X-Api-Key", "value": "${K}"},
    )
    in_header.deliver(req({}))
    assert route.calls.last.request.headers["X-Api-Key"] == "header-key-123"
    assert "query-key-123" not in in_query.prepare(req({})).render()


def test_secret_from_a_file(router: respx.Router, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("file-token-value\n", encoding="utf-8")
    route = router.post(URL).respond(201, json={"id": "1"})
    path = tmp_path / "adapters.toml"
    path.write_text(
        f"""
[adapters.crm]
kind = "http"
url = "{URL}"
honours_idempotency_keys = true
auth = {{ type = "bearer", token = "file:token" }}
headers = {{ "X-Extra" = "${{EXTRA}}" }}
""",
        encoding="utf-8",
    )
    with load_registry(
        path, env={"EXTRA": "extra-secret"}, transport=httpx.MockTransport(router.handler)
    ) as reg:
        adapter = reg.get("crm")
        adapter.deliver(req({}))
        assert route.calls.last.request.headers["Authorization"] == "Bearer file-token-value"
        assert route.calls.last.request.headers["X-Extra"] == "extra-secret"
        assert isinstance(adapter, HttpAdapter)
        shown = adapter.prepare(req({})).render() + repr(adapter) + repr(adapter.config)
        assert "file-token-value" not in shown and "extra-secret" not in shown


@pytest.mark.parametrize(
    ("table", "env", "names"),
    [
        ({"auth": {"type": "bearer", "token": "${MISSING}"}}, {}, ["crm.auth.token", "${MISSING}"]),
        (
            {"auth": {"type": "bearer", "token": "file:/nonexistent/tok"}},
            {},
            ["crm.auth.token", "/nonexistent/tok"],
        ),
        ({"auth": {"type": "basic", "username": "u"}}, {}, ["crm.auth.password", "missing"]),
        (
            {
                "auth": {
                    "type": "oauth2_client_credentials",
                    "token_url": TOKEN_URL,
                    "client_id": "c",
                }
            },
            {},
            ["crm.auth.client_secret"],
        ),
        ({"auth": {"type": "bearr", "token": "x"}}, {}, ["crm.auth.type", "did you mean 'bearer'"]),
        ({"auth": {"type": "bearer", "tokn": "x"}}, {}, ["crm.auth.tokn", "did you mean 'token'"]),
        (
            {"idempotency_headr": "X"},
            {},
            ["crm.idempotency_headr", "did you mean 'idempotency_header'"],
        ),
        ({"body_format": "xml"}, {}, ["crm.body_format", "json, form"]),
        (
            {"classify": [{"status": 409, "outcome": "retry"}]},
            {},
            ["crm.classify[0].outcome", "did you mean 'retryable'"],
        ),
        ({"classify": [{"outcome": "permanent"}]}, {}, ["crm.classify[0]", "matches every reply"]),
        ({"rate_limit": "lots"}, {}, ["crm.rate_limit", "25/second"]),
        ({"key_retention": "soon"}, {}, ["crm.key_retention", "24h"]),
        ({"preset": "strip"}, {}, ["crm.preset", "did you mean 'stripe'"]),
        ({"body": {"a": "{{ vars.nope }}"}}, {}, ["crm.body", "vars.nope"]),
        ({"lookup_url": URL + "?q={{ payload.x }}"}, {}, ["crm.lookup_url", "a lookup knows only"]),
    ],
)
def test_each_mistake_is_one_line_naming_the_adapter_and_the_key(
    router: respx.Router, table: dict[str, Any], env: dict[str, str], names: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        make(router, env=env, **table)
    text = str(info.value)
    assert "\n" not in text
    for name in names:
        assert name in text, text


def test_a_secret_value_never_appears_in_a_config_error(router: respx.Router) -> None:
    with pytest.raises(ConfigError) as info:
        make(
            router,
            env={"T": "tok-never-shown"},
            auth={"type": "bearer", "token": "${T}", "extra": "1"},
        )
    assert "tok-never-shown" not in str(info.value)


# --- classification overrides -----------------------------------------------------------


def test_overrides_are_tried_in_order_before_the_table(router: respx.Router) -> None:
    router.post(URL).mock(
        side_effect=[
            httpx.Response(
                200, json={"ok": False, "error": "ratelimited"}, headers={"Retry-After": "7"}
            ),
            httpx.Response(200, json={"ok": False, "error": "bad_channel"}),
            httpx.Response(200, json={"ok": True, "id": "m1"}),
            httpx.Response(409, json={"code": "idempotency_key_in_use"}),
            httpx.Response(409, json={"code": "other"}),
        ]
    )
    adapter = make(
        router,
        classify=[
            {"status": 200, "match": {"ok": False, "error": "ratelimited"}, "outcome": "retryable"},
            {"status": 200, "match": {"ok": False}, "outcome": "permanent", "why": "ok is false"},
            {"status": 409, "match": {"code": "idempotency_key_in_use"}, "outcome": "retryable"},
            {"status": "4xx", "body_contains": "other", "outcome": "permanent"},
        ],
    )
    limited = adapter.deliver(req({}))
    assert (limited.outcome, limited.retry_after) == (Outcome.RETRYABLE, 7.0)
    refused = adapter.deliver(req({}))
    assert refused.outcome is Outcome.PERMANENT and "ok is false" in (refused.error or "")
    assert adapter.deliver(req({})).provider_ref == "m1"
    in_use = adapter.deliver(req({}))
    assert in_use.outcome is Outcome.RETRYABLE and in_use.may_have_happened
    assert adapter.deliver(req({})).outcome is Outcome.PERMANENT


# --- lookups --------------------------------------------------------------------------------


def test_lookup_by_client_reference_with_a_match_rule(router: respx.Router) -> None:
    route = router.get("https://provider.test/v1/search").mock(
        side_effect=[
            httpx.Response(
                200,
                json={
                    "result": {
                        "hits": [
                            {"id": "x", "meta": {"ref": "other"}},
                            {"id": "y", "meta": {"ref": KEY}},
                        ]
                    }
                },
            ),
            httpx.Response(
                200,
                json={
                    "result": {
                        "hits": [
                            {"id": "y", "meta": {"ref": KEY}},
                            {"id": "z", "meta": {"ref": KEY}},
                        ]
                    }
                },
            ),
        ]
    )
    adapter = make(
        router,
        lookup_by="client_reference",
        lookup_url="https://provider.test/v1/search",
        lookup_params={"q": "ref:{{ effect_key }}"},
        lookup_list_field="result.hits",
        lookup_match={"meta.ref": "{{ effect_key }}"},
    )
    hit = adapter.lookup(KEY, None)
    assert (hit.status, hit.provider_ref) == (LookupStatus.FOUND, "y")
    assert route.calls[0].request.url.params["q"] == f"ref:{KEY}"
    two = adapter.lookup(KEY, None)
    assert two.status is LookupStatus.INCONCLUSIVE and "2 items" in (two.error or "")


def test_lookup_by_reference_treats_404_as_not_found(router: respx.Router) -> None:
    router.get("https://provider.test/v1/things/r-1").respond(200, json={"id": "r-1"})
    router.get("https://provider.test/v1/things/r-2").respond(404, json={})
    adapter = make(
        router,
        lookup_by="reference",
        lookup_url="https://provider.test/v1/things/{{ reference }}",
        lookup_list_field=False,
    )
    assert adapter.lookup(KEY, "r-1").provider_ref == "r-1"
    assert adapter.lookup(KEY, "r-2").status is LookupStatus.NOT_FOUND
    with pytest.raises(ConfigError, match="lookup_by"):
        make(router, lookup_by="key", lookup_url="https://provider.test/v1/things/{{ reference }}")


# --- rate limit --------------------------------------------------------------------------


def test_rate_limit_is_shared_by_every_thread(router: respx.Router) -> None:
    route = router.post(URL).respond(201, json={"id": "1"})
    adapter = make(router, rate_limit="3/hour", rate_limit_wait=0)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def send() -> None:
        outcome = adapter.deliver(req({})).outcome
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=send) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == sorted([Outcome.DELIVERED] * 3 + [Outcome.NOT_SENT] * 2)
    assert route.call_count == 3
    refused = adapter.deliver(req({}))
    assert "rate limit 3/hour" in (refused.error or "")


# --- key retention -----------------------------------------------------------------------


def test_key_retention_is_a_capability(router: respx.Router) -> None:
    assert make(router, key_retention="24h").capabilities.key_retention_seconds == 86400
    assert make(router, key_retention=90).capabilities.key_retention_seconds == 90
    assert make(router).capabilities.key_retention_seconds is None


def test_preset_keys_are_overridable(router: respx.Router) -> None:
    adapter = build_adapter(
        "payments",
        {
            "preset": "stripe",
            "url": "https://stripe-proxy.internal/v1/payment_intents",
            "key_retention": "12h",
            "auth": {"type": "bearer", "token": "${MY_STRIPE}"},
        },
        env={"MY_STRIPE": "sk_live_override"},
        transport=httpx.MockTransport(router.handler),
    )
    assert isinstance(adapter, HttpAdapter)
    assert adapter.config.url.startswith("https://stripe-proxy.internal")
    assert adapter.capabilities.key_retention_seconds == 12 * 3600
    assert adapter.config.body_format == "form"


def test_a_body_template_sends_exactly_the_template(router: respx.Router) -> None:
    route = router.post(URL).respond(201, json={"id": "1"})
    adapter = make(router, body={"title": "{{ payload.subject }}"})
    adapter.deliver(req({"subject": "Hi", "secret_note": "internal"}))
    assert json.loads(route.calls.last.request.content) == {"title": "Hi"}
