"""The adapter protocol: what the dispatcher and the reconciler may rely on.

An adapter delivers one external effect per call, always with the effect's own
downstream idempotency key (``DeliveryRequest.effect_key``), and says what
happened as a value (``DeliveryResult``). It never generates a key of its own.

Rules every adapter keeps (``tests/adapters/test_contract.py`` checks them):

- ``deliver()`` never raises for transport or provider problems: it classifies
  them. It may raise an ``AdapterError`` (``PayloadError``, ``AdapterClosed``),
  and only before anything was sent, so an exception from ``deliver()`` means
  "not sent".
- ``lookup()`` never raises for transport or provider problems: they are
  ``inconclusive``. ``not_found`` is authoritative: the caller may send again.
- Both are safe to call from many threads at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

ERROR_MAX_CHARS = 300
"""Longest ``error`` text kept on a result; longer text is cut with an ellipsis."""

IN_PROGRESS_STATUS = 409
"""A provider that honours keys answers 409 while an earlier request with the same
key is still being processed: that request may well take effect."""


class Outcome(StrEnum):
    """What one delivery attempt did, as far as the adapter can tell."""

    DELIVERED = "delivered"  # the provider confirmed the effect; provider_ref names it
    NOT_SENT = "not_sent"  # nothing left this process (or reached the provider): safe to resend
    RETRYABLE = "retryable"  # the provider asked us to come back later (retry_after)
    PERMANENT = "permanent"  # the provider refused the request as such; it did nothing
    AMBIGUOUS = "ambiguous"  # the request may have taken effect; we cannot tell


def _bounded(text: str | None) -> str | None:
    if text is None or len(text) <= ERROR_MAX_CHARS:
        return text
    return text[: ERROR_MAX_CHARS - 1] + "…"


@dataclass(frozen=True, slots=True)
class DeliveryRequest:
    """One attempt to deliver one effect. Built by the dispatcher."""

    effect_id: int
    effect_key: str  # the downstream idempotency key: fixed at creation, same on every attempt
    tenant: str
    operation_id: str
    effect: str  # effect name, e.g. "open_ticket"
    payload: Mapping[str, Any]  # JSON object built by the tool; the adapter adds the key
    attempt: int  # 1-based attempt number


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """The classified outcome of one delivery attempt.

    Use the named constructors; they keep the fields consistent (for example,
    only a RETRYABLE result carries ``retry_after``).
    """

    outcome: Outcome
    provider_ref: str | None = None
    status_code: int | None = None
    retry_after: float | None = None  # seconds, >= 0, only for RETRYABLE
    error: str | None = None  # short reason; bounded length; never carries secrets

    def __post_init__(self) -> None:
        if not isinstance(self.outcome, Outcome):
            object.__setattr__(self, "outcome", Outcome(self.outcome))
        if self.retry_after is not None:
            if self.outcome is not Outcome.RETRYABLE:
                raise ValueError(
                    f"retry_after is only meaningful for RETRYABLE, not {self.outcome}"
                )
            if not math.isfinite(self.retry_after) or self.retry_after < 0:
                raise ValueError(
                    f"retry_after must be a finite number >= 0, not {self.retry_after}"
                )
        if self.error is not None and len(self.error) > ERROR_MAX_CHARS:
            object.__setattr__(self, "error", _bounded(self.error))

    @classmethod
    def delivered(
        cls, provider_ref: str | None, *, status_code: int | None = None, error: str | None = None
    ) -> DeliveryResult:
        return cls(
            Outcome.DELIVERED, provider_ref=provider_ref, status_code=status_code, error=error
        )

    @classmethod
    def not_sent(cls, error: str, *, status_code: int | None = None) -> DeliveryResult:
        return cls(Outcome.NOT_SENT, status_code=status_code, error=error)

    @classmethod
    def retryable(
        cls, retry_after: float | None, *, status_code: int | None = None, error: str | None = None
    ) -> DeliveryResult:
        return cls(Outcome.RETRYABLE, status_code=status_code, retry_after=retry_after, error=error)

    @classmethod
    def permanent(cls, reason: str, *, status_code: int | None = None) -> DeliveryResult:
        return cls(Outcome.PERMANENT, status_code=status_code, error=reason)

    @classmethod
    def ambiguous(cls, reason: str, *, status_code: int | None = None) -> DeliveryResult:
        return cls(Outcome.AMBIGUOUS, status_code=status_code, error=reason)

    @property
    def may_have_happened(self) -> bool:
        """True when the provider may have acted on this key.

        DELIVERED and AMBIGUOUS: yes. NOT_SENT and PERMANENT: no. RETRYABLE: no,
        except a 409 "in progress", which says an earlier request with this key
        is being processed right now and may well take effect.
        """
        if self.outcome in (Outcome.DELIVERED, Outcome.AMBIGUOUS):
            return True
        return self.outcome is Outcome.RETRYABLE and self.status_code == IN_PROGRESS_STATUS


class LookupStatus(StrEnum):
    """What a lookup by effect key (or provider reference) found."""

    FOUND = "found"  # the effect exists at the provider; provider_ref names it
    NOT_FOUND = "not_found"  # authoritative: the provider has no such effect
    INCONCLUSIVE = "inconclusive"  # the lookup failed or its answer cannot be trusted


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The answer of ``Adapter.lookup``."""

    status: LookupStatus
    provider_ref: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, LookupStatus):
            object.__setattr__(self, "status", LookupStatus(self.status))
        if self.status is LookupStatus.FOUND and not self.provider_ref:
            raise ValueError("a FOUND lookup result needs a provider_ref")
        if self.error is not None and len(self.error) > ERROR_MAX_CHARS:
            object.__setattr__(self, "error", _bounded(self.error))

    @classmethod
    def found(cls, provider_ref: str) -> LookupResult:
        return cls(LookupStatus.FOUND, provider_ref=provider_ref)

    @classmethod
    def not_found(cls) -> LookupResult:
        return cls(LookupStatus.NOT_FOUND)

    @classmethod
    def inconclusive(cls, error: str) -> LookupResult:
        return cls(LookupStatus.INCONCLUSIVE, error=error)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the provider behind an adapter promises. Declared in configuration."""

    honours_idempotency_keys: bool  # a resend with the same key never makes a second effect
    supports_lookup: bool  # lookup() can find an effect by its key
    lookup_settle_seconds: float = 0.0  # wait this long after the last attempt before a lookup
    # How long the provider remembers a key (Stripe: 24 h). None: for ever. Past
    # it, a resend with the same key could make a second effect, so Outbox
    # stops resending and looks up instead (outbox.delivery.policy reads the window).
    key_retention_seconds: float | None = None

    def __post_init__(self) -> None:
        settle = self.lookup_settle_seconds
        if not math.isfinite(settle) or settle < 0:
            raise ValueError(f"lookup_settle_seconds must be a finite number >= 0, not {settle}")
        retention = self.key_retention_seconds
        if retention is not None and (not math.isfinite(retention) or retention <= 0):
            raise ValueError(f"key_retention_seconds must be a finite number > 0, not {retention}")


@runtime_checkable
class Adapter(Protocol):
    """Delivers effects to one downstream provider. See the module docstring."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        """Send one effect with ``request.effect_key``; classify what happened."""
        ...

    def lookup(self, effect_key: str, reference: str | None) -> LookupResult:
        """Ask the provider whether the effect with this key (or reference) exists."""
        ...

    def close(self) -> None:
        """Release connections. Safe to call twice."""
        ...
