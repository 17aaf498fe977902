"""Each preset against its provider's documented request and reply shapes (respx).

For every preset: the request it sends (method, URL, the headers the provider
documents, the exact body), and how it reads a success, a rate limit with
Retry-After, a validation error, a duplicate or in-progress answer, and a
lookup hit and miss. The reply bodies follow the provider's reference pages
(named in ``adapters.presets``), trimmed to the fields that matter.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest
import respx

import adapters
from adapters import DeliveryRequest, HttpAdapter, LookupStatus, Outcome, build_adapter
from tests.adapters.support import FIXED_NOW

KEY = "ek_8f14e45fceea167a5a36dedd4bea2543"
ENV = {
    "STRIPE_API_KEY": "sk_test_51stripe_secret_value",
    "GITHUB_TOKEN": "ghp_github_secret_value",
    "SLACK_BOT_TOKEN": "xoxb-slack-secret-value",
    "SENDGRID_API_KEY": "SG.sendgrid_secret_value",
    "ZENDESK_EMAIL": "agent@acme.test",
    "ZENDESK_API_TOKEN": "zendesk_secret_value",
    "TWILIO_ACCOUNT_SID": "AC0123456789abcdef0123456789abcdef",
    "TWILIO_AUTH_TOKEN": "twilio_secret_value",
}
VARS: dict[str, dict[str, Any]] = {
    "github": {"repository": "octocat/Hello-World"},
    "slack": {"channel": "C123ABC456"},
    "sendgrid": {"from_email": "billing@acme.test"},
    "zendesk": {"subdomain": "acme"},
    "twilio": {"from_number": "+15005550006"},
}


@pytest.fixture
def router() -> Iterator[respx.Router]:
    yield respx.Router(assert_all_called=False)


def preset_adapter(name: str, router: respx.Router) -> HttpAdapter:
    table: dict[str, Any] = {"preset": name}
    if name in VARS:
        table["vars"] = VARS[name]
    adapter = build_adapter(name, table, env=ENV, transport=httpx.MockTransport(router.handler))
    assert isinstance(adapter, HttpAdapter)
    object.__setattr__(adapter, "_now", lambda: FIXED_NOW)
    return adapter


def request(payload: dict[str, Any]) -> DeliveryRequest:
    return DeliveryRequest(1, KEY, "acme", "op-1", "effect", payload, 1)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_the_six_presets_are_listed() -> None:
    assert set(adapters.PRESETS) == {"stripe", "github", "slack", "sendgrid", "zendesk", "twilio"}
    for preset in adapters.PRESETS.values():
        assert preset.docs and all(url.startswith("https://") for url in preset.docs)


# --- Stripe --------------------------------------------------------------------

STRIPE_URL = "https://api.stripe.com/v1/payment_intents"
STRIPE_SEARCH = "https://api.stripe.com/v1/payment_intents/search"
PAYMENT_INTENT = {
    "id": "pi_3MtwBwLkdIwHu7ix28a3tqPa",
    "object": "payment_intent",
    "amount": 2000,
    "currency": "usd",
    "metadata": {"outbox_key": KEY},
    "status": "requires_payment_method",
}


def test_stripe_success_is_form_encoded_with_the_idempotency_key(router: respx.Router) -> None:
    route = router.post(STRIPE_URL).respond(200, json=PAYMENT_INTENT)
    adapter = preset_adapter("stripe", router)
    result = adapter.deliver(request({"amount": 2000, "currency": "usd"}))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, PAYMENT_INTENT["id"])
    sent = route.calls.last.request
    assert sent.headers["Content-Type"] == "application/x-www-form-urlencoded"
    assert sent.headers["Authorization"] == f"Bearer {ENV['STRIPE_API_KEY']}"
    assert sent.headers["Idempotency-Key"] == KEY
    assert sent.content == f"amount=2000&currency=usd&metadata%5Boutbox_key%5D={KEY}".encode()
    assert adapter.capabilities.honours_idempotency_keys
    assert adapter.capabilities.key_retention_seconds == 24 * 3600


def test_stripe_rate_limit_honours_retry_after(router: respx.Router) -> None:
    router.post(STRIPE_URL).respond(
        429,
        headers={"Retry-After": "2"},
        json={"error": {"type": "invalid_request_error", "code": "rate_limit"}},
    )
    result = preset_adapter("stripe", router).deliver(request({"amount": 1, "currency": "usd"}))
    assert (result.outcome, result.retry_after) == (Outcome.RETRYABLE, 2.0)
    assert not result.may_have_happened


def test_stripe_validation_error_and_decline_are_permanent(router: respx.Router) -> None:
    router.post(STRIPE_URL).mock(
        side_effect=[
            httpx.Response(
                400,
                json={
                    "error": {
                        "code": "parameter_missing",
                        "message": "Missing required param: currency.",
                        "param": "currency",
                        "type": "invalid_request_error",
                    }
                },
            ),
            httpx.Response(402, json={"error": {"code": "card_declined", "type": "card_error"}}),
        ]
    )
    adapter = preset_adapter("stripe", router)
    assert adapter.deliver(request({"amount": 1, "currency": "usd"})).outcome is Outcome.PERMANENT
    assert adapter.deliver(request({"amount": 1, "currency": "usd"})).outcome is Outcome.PERMANENT


def test_stripe_key_in_use_is_retryable_and_may_have_happened(router: respx.Router) -> None:
    router.post(STRIPE_URL).respond(
        409,
        json={
            "error": {
                "code": "idempotency_key_in_use",
                "message": "There is currently another in-progress request using this "
                "Idempotent Key (that probably means you submitted twice).",
                "type": "invalid_request_error",
            }
        },
    )
    result = preset_adapter("stripe", router).deliver(request({"amount": 1, "currency": "usd"}))
    assert result.outcome is Outcome.RETRYABLE
    assert result.may_have_happened


def test_stripe_key_reused_with_other_parameters_is_ambiguous(router: respx.Router) -> None:
    router.post(STRIPE_URL).respond(
        400,
        json={
            "error": {
                "message": "Keys for idempotent requests can only be used with the same "
                "parameters they were first used with.",
                "type": "idempotency_error",
            }
        },
    )
    result = preset_adapter("stripe", router).deliver(request({"amount": 1, "currency": "usd"}))
    assert result.outcome is Outcome.AMBIGUOUS


def test_stripe_lookup_searches_metadata(router: respx.Router) -> None:
    route = router.get(STRIPE_SEARCH).mock(
        side_effect=[
            httpx.Response(
                200,
                json={
                    "object": "search_result",
                    "url": "/v1/payment_intents/search",
                    "has_more": False,
                    "data": [PAYMENT_INTENT],
                },
            ),
            httpx.Response(
                200,
                json={"object": "search_result", "has_more": False, "data": []},
            ),
        ]
    )
    adapter = preset_adapter("stripe", router)
    hit = adapter.lookup(KEY, None)
    assert (hit.status, hit.provider_ref) == (LookupStatus.FOUND, PAYMENT_INTENT["id"])
    sent = route.calls[0].request
    assert sent.url.params["query"] == f"metadata['outbox_key']:'{KEY}'"
    assert sent.headers["Authorization"] == f"Bearer {ENV['STRIPE_API_KEY']}"
    assert adapter.lookup(KEY, None).status is LookupStatus.NOT_FOUND


def test_stripe_lookup_ignores_items_for_other_keys(router: respx.Router) -> None:
    other = {**PAYMENT_INTENT, "id": "pi_other", "metadata": {"outbox_key": "someone-else"}}
    router.get(STRIPE_SEARCH).respond(200, json={"object": "search_result", "data": [other]})
    assert preset_adapter("stripe", router).lookup(KEY, None).status is LookupStatus.NOT_FOUND


# --- GitHub --------------------------------------------------------------------

GITHUB_URL = "https://api.github.com/repos/octocat/Hello-World/issues"
GITHUB_SEARCH = "https://api.github.com/search/issues"
MARKER = f"<!-- outbox-key: {KEY} -->"
ISSUE = {
    "id": 1,
    "node_id": "MDU6SXNzdWUx",
    "url": "https://api.github.com/repos/octocat/Hello-World/issues/1347",
    "number": 1347,
    "state": "open",
    "title": "Found a bug",
    "body": f"I'm having a problem with this.\n\n{MARKER}",
}


def test_github_success_carries_the_marker_and_no_key_header(router: respx.Router) -> None:
    route = router.post(GITHUB_URL).respond(201, json=ISSUE)
    adapter = preset_adapter("github", router)
    result = adapter.deliver(
        request({"title": "Found a bug", "body": "I'm having a problem with this."})
    )
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "1347")
    sent = route.calls.last.request
    assert sent.headers["Accept"] == "application/vnd.github+json"
    assert sent.headers["X-GitHub-Api-Version"] == "2022-11-28"
    assert sent.headers["Authorization"] == f"Bearer {ENV['GITHUB_TOKEN']}"
    assert "Idempotency-Key" not in sent.headers
    assert json.loads(sent.content) == {
        "title": "Found a bug",
        "body": f"I'm having a problem with this.\n\n{MARKER}",
        "labels": [],
    }
    assert not adapter.capabilities.honours_idempotency_keys


def test_github_secondary_rate_limit_honours_retry_after(router: respx.Router) -> None:
    router.post(GITHUB_URL).respond(
        403,
        headers={"retry-after": "60"},
        json={
            "message": "You have exceeded a secondary rate limit and have been temporarily "
            "blocked from content creation. Please retry your request again later.",
            "documentation_url": "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api",
        },
    )
    result = preset_adapter("github", router).deliver(request({"title": "t"}))
    assert (result.outcome, result.retry_after) == (Outcome.RETRYABLE, 60.0)


def test_github_primary_rate_limit_is_retryable(router: respx.Router) -> None:
    router.post(GITHUB_URL).respond(
        403,
        headers={"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1700000000"},
        json={"message": "API rate limit exceeded for user ID 1."},
    )
    assert preset_adapter("github", router).deliver(request({"title": "t"})).outcome is (
        Outcome.RETRYABLE
    )


def test_github_validation_failed_is_permanent(router: respx.Router) -> None:
    router.post(GITHUB_URL).respond(
        422,
        json={
            "message": "Validation Failed",
            "errors": [{"resource": "Issue", "code": "missing_field", "field": "title"}],
            "documentation_url": "https://docs.github.com/rest/issues/issues#create-an-issue",
        },
    )
    assert preset_adapter("github", router).deliver(request({"title": ""})).outcome is (
        Outcome.PERMANENT
    )


def test_github_server_error_is_ambiguous_with_no_key_to_resend(router: respx.Router) -> None:
    router.post(GITHUB_URL).respond(502, text="Server Error")
    adapter = preset_adapter("github", router)
    assert adapter.deliver(request({"title": "t"})).outcome is Outcome.AMBIGUOUS
    assert not adapter.capabilities.honours_idempotency_keys  # so: lookup, never a resend


def test_github_lookup_finds_the_marker(router: respx.Router) -> None:
    fuzzy = {**ISSUE, "number": 9, "body": "mentions outbox-key somewhere else"}
    route = router.get(GITHUB_SEARCH).mock(
        side_effect=[
            httpx.Response(
                200, json={"total_count": 2, "incomplete_results": False, "items": [fuzzy, ISSUE]}
            ),
            httpx.Response(
                200, json={"total_count": 1, "incomplete_results": False, "items": [fuzzy]}
            ),
            httpx.Response(200, json={"total_count": 0, "incomplete_results": True, "items": []}),
        ]
    )
    adapter = preset_adapter("github", router)
    hit = adapter.lookup(KEY, None)
    assert (hit.status, hit.provider_ref) == (LookupStatus.FOUND, "1347")
    assert route.calls[0].request.url.params["q"] == (
        f'repo:octocat/Hello-World is:issue in:body "outbox-key: {KEY}"'
    )
    assert adapter.lookup(KEY, None).status is LookupStatus.NOT_FOUND
    assert adapter.lookup(KEY, None).status is LookupStatus.INCONCLUSIVE  # incomplete_results


# --- Slack ----------------------------------------------------------------------

SLACK_URL = "https://slack.com/api/chat.postMessage"
SLACK_HISTORY = "https://slack.com/api/conversations.history"
POSTED = {
    "ok": True,
    "channel": "C123ABC456",
    "ts": "1503435956.000247",
    "message": {"text": "Deploy finished", "type": "message", "ts": "1503435956.000247"},
}


def test_slack_success_reads_ts(router: respx.Router) -> None:
    route = router.post(SLACK_URL).respond(200, json=POSTED)
    result = preset_adapter("slack", router).deliver(request({"text": "Deploy finished"}))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "1503435956.000247")
    sent = route.calls.last.request
    assert sent.headers["Content-Type"] == "application/json; charset=utf-8"
    assert sent.headers["Authorization"] == f"Bearer {ENV['SLACK_BOT_TOKEN']}"
    assert json.loads(sent.content) == {
        "channel": "C123ABC456",
        "text": "Deploy finished",
        "metadata": {"event_type": "outbox_effect", "event_payload": {"outbox_key": KEY}},
    }


def test_slack_ok_false_is_permanent_unless_rate_limited(router: respx.Router) -> None:
    router.post(SLACK_URL).mock(
        side_effect=[
            httpx.Response(200, json={"ok": False, "error": "channel_not_found"}),
            httpx.Response(200, json={"ok": False, "error": "ratelimited"}),
            httpx.Response(
                429, headers={"Retry-After": "30"}, json={"ok": False, "error": "ratelimited"}
            ),
            httpx.Response(200, json={"ok": False, "error": "fatal_error"}),
        ]
    )
    adapter = preset_adapter("slack", router)
    assert adapter.deliver(request({"text": "x"})).outcome is Outcome.PERMANENT
    assert adapter.deliver(request({"text": "x"})).outcome is Outcome.RETRYABLE
    limited = adapter.deliver(request({"text": "x"}))
    assert (limited.outcome, limited.retry_after) == (Outcome.RETRYABLE, 30.0)
    assert adapter.deliver(request({"text": "x"})).outcome is Outcome.AMBIGUOUS


def test_slack_lookup_matches_message_metadata(router: respx.Router) -> None:
    mine = {
        "type": "message",
        "ts": "1503435956.000247",
        "text": "Deploy finished",
        "metadata": {"event_type": "outbox_effect", "event_payload": {"outbox_key": KEY}},
    }
    other = {"type": "message", "ts": "1503435950.000001", "text": "hello"}
    route = router.get(SLACK_HISTORY).mock(
        side_effect=[
            httpx.Response(200, json={"ok": True, "messages": [other, mine], "has_more": False}),
            httpx.Response(200, json={"ok": True, "messages": [other], "has_more": False}),
            httpx.Response(200, json={"ok": True, "messages": [other], "has_more": True}),
        ]
    )
    adapter = preset_adapter("slack", router)
    hit = adapter.lookup(KEY, None)
    assert (hit.status, hit.provider_ref) == (LookupStatus.FOUND, "1503435956.000247")
    params = route.calls[0].request.url.params
    assert (params["channel"], params["include_all_metadata"]) == ("C123ABC456", "true")
    assert adapter.lookup(KEY, None).status is LookupStatus.NOT_FOUND
    assert adapter.lookup(KEY, None).status is LookupStatus.INCONCLUSIVE  # more pages


# --- SendGrid ---------------------------------------------------------------------

SENDGRID_URL = "https://api.sendgrid.com/v3/mail/send"
MAIL = {"to": "ada@example.com", "subject": "Your receipt", "text": "Thanks."}


def test_sendgrid_202_without_a_body_is_delivered(router: respx.Router) -> None:
    route = router.post(SENDGRID_URL).respond(202, headers={"X-Message-Id": "m-1"})
    adapter = preset_adapter("sendgrid", router)
    result = adapter.deliver(request(MAIL))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, None)
    sent = route.calls.last.request
    assert sent.headers["Authorization"] == f"Bearer {ENV['SENDGRID_API_KEY']}"
    assert json.loads(sent.content) == {
        "personalizations": [{"to": [{"email": "ada@example.com"}]}],
        "from": {"email": "billing@acme.test"},
        "subject": "Your receipt",
        "content": [{"type": "text/plain", "value": "Thanks."}],
        "custom_args": {"outbox_key": KEY},
    }


def test_sendgrid_rate_limit_and_validation(router: respx.Router) -> None:
    router.post(SENDGRID_URL).mock(
        side_effect=[
            httpx.Response(
                429,
                headers={"Retry-After": "5", "X-RateLimit-Remaining": "0"},
                json={"errors": [{"field": None, "message": "too many requests"}]},
            ),
            httpx.Response(
                400,
                json={
                    "errors": [
                        {
                            "message": "The from email does not contain a valid address.",
                            "field": "from.email",
                            "help": None,
                        }
                    ]
                },
            ),
        ]
    )
    adapter = preset_adapter("sendgrid", router)
    limited = adapter.deliver(request(MAIL))
    assert (limited.outcome, limited.retry_after) == (Outcome.RETRYABLE, 5.0)
    assert adapter.deliver(request(MAIL)).outcome is Outcome.PERMANENT


def test_sendgrid_ambiguity_goes_to_review(router: respx.Router) -> None:
    router.post(SENDGRID_URL).respond(500, json={"errors": [{"message": "internal error"}]})
    adapter = preset_adapter("sendgrid", router)
    assert adapter.deliver(request(MAIL)).outcome is Outcome.AMBIGUOUS
    caps = adapter.capabilities
    assert not caps.honours_idempotency_keys and not caps.supports_lookup  # review, no resend
    assert adapter.lookup(KEY, None).status is LookupStatus.INCONCLUSIVE


# --- Zendesk ---------------------------------------------------------------------

ZENDESK_URL = "https://acme.zendesk.com/api/v2/tickets.json"
ZENDESK_TICKET = {
    "ticket": {
        "url": "https://acme.zendesk.com/api/v2/tickets/35436.json",
        "id": 35436,
        "subject": "Printer on fire",
        "priority": "high",
        "status": "new",
        "external_id": KEY,
    }
}
HELP = {"subject": "Printer on fire", "body": "Third floor.", "priority": "high"}


def test_zendesk_success_uses_basic_token_auth_and_external_id(router: respx.Router) -> None:
    route = router.post(ZENDESK_URL).respond(
        201, headers={"x-idempotency-lookup": "miss"}, json=ZENDESK_TICKET
    )
    adapter = preset_adapter("zendesk", router)
    result = adapter.deliver(request(HELP))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "35436")
    sent = route.calls.last.request
    assert sent.headers["Authorization"] == basic(
        f"{ENV['ZENDESK_EMAIL']}/token", ENV["ZENDESK_API_TOKEN"]
    )
    assert sent.headers["Idempotency-Key"] == KEY
    assert json.loads(sent.content) == {
        "ticket": {
            "subject": "Printer on fire",
            "comment": {"body": "Third floor."},
            "priority": "high",
            "external_id": KEY,
        }
    }
    assert adapter.capabilities.key_retention_seconds == 2 * 3600


def test_zendesk_rate_limit_validation_and_in_progress(router: respx.Router) -> None:
    router.post(ZENDESK_URL).mock(
        side_effect=[
            httpx.Response(429, headers={"Retry-After": "93"}, text="Rate limit exceeded"),
            httpx.Response(
                422,
                json={
                    "error": "RecordInvalid",
                    "description": "Record validation errors",
                    "details": {"base": [{"description": "Requester: Name is too short"}]},
                },
            ),
            httpx.Response(409, json={"error": "in progress"}),
            httpx.Response(400, json={"error": "IdempotentRequestError", "description": "..."}),
        ]
    )
    adapter = preset_adapter("zendesk", router)
    limited = adapter.deliver(request(HELP))
    assert (limited.outcome, limited.retry_after) == (Outcome.RETRYABLE, 93.0)
    assert adapter.deliver(request(HELP)).outcome is Outcome.PERMANENT
    busy = adapter.deliver(request(HELP))
    assert busy.outcome is Outcome.RETRYABLE and busy.may_have_happened
    assert adapter.deliver(request(HELP)).outcome is Outcome.AMBIGUOUS


def test_zendesk_lookup_by_external_id(router: respx.Router) -> None:
    route = router.get(ZENDESK_URL).mock(
        side_effect=[
            httpx.Response(200, json={"tickets": [ZENDESK_TICKET["ticket"]], "count": 1}),
            httpx.Response(200, json={"tickets": [], "count": 0}),
        ]
    )
    adapter = preset_adapter("zendesk", router)
    hit = adapter.lookup(KEY, None)
    assert (hit.status, hit.provider_ref) == (LookupStatus.FOUND, "35436")
    assert route.calls[0].request.url.params["external_id"] == KEY
    assert adapter.lookup(KEY, None).status is LookupStatus.NOT_FOUND


# --- Twilio -----------------------------------------------------------------------

SID = ENV["TWILIO_ACCOUNT_SID"]
TWILIO_URL = f"https://api.twilio.com/2010-04-01/Accounts/{SID}/Messages.json"
MESSAGE = {
    "account_sid": SID,
    "sid": "SM1f0e8ae6ade43cb3c0ce4525424e404f",
    "status": "queued",
    "to": "+15558675310",
    "from": "+15005550006",
    "body": "Your code is 123456",
}
SMS = {"to": "+15558675310", "body": "Your code is 123456"}


def test_twilio_success_is_form_encoded_with_basic_auth(router: respx.Router) -> None:
    route = router.post(TWILIO_URL).respond(201, json=MESSAGE)
    result = preset_adapter("twilio", router).deliver(request(SMS))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, MESSAGE["sid"])
    sent = route.calls.last.request
    assert sent.headers["Authorization"] == basic(SID, ENV["TWILIO_AUTH_TOKEN"])
    assert sent.headers["Content-Type"] == "application/x-www-form-urlencoded"
    assert sent.headers["I-Twilio-Idempotency-Token"] == KEY
    assert parse_qsl(sent.content.decode()) == [
        ("To", "+15558675310"),
        ("From", "+15005550006"),
        ("Body", "Your code is 123456"),
    ]


def test_twilio_rate_limit_validation_and_server_error(router: respx.Router) -> None:
    router.post(TWILIO_URL).mock(
        side_effect=[
            httpx.Response(
                429,
                headers={"Retry-After": "1"},
                json={
                    "code": 20429,
                    "message": "Too Many Requests",
                    "more_info": "https://www.twilio.com/docs/errors/20429",
                    "status": 429,
                },
            ),
            httpx.Response(
                400,
                json={
                    "code": 21211,
                    "message": "Invalid 'To' Phone Number: +1555867531",
                    "more_info": "https://www.twilio.com/docs/errors/21211",
                    "status": 400,
                },
            ),
            httpx.Response(500, json={"code": 20500, "message": "Internal Server Error"}),
        ]
    )
    adapter = preset_adapter("twilio", router)
    limited = adapter.deliver(request(SMS))
    assert (limited.outcome, limited.retry_after) == (Outcome.RETRYABLE, 1.0)
    assert adapter.deliver(request(SMS)).outcome is Outcome.PERMANENT
    assert adapter.deliver(request(SMS)).outcome is Outcome.AMBIGUOUS
    assert not adapter.capabilities.honours_idempotency_keys


def test_twilio_lookup_by_message_sid(router: respx.Router) -> None:
    base = f"https://api.twilio.com/2010-04-01/Accounts/{SID}/Messages"
    router.get(f"{base}/{MESSAGE['sid']}.json").respond(200, json=MESSAGE)
    router.get(f"{base}/SMmissing.json").respond(
        404, json={"code": 20404, "message": "The requested resource was not found", "status": 404}
    )
    adapter = preset_adapter("twilio", router)
    hit = adapter.lookup(KEY, str(MESSAGE["sid"]))
    assert (hit.status, hit.provider_ref) == (LookupStatus.FOUND, MESSAGE["sid"])
    assert adapter.lookup(KEY, "SMmissing").status is LookupStatus.NOT_FOUND
    assert adapter.lookup(KEY, None).status is LookupStatus.INCONCLUSIVE  # no SID: review


# --- every preset ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(adapters.PRESETS))
def test_no_preset_error_or_repr_shows_a_secret(name: str, router: respx.Router) -> None:
    router.route().respond(500, text=" ".join(ENV.values()))  # a provider echoing everything
    adapter = preset_adapter(name, router)
    payload = dict(adapter.config.sample_payload or {})
    result = adapter.deliver(request(payload))
    shown = " ".join(
        [
            str(result.error),
            repr(adapter),
            repr(adapter.config),
            adapter.prepare(request(payload)).render(),
            str(adapter.lookup(KEY, "ref").error),
        ]
    )
    own = json.dumps(adapters.PRESETS[name].table)
    for name_, value in ENV.items():
        if "${" + name_ + "}" not in own or name_ == "ZENDESK_EMAIL":
            continue  # another adapter's secret; the e-mail is redacted within "email/token"
        assert value not in shown, name_
