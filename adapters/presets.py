"""Presets: declarative adapters for providers teams call, by name.

``preset = "stripe"`` in an ``[adapters.NAME]`` table starts from the table
below; every key the adapter's own table gives wins (``vars``, ``headers`` and
``lookup_params`` are merged key by key; the adapter's ``classify`` rules are
tried before the preset's). Each preset is built from the provider's documented
request and reply shapes (the page is named in ``docs``); the respx suite in
``tests/adapters/test_presets.py`` replays those shapes.

Secrets default to the provider's usual environment variable names
(``${STRIPE_API_KEY}``...); override ``auth`` to read them elsewhere.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    docs: tuple[str, ...]
    table: dict[str, Any]
    needs: tuple[str, ...] = ()  # what the adapter's table (or the environment) must add
    notes: tuple[str, ...] = field(default=())


_CREDENTIALS_REFUSED = {
    "status": [401, 403],
    "outcome": "permanent",
    "why": "credentials refused: the request did nothing",
}

STRIPE = Preset(
    name="stripe",
    summary="Stripe PaymentIntents: form-encoded, Idempotency-Key, 24 h key retention, "
    "lookup by metadata search",
    docs=(
        "https://docs.stripe.com/api/payment_intents/create",
        "https://docs.stripe.com/api/idempotent_requests",
        "https://docs.stripe.com/api/payment_intents/search",
        "https://docs.stripe.com/search#search-query-language",
        "https://docs.stripe.com/error-codes",
        "https://docs.stripe.com/rate-limits",
    ),
    needs=("STRIPE_API_KEY in the environment",),
    table={
        "url": "https://api.stripe.com/v1/payment_intents",
        "method": "POST",
        # Stripe takes application/x-www-form-urlencoded, nested keys as metadata[k].
        "body_format": "form",
        "body": {
            "amount": "{{ payload.amount }}",
            "currency": "{{ payload.currency }}",
            "metadata": {"outbox_key": "{{ effect_key }}"},
        },
        "auth": {"type": "bearer", "token": "${STRIPE_API_KEY}"},
        "idempotency_header": "Idempotency-Key",
        "honours_idempotency_keys": True,
        # "Keys are eligible to be removed ... after they're at least 24 hours old."
        "key_retention": "24h",
        "client_reference_field": "metadata.outbox_key",
        "reference_field": "id",
        "lookup_by": "client_reference",
        "lookup_url": "https://api.stripe.com/v1/payment_intents/search",
        "lookup_params": {"query": "metadata['outbox_key']:'{{ effect_key }}'"},
        "lookup_list_field": "data",
        "lookup_match": {"metadata.outbox_key": "{{ effect_key }}"},
        # Search is not read-after-write: new objects appear "usually within a minute".
        "lookup_settle_seconds": 120,
        "classify": [
            {
                "status": 409,
                "match": {"error.code": "idempotency_key_in_use"},
                "outcome": "retryable",
                "why": "another request with this key is still being processed",
            },
            {
                "status": 400,
                "match": {"error.type": "idempotency_error"},
                "outcome": "ambiguous",
                "why": "the key was first used with other parameters: that request may exist",
            },
            {
                "status": 402,
                "outcome": "permanent",
                "why": "the card was declined: nothing was charged",
            },
            _CREDENTIALS_REFUSED,
        ],
        "sample_payload": {"amount": 2000, "currency": "usd"},
    },
)

GITHUB = Preset(
    name="github",
    summary="GitHub issues: no idempotency keys; a marker in the body, found by issue search",
    docs=(
        "https://docs.github.com/en/rest/issues/issues#create-an-issue",
        "https://docs.github.com/en/rest/search/search#search-issues-and-pull-requests",
        "https://docs.github.com/en/rest/using-the-rest-api/rate-limits-for-the-rest-api",
        "https://docs.github.com/en/rest/using-the-rest-api/troubleshooting-the-rest-api",
    ),
    needs=('vars.repository = "OWNER/REPO"', "GITHUB_TOKEN in the environment"),
    table={
        "url": "https://api.github.com/repos/{{ vars.repository }}/issues",
        "method": "POST",
        "headers": {
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28",
        },
        "auth": {"type": "bearer", "token": "${GITHUB_TOKEN}"},
        "body": {
            "title": "{{ payload.title }}",
            # The marker is how a lookup finds the issue: GitHub keeps no key of ours.
            "body": '{{ payload.body | default("") }}\n\n<!-- outbox-key: {{ effect_key }} -->',
            "labels": "{{ payload.labels | default([]) }}",
        },
        "idempotency_header": False,
        "honours_idempotency_keys": False,
        "client_reference_field": False,
        "reference_field": "number",
        "lookup_by": "client_reference",
        "lookup_url": "https://api.github.com/search/issues",
        "lookup_params": {
            "q": 'repo:{{ vars.repository }} is:issue in:body "outbox-key: {{ effect_key }}"'
        },
        "lookup_list_field": "items",
        "lookup_match_contains": {"body": "<!-- outbox-key: {{ effect_key }} -->"},
        "lookup_inconclusive_if": {"incomplete_results": True},
        # The search index trails writes; give it time before trusting "no match".
        "lookup_settle_seconds": 120,
        "classify": [
            {
                "status": [403, 429],
                "headers": {"x-ratelimit-remaining": "0"},
                "outcome": "retryable",
                "why": "primary rate limit: nothing was created",
            },
            {
                "status": [403, 429],
                "body_contains": "secondary rate limit",
                "outcome": "retryable",
                "why": "secondary rate limit: nothing was created",
            },
            {
                "status": 410,
                "outcome": "permanent",
                "why": "issues are disabled in this repository",
            },
            _CREDENTIALS_REFUSED,
        ],
        "sample_payload": {"title": "Printer on fire", "body": "Third floor."},
    },
)

SLACK = Preset(
    name="slack",
    summary="Slack chat.postMessage: 200 with ok:false is an error; metadata carries our key",
    docs=(
        "https://api.slack.com/methods/chat.postMessage",
        "https://api.slack.com/methods/conversations.history",
        "https://api.slack.com/reference/metadata",
        "https://api.slack.com/apis/rate-limits",
    ),
    needs=('vars.channel = "C0123456789"', "SLACK_BOT_TOKEN in the environment"),
    table={
        "url": "https://slack.com/api/chat.postMessage",
        "method": "POST",
        "headers": {"Content-Type": "application/json; charset=utf-8"},
        "auth": {"type": "bearer", "token": "${SLACK_BOT_TOKEN}"},
        "body": {
            "channel": "{{ vars.channel }}",
            "text": "{{ payload.text }}",
            "metadata": {
                "event_type": "outbox_effect",
                "event_payload": {"outbox_key": "{{ effect_key }}"},
            },
        },
        "idempotency_header": False,
        "honours_idempotency_keys": False,
        "client_reference_field": "metadata.event_payload.outbox_key",
        "reference_field": "ts",
        "lookup_by": "client_reference",
        "lookup_url": "https://slack.com/api/conversations.history",
        "lookup_params": {
            "channel": "{{ vars.channel }}",
            "include_all_metadata": "true",
            "limit": "200",
        },
        "lookup_list_field": "messages",
        "lookup_match": {"metadata.event_payload.outbox_key": "{{ effect_key }}"},
        # Only the latest page was read: "not there" proves nothing when there is more.
        "lookup_inconclusive_if": {"has_more": True},
        "lookup_settle_seconds": 5,
        "classify": [
            {"status": 200, "match": {"ok": True}, "outcome": "delivered"},
            {
                "status": 200,
                "match": {"ok": False, "error": "ratelimited"},
                "outcome": "retryable",
                "why": "rate limited: not posted",
            },
            {
                "status": 200,
                "match": {"ok": False, "error": "service_unavailable"},
                "outcome": "retryable",
                "why": "Slack is unavailable: not posted",
            },
            {
                "status": 200,
                "match": {"ok": False, "error": "fatal_error"},
                "outcome": "ambiguous",
                "why": "Slack says some part of the operation may have succeeded",
            },
            {
                "status": 200,
                "match": {"ok": False, "error": "internal_error"},
                "outcome": "ambiguous",
                "why": "an internal error at Slack: it may have posted",
            },
            {
                "status": 200,
                "match": {"ok": False, "error": "request_timeout"},
                "outcome": "ambiguous",
                "why": "timed out at Slack: it may have posted",
            },
            {
                "status": 200,
                "match": {"ok": False},
                "outcome": "permanent",
                "why": "Slack refused the message (ok: false)",
            },
            _CREDENTIALS_REFUSED,
        ],
        "sample_payload": {"text": "Deploy finished"},
    },
)

SENDGRID = Preset(
    name="sendgrid",
    summary="SendGrid v3 mail send: 202 with no body, no reference, no lookup "
    "(every ambiguity goes to review)",
    docs=(
        "https://www.twilio.com/docs/sendgrid/api-reference/mail-send/mail-send",
        "https://www.twilio.com/docs/sendgrid/api-reference/how-to-use-the-sendgrid-v3-api/rate-limits",
        "https://www.twilio.com/docs/sendgrid/api-reference/how-to-use-the-sendgrid-v3-api/errors",
    ),
    needs=('vars.from_email = "billing@example.com"', "SENDGRID_API_KEY in the environment"),
    table={
        "url": "https://api.sendgrid.com/v3/mail/send",
        "method": "POST",
        "auth": {"type": "bearer", "token": "${SENDGRID_API_KEY}"},
        "body": {
            "personalizations": [{"to": [{"email": "{{ payload.to }}"}]}],
            "from": {"email": "{{ vars.from_email }}"},
            "subject": "{{ payload.subject }}",
            "content": [{"type": "text/plain", "value": "{{ payload.text }}"}],
            # Shown in SendGrid's activity feed: how a person finds the mail.
            "custom_args": {"outbox_key": "{{ effect_key }}"},
        },
        "idempotency_header": False,
        "honours_idempotency_keys": False,
        "client_reference_field": "custom_args.outbox_key",
        "reference_field": False,  # 202 Accepted has an empty body
        "supports_lookup": False,
        "classify": [
            {
                "status": 413,
                "outcome": "permanent",
                "why": "the message is too large: not accepted",
            },
            _CREDENTIALS_REFUSED,
        ],
        "sample_payload": {"to": "ada@example.com", "subject": "Your receipt", "text": "Thanks."},
    },
)

ZENDESK = Preset(
    name="zendesk",
    summary="Zendesk tickets: Idempotency-Key (2 h), external_id = our key, lookup by external_id",
    docs=(
        "https://developer.zendesk.com/api-reference/ticketing/tickets/tickets/#create-ticket",
        "https://developer.zendesk.com/api-reference/ticketing/introduction/#idempotency",
        "https://developer.zendesk.com/api-reference/ticketing/tickets/tickets/#list-tickets",
        "https://developer.zendesk.com/api-reference/introduction/rate-limits/",
        "https://developer.zendesk.com/api-reference/introduction/security-and-auth/",
    ),
    needs=('vars.subdomain = "acme"', "ZENDESK_EMAIL and ZENDESK_API_TOKEN in the environment"),
    table={
        "url": "https://{{ vars.subdomain }}.zendesk.com/api/v2/tickets.json",
        "method": "POST",
        # API token authentication: "{email_address}/token:{api_token}", HTTP Basic.
        "auth": {
            "type": "basic",
            "username": "${ZENDESK_EMAIL}/token",
            "password": "${ZENDESK_API_TOKEN}",
        },
        "body": {
            "ticket": {
                "subject": "{{ payload.subject }}",
                "comment": {"body": "{{ payload.body }}"},
                "priority": '{{ payload.priority | default("normal") }}',
                "external_id": "{{ effect_key }}",
            }
        },
        "idempotency_header": "Idempotency-Key",
        "honours_idempotency_keys": True,
        "key_retention": "2h",
        "client_reference_field": "ticket.external_id",
        "reference_field": "ticket.id",
        "lookup_by": "client_reference",
        "lookup_url": "https://{{ vars.subdomain }}.zendesk.com/api/v2/tickets.json",
        "lookup_params": {"external_id": "{{ effect_key }}"},
        "lookup_list_field": "tickets",
        "lookup_match": {"external_id": "{{ effect_key }}"},
        "lookup_reference_field": "id",  # a listed ticket is not wrapped in "ticket"
        "lookup_settle_seconds": 5,
        "classify": [
            {
                "status": 400,
                "match": {"error": "IdempotentRequestError"},
                "outcome": "ambiguous",
                "why": "the key was first used with another body: that ticket may exist",
            },
            _CREDENTIALS_REFUSED,
        ],
        "sample_payload": {
            "subject": "Printer on fire",
            "body": "Third floor.",
            "priority": "high",
        },
    },
)

TWILIO = Preset(
    name="twilio",
    summary="Twilio Messages: form-encoded, HTTP Basic (Account SID), I-Twilio-Idempotency-Token, "
    "lookup by message SID",
    docs=(
        "https://www.twilio.com/docs/messaging/api/message-resource#create-a-message-resource",
        "https://www.twilio.com/docs/messaging/api/message-resource#fetch-a-message-resource",
        "https://www.twilio.com/docs/usage/requests-to-twilio",
        "https://www.twilio.com/docs/usage/webhooks/webhooks-connection-overrides",
        "https://www.twilio.com/docs/api/errors/20429",
    ),
    needs=(
        'vars.from_number = "+15005550006"',
        "TWILIO_ACCOUNT_SID and TWILIO_AUTH_TOKEN in the environment",
    ),
    notes=(
        (
            "Twilio documents I-Twilio-Idempotency-Token on the requests it makes; its Messages "
            "reference does not promise to deduplicate on it. The preset sends the effect key in "
            "it and still declares honours_idempotency_keys = false: an ambiguous send is looked "
            "up by SID when one is known, else reviewed. Set it true if your contract says so."
        ),
    ),
    table={
        "url": "https://api.twilio.com/2010-04-01/Accounts/{{ vars.account_sid }}/Messages.json",
        "method": "POST",
        "vars": {"account_sid": "${TWILIO_ACCOUNT_SID}"},
        "auth": {
            "type": "basic",
            "username": "${TWILIO_ACCOUNT_SID}",
            "password": "${TWILIO_AUTH_TOKEN}",
        },
        "body_format": "form",
        "body": {
            "To": "{{ payload.to }}",
            "From": "{{ vars.from_number }}",
            "Body": "{{ payload.body }}",
        },
        "idempotency_header": "I-Twilio-Idempotency-Token",
        "honours_idempotency_keys": False,
        "client_reference_field": False,
        "reference_field": "sid",
        "lookup_by": "reference",
        "lookup_url": (
            "https://api.twilio.com/2010-04-01/Accounts/{{ vars.account_sid }}"
            "/Messages/{{ reference }}.json"
        ),
        "lookup_list_field": False,
        "lookup_settle_seconds": 5,
        "classify": [_CREDENTIALS_REFUSED],
        "sample_payload": {"to": "+15558675310", "body": "Your code is 123456"},
    },
)

PRESETS: dict[str, Preset] = {p.name: p for p in (STRIPE, GITHUB, SLACK, SENDGRID, ZENDESK, TWILIO)}


def table(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's table (callers merge into it)."""
    return copy.deepcopy(PRESETS[name].table)
