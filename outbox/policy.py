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
  may-have-been-sent evidence and so permits a resend.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from outbox.states import AttemptOutcome, EffectStatus, Reason


@dataclass(frozen=True, slots=True)
class Decision:
    status: EffectStatus
    reason: Reason
    maybe_sent: bool
    next_attempt_at: datetime | None = None  # set when status is pending

    @property
    def terminal(self) -> bool:
        return self.status in (EffectStatus.SUCCEEDED, EffectStatus.FAILED)


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
) -> Decision:
    """Decide the row's next state from one attempt's classified outcome.

    ``attempts`` counts this attempt. ``retry_at`` is when a retry would be due
    (backoff and Retry-After already applied); past ``deadline_at`` there is none.
    """
    maybe_sent = maybe_sent_before or may_have_happened
    if outcome is AttemptOutcome.DELIVERED:
        return Decision(EffectStatus.SUCCEEDED, Reason.DELIVERED, True)
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
