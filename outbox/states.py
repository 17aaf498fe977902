"""The states of an effect (one outbox row) and the edges between them.

The diagram lives in DESIGN.md; ``TRANSITIONS`` mirrors it edge for edge, and
``check_transition`` is the one place Python refuses an edge that is not drawn.
The database refuses illegal *rows* (CHECK constraints in ``schema.py``); this
module refuses illegal *moves*.

Values are lowercase snake strings, the same in Python, SQL and JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class EffectStatus(StrEnum):
    # HELD: waiting for an operator's approval (the tool requires one). Not
    # claimable: the claim takes pending rows only. Approval releases it to
    # pending (same key); rejection fails it. Nothing was ever sent.
    HELD = "held"
    # PENDING: waiting for next_attempt_at. effect_key is fixed. The dispatcher
    # claims it; the deadline sweep may fail it or mark it outcome_unknown.
    PENDING = "pending"
    # IN_FLIGHT: leased by one dispatcher (lease_owner, lease_expires_at, fence).
    # An attempt row may be open. The holder records the result; if the lease
    # expires, the reconciler decides as the dispatcher would have.
    IN_FLIGHT = "in_flight"
    # SUCCEEDED: the provider confirmed the effect; provider_ref is kept. Terminal.
    SUCCEEDED = "succeeded"
    # FAILED: permanent; nothing happened downstream (or an operator abandoned
    # it). Terminal.
    FAILED = "failed"
    # OUTCOME_UNKNOWN: a send may have happened and no automatic resend is safe.
    # A lookup (reconciler) or an operator (review queue) moves it out.
    OUTCOME_UNKNOWN = "outcome_unknown"


class Reason(StrEnum):
    """Why a row is in its state: two edges can end in the same state."""

    CREATED = "created"
    CLAIMED = "claimed"
    DELIVERED = "delivered"
    PERMANENT = "permanent"
    NOT_SENT = "not_sent"
    RETRYABLE = "retryable"
    AMBIGUOUS_KEYS_HONOURED = "ambiguous_keys_honoured"
    AMBIGUOUS_NO_KEY_SUPPORT = "ambiguous_no_key_support"
    LEASE_EXPIRED = "lease_expired"
    RELEASED = "released"
    DEADLINE_NOTHING_SENT = "deadline_nothing_sent"
    DEADLINE_MAY_HAVE_SENT = "deadline_may_have_sent"
    MAX_ATTEMPTS = "max_attempts"
    ADAPTER_ERROR = "adapter_error"
    LOOKUP_FOUND = "lookup_found"
    LOOKUP_NOT_FOUND = "lookup_not_found"
    REVIEW_NO_LOOKUP = "review_no_lookup"  # the adapter cannot look up: a person decides
    REVIEW_LOOKUP_EXHAUSTED = "review_lookup_exhausted"  # lookups stayed inconclusive
    OPERATOR_HAPPENED = "operator_happened"
    OPERATOR_REQUEUE = "operator_requeue"
    OPERATOR_ABANDON = "operator_abandon"
    AWAITING_APPROVAL = "awaiting_approval"  # created held: the tool requires approval
    APPROVED = "approved"  # an operator approved: released to the dispatcher
    REJECTED = "rejected"  # an operator rejected: never sent


class ApprovalStatus(StrEnum):
    """Where an approval-required operation stands. Approved and rejected are final."""

    AWAITING_APPROVAL = "awaiting_approval"  # its effects are held
    APPROVED = "approved"  # its effects were released to the dispatcher
    REJECTED = "rejected"  # its effects failed without being sent


class ApprovalDecision(StrEnum):
    APPROVE = "approve"
    REJECT = "reject"


class ReviewChoice(StrEnum):
    """What an operator may say about an effect whose outcome is unknown."""

    HAPPENED = "happened"  # it happened downstream: succeeded, with the provider's reference
    NOT_HAPPENED_REQUEUE = "not_happened_requeue"  # it did not: deliver again, same key
    NOT_HAPPENED_ABANDON = "not_happened_abandon"  # it did not, and must not: failed


class AttemptOutcome(StrEnum):
    """How one delivery attempt ended (the adapter's classification, plus ours)."""

    DELIVERED = "delivered"
    NOT_SENT = "not_sent"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    AMBIGUOUS = "ambiguous"
    ADAPTER_ERROR = "adapter_error"  # the adapter raised before sending (a bug or a bad payload)
    ABANDONED = "abandoned"  # the worker died or lost its lease: the send may have happened


class LookupOutcome(StrEnum):
    FOUND = "found"
    NOT_FOUND = "not_found"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"


class SettleSource(StrEnum):
    """Which source of evidence settled an effect (``outbox.settle``)."""

    LOOKUP = "lookup"
    WEBHOOK = "webhook"
    OPERATOR = "operator"


class WebhookDisposition(StrEnum):
    """What a received provider event did."""

    UNMATCHED = "unmatched"  # no effect of ours matches it (yet): kept, matched later
    SETTLED = "settled"  # it settled its effect to succeeded or failed
    CONFIRMED = "confirmed"  # its effect had already ended as the event says
    CONFLICT = "conflict"  # it contradicts a terminal effect: for a person to look at
    IGNORED = "ignored"  # its type proves nothing (or it names no effect)


class Role(StrEnum):
    AGENT = "agent"
    OPERATOR = "operator"


class TaskPriority(StrEnum):
    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"


S = EffectStatus
TERMINAL: frozenset[EffectStatus] = frozenset({S.SUCCEEDED, S.FAILED})
SETTLEABLE: frozenset[EffectStatus] = frozenset({S.PENDING, S.IN_FLIGHT, S.OUTCOME_UNKNOWN})
"""The states evidence (a lookup, a webhook, an operator) may settle from (``outbox.settle``)."""

TRANSITIONS: Mapping[EffectStatus, frozenset[EffectStatus]] = {
    # operator approves (released, same key) / operator rejects (never sent)
    S.HELD: frozenset({S.PENDING, S.FAILED}),
    # claim; past deadline; settled by evidence (a provider webhook) before it was sent again
    S.PENDING: frozenset({S.IN_FLIGHT, S.FAILED, S.OUTCOME_UNKNOWN, S.SUCCEEDED}),
    # 2xx, permanent, reschedule (same key), ambiguous without key support,
    # lease expired (reconciler decides as above)
    S.IN_FLIGHT: frozenset({S.SUCCEEDED, S.FAILED, S.PENDING, S.OUTCOME_UNKNOWN}),
    # lookup found / operator happened; lookup not found or operator requeue;
    # past deadline or operator abandon
    S.OUTCOME_UNKNOWN: frozenset({S.SUCCEEDED, S.PENDING, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
}


class IllegalTransition(ValueError):
    """An edge that DESIGN.md does not draw."""

    def __init__(self, before: EffectStatus, after: EffectStatus) -> None:
        super().__init__(f"no edge {before.value} -> {after.value} in the effect state machine")
        self.before = before
        self.after = after


def check_transition(before: EffectStatus, after: EffectStatus) -> None:
    if after not in TRANSITIONS[before]:
        raise IllegalTransition(before, after)
