"""The one settle step: evidence moves an effect to succeeded or failed.

A lookup, a provider webhook and an operator are three sources of evidence for
the same edges of the state machine: out of ``pending``, ``in_flight`` or
``outcome_unknown``, into ``succeeded`` or ``failed``. They all go through
``settle``, so they share its guarantees:

- **compare-and-set**: the row is written only if it is still in the state,
  and under the fence, the source read (plus any guard of its own, such as the
  lookup count). Zero rows written means "it moved on": the caller keeps its
  evidence and changes nothing else;
- **never reopens a terminal effect**: the expected state must be one of
  ``states.SETTLEABLE``, and the target one of ``states.TERMINAL``;
- **never sends**: it writes one row; nothing here talks to a provider;
- **fences off the dispatcher**: the fence is raised, so a dispatcher that
  still holds the effect (``in_flight``) finds its fence gone and only records
  its attempt, marked late;
- the caller stores its evidence (the lookup row, the webhook event, the
  operator's audit row) in the same transaction, on the same connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox import schema, states

S = states.EffectStatus


@dataclass(frozen=True, slots=True)
class Settlement:
    """What a source of evidence says about one effect, and what it read first."""

    effect_id: int
    expected_status: states.EffectStatus
    expected_fence: int
    to: states.EffectStatus  # succeeded or failed
    reason: states.Reason
    source: states.SettleSource
    at: datetime
    provider_ref: str | None = None  # required for succeeded
    error: str | None = None
    maybe_sent: bool | None = None  # None: keep the row's


def check(settlement: Settlement) -> None:
    """Refuse an edge the settle step does not own (a bug in the caller, never data)."""
    if settlement.expected_status not in states.SETTLEABLE:
        raise states.IllegalTransition(settlement.expected_status, settlement.to)
    if settlement.to not in states.TERMINAL:
        raise states.IllegalTransition(settlement.expected_status, settlement.to)
    states.check_transition(settlement.expected_status, settlement.to)
    if settlement.to is S.SUCCEEDED and not settlement.provider_ref:
        raise ValueError(f"effect {settlement.effect_id}: succeeded needs a provider_ref")
    if settlement.at.tzinfo is None:
        raise ValueError(f"naive datetime {settlement.at!r}: pass a timezone-aware UTC datetime")


def settle(
    conn: Connection, settlement: Settlement, guard: Sequence[sa.ColumnElement[bool]] = ()
) -> bool:
    """Write ``settlement`` if the row is as its source read it; True if it was written.

    Runs on the caller's connection, inside its transaction, so the evidence
    the caller stores commits with the change (or both roll back).
    """
    check(settlement)
    out = schema.outbox
    values: dict[str, Any] = {
        "status": settlement.to,
        "reason": settlement.reason,
        "settled_by": settlement.source,
        "finished_at": settlement.at,
        "last_error": settlement.error,
        "needs_review": False,
        "review_since": None,
        "next_lookup_at": None,
        "lease_owner": None,
        "lease_expires_at": None,
        # A dispatcher still holding it loses its fence: its result becomes late.
        "fence": out.c.fence + 1,
        "updated_at": settlement.at,
    }
    if settlement.provider_ref is not None:
        values["provider_ref"] = settlement.provider_ref
    if settlement.maybe_sent is not None:
        values["maybe_sent"] = settlement.maybe_sent
    result = conn.execute(
        sa.update(out)
        .where(
            out.c.id == settlement.effect_id,
            out.c.status == settlement.expected_status,
            out.c.fence == settlement.expected_fence,
            *guard,
        )
        .values(**values)
    )
    return bool(result.rowcount == 1)
