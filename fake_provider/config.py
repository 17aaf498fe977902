"""How one fake provider behaves: a frozen value built by the CLI or by a test.

Every knob that changes what a client can observe lives here, with its default
as a named constant, so the CLI, the docs and the tests agree on one value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from fake_provider import faults
from fake_provider import webhooks as webhooks_

KEY_RETENTION_SECONDS_DEFAULT = 24 * 60 * 60.0
HOLD_SECONDS_DEFAULT = 30.0
RETRY_AFTER_SECONDS_DEFAULT = 1
LOOKUP_LAG_MS_DEFAULT = 0


class Mode(StrEnum):
    """Whether the provider deduplicates by ``Idempotency-Key``."""

    HONOUR = "honour"  # same key, same body: the stored reply; same key, other body: 422
    IGNORE = "ignore"  # every POST creates a ticket, whatever the key: duplicates happen


class DropMode(StrEnum):
    """How ``drop_after_commit`` withholds the reply once the ticket is committed."""

    ABORT = "abort"  # send the status line, then close the connection: a protocol error
    HOLD = "hold"  # keep the reply for hold_seconds: the client's read timeout fires


class RetryAfterFormat(StrEnum):
    """How 429 and 503 replies spell ``Retry-After`` (RFC 9110 allows both)."""

    SECONDS = "seconds"  # "Retry-After: 1"
    HTTP_DATE = "http-date"  # "Retry-After: Wed, 02 Dec 2026 16:53:05 GMT"


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the field and the bound."""


@dataclass(frozen=True)
class ProviderConfig:
    """Everything that decides what a client of the fake provider observes."""

    mode: Mode = Mode.HONOUR
    lookup_enabled: bool = True  # False: GET /v1/tickets?... answers 501
    lookup_lag_ms: int = LOOKUP_LAG_MS_DEFAULT  # a new ticket is invisible to lookups this long
    key_retention_seconds: float = KEY_RETENTION_SECONDS_DEFAULT  # honour mode's key window
    db_path: str | None = None  # a SQLite file; None keeps everything in memory
    seed: int | None = None  # None: a fresh seed, reported by GET /_admin/faults
    faults: faults.FaultSpec = field(default_factory=faults.FaultSpec)
    drop_mode: DropMode = DropMode.ABORT  # abort is fast in tests; hold needs a client timeout
    hold_seconds: float = HOLD_SECONDS_DEFAULT  # for drop "hold" and timeout_before_commit
    retry_after_seconds: int = RETRY_AFTER_SECONDS_DEFAULT  # sent with 429 and 503
    retry_after_format: RetryAfterFormat = RetryAfterFormat.SECONDS
    # Signed ticket.created events to a URL, with their own faults; url None: none sent.
    webhooks: webhooks_.WebhookConfig = field(default_factory=webhooks_.WebhookConfig)

    def __post_init__(self) -> None:
        # Accept the plain strings too ("honour", "abort"): a string compared by identity
        # with an enum member is never equal, and mode="honour" silently ran as ignore.
        for name, kind in (
            ("mode", Mode),
            ("drop_mode", DropMode),
            ("retry_after_format", RetryAfterFormat),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    choices = ", ".join(m.value for m in kind)
                    raise ConfigError(f"{name} must be one of {choices} (got {value!r})") from None

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a value that cannot work, naming field and bound."""
        if self.lookup_lag_ms < 0:
            raise ConfigError(f"lookup_lag_ms cannot be negative ({self.lookup_lag_ms})")
        if self.key_retention_seconds <= 0:
            raise ConfigError(
                f"key_retention_seconds must be positive ({self.key_retention_seconds})"
            )
        if self.hold_seconds < 0:
            raise ConfigError(f"hold_seconds cannot be negative ({self.hold_seconds})")
        if self.retry_after_seconds < 0:
            raise ConfigError(
                f"retry_after_seconds cannot be negative ({self.retry_after_seconds})"
            )
        try:
            self.webhooks.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        try:
            self.faults.validate()
        except faults.FaultSpecError as exc:
            raise ConfigError(f"faults: {exc}") from exc
