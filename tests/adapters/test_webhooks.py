"""Webhook settings and signatures (adapters.webhooks): every mistake named, every
signature checked against each secret, within the tolerance of our clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import standardwebhooks

from adapters import ConfigError, SignatureError, load_registry
from adapters.config import registry_from_document
from adapters.webhooks import from_table, stripe_signature

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OLD = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
ENV = {"NEW": SECRET, "OLD": OLD, "STRIPE": "sk_shared"}
TABLE = {
    "kind": "noop",
    "webhook_format": "standard",
    "webhook_secret": "${NEW}",
    "webhook_secret_previous": "${OLD}",
    "webhook_succeeded_types": ["ticket.created"],
}


def _standard(secret: str, at: datetime, body: bytes, msg_id: str = "evt_1") -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": standardwebhooks.Webhook(secret).sign(msg_id, at, body),
    }


def test_the_registry_carries_each_adapters_webhook_settings() -> None:
    registry = registry_from_document(
        {"adapters": {"hd": TABLE, "plain": {"kind": "noop"}}}, env=ENV
    )
    assert set(registry.webhooks) == {"hd"}
    config = registry.webhooks["hd"]
    assert (config.format, config.secrets, config.tolerance_seconds) == (
        "standard",
        (SECRET, OLD),
        300.0,
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"webhook_format": "svix"}, "webhook_format"),
        ({"webhook_secret": SECRET}, "webhook_secret"),  # a literal secret in the file
        ({"webhook_secret": "${MISSING}"}, "webhook_secret"),
        ({"webhook_secret": "${STRIPE}"}, "webhook_secret"),  # not whsec_ for standard
        ({"webhook_tolerance_seconds": 0}, "webhook_tolerance_seconds"),
        ({"webhook_succeeded_types": []}, "webhook_succeeded_types"),
        ({"webhook_failed_types": ["ticket.created"]}, "webhook_failed_types"),
        ({"webhook_key_field": 3}, "webhook_key_field"),
        ({"webhook_secrte": "${NEW}"}, "webhook_secrte"),  # a typo is refused, with a hint
    ],
)
def test_every_mistake_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        registry_from_document({"adapters": {"hd": {**TABLE, **change}}}, env=ENV)
    assert field in str(caught.value)


def test_standard_signatures_by_either_secret_within_the_tolerance() -> None:
    config = from_table("hd", TABLE, ENV)
    assert config is not None
    body = b'{"type":"ticket.created"}'
    assert config.verify(_standard(SECRET, NOW, body), body, NOW) == NOW
    assert config.verify(_standard(OLD, NOW, body), body, NOW + timedelta(seconds=299)) == NOW
    for headers, now in [
        (_standard("whsec_" + "A" * 32, NOW, body), NOW),  # another secret
        (_standard(SECRET, NOW, b"{}"), NOW),  # other bytes
        (_standard(SECRET, NOW, body), NOW + timedelta(seconds=301)),  # too old
        (_standard(SECRET, NOW, body), NOW - timedelta(seconds=301)),  # too new
        ({}, NOW),
        ({**_standard(SECRET, NOW, body), "webhook-timestamp": "nan"}, NOW),
    ]:
        with pytest.raises(SignatureError):
            config.verify(headers, body, now)


def test_stripe_signatures() -> None:
    config = from_table(
        "hd", {**TABLE, "webhook_format": "stripe", "webhook_secret": "${STRIPE}"}, ENV
    )
    assert config is not None
    body = b'{"id":"evt_1","type":"ticket.created"}'
    t = str(int(NOW.timestamp()))
    good = f"t={t},v1=deadbeef,v1={stripe_signature('sk_shared', t, body)}"
    assert config.verify({"Stripe-Signature": good}, body, NOW) == NOW
    for header in (f"t={t},v1={stripe_signature('other', t, body)}", f"t={t}", "v1=abc", ""):
        with pytest.raises(SignatureError):
            config.verify({"Stripe-Signature": header}, body, NOW)


def test_reading_an_event_by_the_adapters_paths() -> None:
    config = from_table("hd", {**TABLE, "webhook_failed_types": ["ticket.failed"]}, ENV)
    assert config is not None
    body = b"{}"
    data = {"type": "ticket.created", "data": {"id": "tkt_1", "client_reference": "obx_1"}}
    event = config.read({"webhook-id": "msg_1"}, body, data, NOW)
    assert (event.event_id, event.effect_key, event.provider_ref, event.outcome) == (
        "msg_1",
        "obx_1",
        "tkt_1",
        "succeeded",
    )
    other = config.read({"webhook-id": "msg_2"}, body, {"type": "ticket.viewed"}, NOW)
    assert (other.outcome, other.effect_key) == (None, None)
    with pytest.raises(ValueError, match="no type"):
        config.read({"webhook-id": "m"}, body, {}, NOW)


def test_the_default_registry_has_no_webhooks() -> None:
    assert load_registry(env={}).webhooks == {}
