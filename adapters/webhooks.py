"""Provider webhooks: how an adapter's events are signed and what they say.

Configured per adapter, in its own ``webhook_*`` keys of the adapters file::

    [adapters.helpdesk]
    kind = "helpdesk"
    webhook_format = "standard"              # "standard" (Standard Webhooks) or "stripe"
    webhook_secret = "${HELPDESK_WEBHOOK_SECRET}"
    webhook_secret_previous = "${HELPDESK_WEBHOOK_SECRET_OLD}"  # optional: rotation
    webhook_tolerance_seconds = 300          # signatures older or newer than this fail
    webhook_event_id_field = "id"            # dotted path; standard: the webhook-id header
    webhook_type_field = "type"
    webhook_key_field = "data.idempotency_key"          # our effect key, as the provider echoes it
    webhook_client_reference_field = "data.client_reference"
    webhook_reference_field = "data.id"      # the provider's own reference
    webhook_succeeded_types = ["ticket.created"]
    webhook_failed_types = ["ticket.failed"]

Secrets are never written in the file: ``webhook_secret`` names an
environment variable as ``${NAME}``, read once at start-up.

Signatures:

- ``standard``: the ``webhook-id``, ``webhook-timestamp`` and
  ``webhook-signature`` headers of Standard Webhooks, signed and compared by
  the ``standardwebhooks`` library (``v1,<base64 HMAC-SHA256>``, secrets as
  ``whsec_<base64>``);
- ``stripe``: ``Stripe-Signature: t=<unix>,v1=<hex HMAC-SHA256 of "t.body">``.

Either way the timestamp must be within the tolerance of *our* clock (passed
in, so tests move it), and any of the configured secrets may have signed it,
so a secret can be rotated without losing events.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import standardwebhooks

from adapters.errors import ConfigError

FORMATS = ("standard", "stripe")
TOLERANCE_SECONDS_DEFAULT = 300.0
STRIPE_HEADER = "stripe-signature"
KEYS = frozenset(
    {
        "webhook_format",
        "webhook_secret",
        "webhook_secret_previous",
        "webhook_tolerance_seconds",
        "webhook_event_id_field",
        "webhook_type_field",
        "webhook_key_field",
        "webhook_client_reference_field",
        "webhook_reference_field",
        "webhook_succeeded_types",
        "webhook_failed_types",
    }
)
"""The keys of an ``[adapters.NAME]`` table that this module owns."""

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class SignatureError(Exception):
    """The event is not signed by a configured secret, or not within the tolerance."""


@dataclass(frozen=True, slots=True)
class Event:
    """A verified event, as the adapter's paths read it. ``None``: the body had no such field."""

    event_id: str
    event_type: str
    signed_at: datetime
    effect_key: str | None  # our key or the client reference we sent (both are the key)
    provider_ref: str | None
    outcome: str | None  # "succeeded", "failed", or None: the type proves nothing
    body: str  # exactly as received


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """One adapter's webhook settings (see the module docstring)."""

    format: str
    secrets: tuple[str, ...]  # the current one first
    tolerance_seconds: float = TOLERANCE_SECONDS_DEFAULT
    event_id_field: str | None = None  # None: the format's own (webhook-id header / "id")
    type_field: str = "type"
    key_field: str | None = None
    client_reference_field: str | None = "data.client_reference"
    reference_field: str | None = "data.id"
    succeeded_types: tuple[str, ...] = ()
    failed_types: tuple[str, ...] = ()

    # -- signatures ---------------------------------------------------------------

    def verify(self, headers: Mapping[str, str], body: bytes, now: datetime) -> datetime:
        """The signing time, if a configured secret signed ``body`` within the tolerance.

        Raises ``SignatureError`` otherwise (the message is safe to show: it
        never contains a secret or the expected signature).
        """
        lowered = {k.lower(): v for k, v in headers.items()}
        if self.format == "standard":
            return self._verify_standard(lowered, body, now)
        return self._verify_stripe(lowered, body, now)

    def _check_time(self, unix: str, now: datetime) -> datetime:
        try:
            value = float(unix)
            if not math.isfinite(value):
                raise ValueError(unix)
            at = datetime.fromtimestamp(math.floor(value), tz=UTC)
        except (ValueError, OverflowError, OSError):
            raise SignatureError("the signature's timestamp is not a number") from None
        if abs((now - at).total_seconds()) > self.tolerance_seconds:
            raise SignatureError(
                f"the signature's timestamp is more than {self.tolerance_seconds:g}s "
                "away from our clock"
            )
        return at

    def _verify_standard(self, headers: Mapping[str, str], body: bytes, now: datetime) -> datetime:
        msg_id = headers.get("webhook-id")
        stamp = headers.get("webhook-timestamp")
        passed = headers.get("webhook-signature")
        if not (msg_id and stamp and passed):
            raise SignatureError("missing webhook-id, webhook-timestamp or webhook-signature")
        at = self._check_time(stamp, now)
        offered = [s.encode() for s in passed.split(" ") if s]
        for secret in self.secrets:
            # The library signs; we compare in constant time against every offered one.
            expected = standardwebhooks.Webhook(secret).sign(msg_id, at, body).encode()
            if any(hmac.compare_digest(expected, sig) for sig in offered):
                return at
        raise SignatureError("no signature matches a configured secret")

    def _verify_stripe(self, headers: Mapping[str, str], body: bytes, now: datetime) -> datetime:
        header = headers.get(STRIPE_HEADER)
        if not header:
            raise SignatureError("missing Stripe-Signature")
        stamp: str | None = None
        offered: list[bytes] = []
        for part in header.split(","):
            name, _, value = part.strip().partition("=")
            if name == "t":
                stamp = value
            elif name == "v1" and value:
                offered.append(value.encode())
        if stamp is None or not offered:
            raise SignatureError("Stripe-Signature needs t=... and v1=...")
        at = self._check_time(stamp, now)
        for secret in self.secrets:
            expected = stripe_signature(secret, stamp, body).encode()
            if any(hmac.compare_digest(expected, sig) for sig in offered):
                return at
        raise SignatureError("no signature matches a configured secret")

    # -- reading the event ----------------------------------------------------------

    def read(
        self, headers: Mapping[str, str], body: bytes, data: Any, signed_at: datetime
    ) -> Event:
        """The event's id, type, effect and outcome, by this adapter's paths.

        Raises ``ValueError`` naming the missing field when the body has no
        event id or type (it cannot be deduplicated or understood).
        """
        lowered = {k.lower(): v for k, v in headers.items()}
        if self.event_id_field is not None:
            event_id = _text(_path(data, self.event_id_field))
        elif self.format == "standard":
            event_id = lowered.get("webhook-id")
        else:
            event_id = _text(_path(data, "id"))
        if not event_id:
            raise ValueError(f"the event has no id ({self.event_id_field or 'id'})")
        event_type = _text(_path(data, self.type_field))
        if not event_type:
            raise ValueError(f"the event has no type ({self.type_field})")
        key = None
        for field in (self.key_field, self.client_reference_field):
            if field is not None and key is None:
                key = _text(_path(data, field))
        ref = _text(_path(data, self.reference_field)) if self.reference_field else None
        outcome = None
        if event_type in self.succeeded_types:
            outcome = "succeeded"
        elif event_type in self.failed_types:
            outcome = "failed"
        return Event(
            event_id=event_id[:255],
            event_type=event_type[:200],
            signed_at=signed_at,
            effect_key=key[:200] if key else None,
            provider_ref=ref[:500] if ref else None,
            outcome=outcome,
            body=body.decode("utf-8", errors="replace"),
        )


