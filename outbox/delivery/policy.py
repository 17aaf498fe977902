"""What happens to an effect after each kind of event: pure functions, no I/O.

The dispatcher (after an attempt), the reconciler (lease expiry, deadlines,
lookups) and the review queue (operators) all decide here, so the rules of
DESIGN.md's state machine are written once:

- a send that may have happened at a provider that ignores idempotency keys
  is never resent automatically: ``outcome_unknown``, for a lookup or a person;
- at a provider that honours keys, an ambiguous send is retried with the same
  key, within the deadline and the attempt cap;
- "failed" means nothing happened downstream. An effect whose earlier attempt
  may have been sent is never marked failed by a timer or a later 4xx: it
  becomes ``outcome_unknown`` instead;
- only an authoritative "not found" (lookup) or an operator clears the
  may-have-been-sent evidence and so permits a resend;
- a provider that forgets keys after a window (``key_retention``) honours
  them only inside it: a resend due past ``key_expires_at`` is treated as one
  to a provider that ignores keys, so the effect goes to lookup instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from outbox.states import AttemptOutcome, EffectStatus, Reason

KEY_RETENTION_MARGIN_RATIO = 0.1
KEY_RETENTION_MARGIN_MAX = timedelta(minutes=5)
"""Stop resending this long before the provider's window closes (a tenth of it, at most
five minutes): the window runs from when the provider first saw the key, which is
after our first attempt started, but a resend also takes time to arrive."""


def key_expires_at(
    first_sent_at: datetime | None, retention_seconds: float | None
) -> datetime | None:
    """The last moment a resend with the same key is still deduplicated; None: no limit.

    ``first_sent_at`` is when the earliest attempt that may have reached the
    provider started (``attempts.started_at``): the provider's window began after it.
    """
    if first_sent_at is None or retention_seconds is None:
        return None
    retention = timedelta(seconds=retention_seconds)
    margin = min(retention * KEY_RETENTION_MARGIN_RATIO, KEY_RETENTION_MARGIN_MAX)
    return first_sent_at + retention - margin


def key_window_open(at: datetime, expires_at: datetime | None) -> bool:
    """May a resend at ``at`` rely on the provider still remembering the key?"""
    return expires_at is None or at < expires_at


KEY_RETENTION_PASSED = (
    "the provider's key retention has passed since the first send: a resend could make a "
    "second effect, so it is looked up instead"
)


@dataclass(frozen=True, slots=True)
class Decision:
    status: EffectStatus
    reason: Reason
    maybe_sent: bool
    next_attempt_at: datetime | None = None  # set when status is pending

    @property
    def terminal(self) -> bool:
        return self.status in (EffectStatus.SUCCEEDED, EffectStatus.FAILED)


DELIVERED = Decision(EffectStatus.SUCCEEDED, Reason.DELIVERED, True)
"""The decision after every delivered attempt, whatever came before it."""


def at_deadline(maybe_sent: bool, reason: Reason | None = None) -> Decision:
    """The effect may not be tried again: failed if nothing may have reached the provider."""
    if maybe_sent:
        return Decision(EffectStatus.OUTCOME_UNKNOWN, Reason.DEADLINE_MAY_HAVE_SENT, True)
    return Decision(EffectStatus.FAILED, reason or Reason.DEADLINE_NOTHING_SENT, False)


def after_attempt(
    *,
    outcome: AttemptOutcome,
    may_have_happened: bool,
    honours_keys: bool,
    maybe_sent_before: bool,
    attempts: int,
    max_attempts: int,
    retry_at: datetime,
    deadline_at: datetime,
    key_expires_at: datetime | None = None,
) -> Decision:
    """Decide the row's next state from one attempt's classified outcome.

    ``attempts`` counts this attempt. ``retry_at`` is when a retry would be due
    (backoff and Retry-After already applied); past ``deadline_at`` there is none.
    ``key_expires_at`` (see ``key_expires_at()``): a resend due at or after it
    is not protected by the key any more.
    """
    maybe_sent = maybe_sent_before or may_have_happened
    # The key protects a resend only inside the provider's retention window.
    honours_keys = honours_keys and key_window_open(retry_at, key_expires_at)
    if outcome is AttemptOutcome.DELIVERED:
        return DELIVERED
    if outcome is AttemptOutcome.PERMANENT:
        if maybe_sent_before:
            # An earlier send may have worked; this refusal does not say it did not.
            return Decision(EffectStatus.OUTCOME_UNKNOWN, Reason.PERMANENT, True)
        return Decision(EffectStatus.FAILED, Reason.PERMANENT, False)
    if outcome in (AttemptOutcome.AMBIGUOUS, AttemptOutcome.ABANDONED):
        reason = (
            Reason.LEASE_EXPIRED
            if outcome is AttemptOutcome.ABANDONED
            else Reason.AMBIGUOUS_KEYS_HONOURED
            if honours_keys
            else Reason.AMBIGUOUS_NO_KEY_SUPPORT
        )
        if not honours_keys:
            return Decision(EffectStatus.OUTCOME_UNKNOWN, reason, True)
        return _retry_or_stop(reason, True, attempts, max_attempts, retry_at, deadline_at)
    reason = {
        AttemptOutcome.NOT_SENT: Reason.NOT_SENT,
        AttemptOutcome.RETRYABLE: Reason.RETRYABLE,
        AttemptOutcome.ADAPTER_ERROR: Reason.ADAPTER_ERROR,
    }[outcome]
    if maybe_sent and not honours_keys:
        # A 409 "in progress" or similar at a provider that ignores keys: do not resend.
        return Decision(EffectStatus.OUTCOME_UNKNOWN, reason, True)
    return _retry_or_stop(reason, maybe_sent, attempts, max_attempts, retry_at, deadline_at)


def _retry_or_stop(
    reason: Reason,
    maybe_sent: bool,
    attempts: int,
    max_attempts: int,
    retry_at: datetime,
    deadline_at: datetime,
) -> Decision:
    if attempts >= max_attempts:
        return at_deadline(maybe_sent, Reason.MAX_ATTEMPTS)
    if retry_at >= deadline_at:
        return at_deadline(maybe_sent)
    return Decision(EffectStatus.PENDING, reason, maybe_sent, retry_at)


def after_lookup_not_found(*, now: datetime, deadline_at: datetime) -> Decision:
    """An authoritative "not found": it did not happen, so the same key may go again."""
    if now >= deadline_at:
        return Decision(EffectStatus.FAILED, Reason.DEADLINE_NOTHING_SENT, False)
    return Decision(EffectStatus.PENDING, Reason.LOOKUP_NOT_FOUND, False, now)


def before_resend(
    *, now: datetime, maybe_sent: bool, key_expires_at: datetime | None
) -> Decision | None:
    """At the claim of a due row: None to send it, or the decision that stops the resend.

    A row scheduled inside the key window may become due past it (the dispatcher
    was down, the backoff was long): once an earlier send may have reached the
    provider, a resend past the window could make a second effect.
    """
    if maybe_sent and not key_window_open(now, key_expires_at):
        return Decision(EffectStatus.OUTCOME_UNKNOWN, Reason.AMBIGUOUS_NO_KEY_SUPPORT, True)
    return None