def stripe_signature(secret: str, timestamp: str, body: bytes) -> str:
    """The ``v1`` value of a Stripe-style signature: hex HMAC-SHA256 of ``"{t}.{body}"``."""
    return hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def _path(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def _text(value: Any) -> str | None:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


# --- configuration -------------------------------------------------------------------


def from_table(
    adapter: str, table: Mapping[str, Any], env: Mapping[str, str]
) -> WebhookConfig | None:
    """The webhook settings of one ``[adapters.NAME]`` table; None when it has none.

    Every mistake is a ``ConfigError`` naming the adapter, the field and the fix.
    """
    given = {k: v for k, v in table.items() if k in KEYS}
    if not given:
        return None

    def fail(field: str, message: str) -> ConfigError:
        return ConfigError(message, adapter=adapter, field=field)

    fmt = given.get("webhook_format")
    if fmt not in FORMATS:
        raise fail("webhook_format", f"must be one of {', '.join(FORMATS)}, not {fmt!r}")
    secrets = [_secret(adapter, "webhook_secret", given.get("webhook_secret"), env, fmt)]
    if "webhook_secret_previous" in given:
        secrets.append(
            _secret(adapter, "webhook_secret_previous", given["webhook_secret_previous"], env, fmt)
        )
    tolerance = given.get("webhook_tolerance_seconds", TOLERANCE_SECONDS_DEFAULT)
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, int | float)
        or not math.isfinite(tolerance)
        or tolerance <= 0
    ):
        raise fail(
            "webhook_tolerance_seconds", f"must be a number of seconds > 0, not {tolerance!r}"
        )

    def path(field: str, default: str | None) -> str | None:
        value = given.get(field, default)
        if value is False:
            return None
        if value is not None and (not isinstance(value, str) or not value):
            raise fail(field, f"must be a dotted path (a.b.c), or false, not {value!r}")
        return value

    def types(field: str) -> tuple[str, ...]:
        value = given.get(field, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise fail(field, f"must be a list of event types, not {value!r}")
        return tuple(value)

    succeeded, failed = types("webhook_succeeded_types"), types("webhook_failed_types")
    if not succeeded and not failed:
        raise fail(
            "webhook_succeeded_types",
            "is missing; list the event types that prove an effect happened "
            "(and webhook_failed_types those that prove it failed for good)",
        )
    both = sorted(set(succeeded) & set(failed))
    if both:
        raise fail("webhook_failed_types", f"{both[0]!r} cannot both succeed and fail")
    type_field = path("webhook_type_field", "type")
    if type_field is None:
        raise fail("webhook_type_field", "is needed: where the event's type is")
    config = WebhookConfig(
        format=fmt,
        secrets=tuple(secrets),
        tolerance_seconds=float(tolerance),
        event_id_field=path("webhook_event_id_field", None),
        type_field=type_field,
        key_field=path("webhook_key_field", None),
        client_reference_field=path("webhook_client_reference_field", "data.client_reference"),
        reference_field=path("webhook_reference_field", "data.id"),
        succeeded_types=succeeded,
        failed_types=failed,
    )
    if (
        config.key_field is None
        and config.client_reference_field is None
        and not (config.reference_field)
    ):
        raise fail("webhook_key_field", "set a key, client reference or reference field")
    return config


def _secret(adapter: str, field: str, value: Any, env: Mapping[str, str], fmt: str) -> str:
    if not isinstance(value, str) or not _ENV_REF.fullmatch(value):
        raise ConfigError(
            'must name an environment variable as "${NAME}"; secrets are not kept in the file',
            adapter=adapter,
            field=field,
        )
    match = _ENV_REF.fullmatch(value)
    assert match is not None
    name = match.group(1)
    secret = env.get(name)
    if not secret:
        raise ConfigError(
            f"names the environment variable {name}, which is not set (or empty)",
            adapter=adapter,
            field=field,
        )
    if fmt == "standard":
        body = secret.removeprefix("whsec_")
        try:
            valid = secret.startswith("whsec_") and bool(
                base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
            )
        except (ValueError, binascii.Error):
            valid = False
        if not valid:
            raise ConfigError(
                f"the secret in {name} is not a Standard Webhooks secret (whsec_<base64>)",
                adapter=adapter,
                field=field,
            )
    return secret
