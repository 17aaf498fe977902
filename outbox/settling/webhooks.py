"""Provider webhooks as evidence: store each verified event once, settle its effect.

The receiver (``outbox.api.webhooks``) verifies the signature and reads the
event with the adapter's settings (``adapters.webhooks``); this module decides
what the event does, in one transaction with storing it:

- **deduplicated**: ``(adapter, event_id)`` is unique. A second delivery of an
  event (a provider retry, a duplicate) answers what the first did and changes
  nothing; so does a concurrent one (the unique key decides);
- **matched** by our effect key (the key or client reference the provider
  echoes) or, failing that, by the provider's reference, within the adapter;
- **settles** a ``pending``, ``in_flight`` or ``outcome_unknown`` effect to
  ``succeeded`` or ``failed`` through ``outbox.settle`` (compare-and-set,
  fence raised, never a send), with the event as evidence;
- **never reopens** a terminal effect: an event that agrees with it is
  ``confirmed``; one that contradicts it (failed for a succeeded effect,
  succeeded for a failed one, or another provider reference) is a
  ``conflict``, listed for a person (``conflicts``) and changing nothing;
- an event for an effect we do not know (yet) is kept ``unmatched``;
  ``match_unmatched`` (a reconciler sweep) tries again when the effect appears.

Out-of-order and late events are fine: whichever settling event comes first
settles, the later ones confirm or conflict, and nothing ever moves a
terminal effect.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection, Engine

import adapters
from outbox import db, schema, states
from outbox.settling import settle

logger = logging.getLogger("outbox.webhooks")

S = states.EffectStatus
D = states.WebhookDisposition
MATCH_BATCH_DEFAULT = 200


@dataclass(frozen=True, slots=True)
class Received:
    """What one delivery of an event did. ``duplicate``: the event was already stored."""

    event_id: str
    disposition: states.WebhookDisposition
    effect_id: int | None
    duplicate: bool
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "disposition": self.disposition.value,
            "effect_id": self.effect_id,
            "duplicate": self.duplicate,
            "detail": self.detail,
        }


def receive(
    engine: Engine, adapter: str, event: adapters.WebhookEvent, *, now: datetime
) -> Received:
    """Store ``event`` (once) and apply it; see the module docstring."""
    ev = schema.webhook_events
    try:
        with db.write(engine) as conn:
            found = _stored(conn, adapter, event.event_id)
            if found is not None:
                return _as_received(found, duplicate=True)
            event_row_id = conn.execute(
                sa.insert(ev)
                .values(
                    adapter=adapter,
                    event_id=event.event_id,
                    event_type=event.event_type,
                    outcome=event.outcome,
                    effect_key=event.effect_key,
                    provider_ref=event.provider_ref,
                    disposition=D.UNMATCHED,
                    signed_at=event.signed_at,
                    received_at=now,
                    body=event.body,
                )
                .returning(ev.c.id)
            ).scalar_one()
            disposition, effect, detail = _apply(
                conn, adapter, event.effect_key, event.provider_ref, event.outcome, event, now
            )
            _record(conn, event_row_id, disposition, effect, detail, now)
    except exc.IntegrityError:
        # The same event committed by a concurrent delivery between our check and insert.
        with db.read(engine) as conn:
            found = _stored(conn, adapter, event.event_id)
        if found is None:
            raise
        return _as_received(found, duplicate=True)
    effect_id = None if effect is None else int(effect.id)
    logger.info(
        "webhook %s %s (%s): %s effect %s",
        adapter,
        event.event_id,
        event.event_type,
        disposition.value,
        effect_id,
    )
    return Received(event.event_id, disposition, effect_id, False, detail)


def match_unmatched(engine: Engine, *, now: datetime, limit: int = MATCH_BATCH_DEFAULT) -> int:
    """Apply kept events whose effect has appeared since; how many found their effect."""
    ev = schema.webhook_events
    matched = 0
    with db.write(engine) as conn:
        query = (
            sa.select(ev)
            .where(ev.c.disposition == D.UNMATCHED)
            .order_by(ev.c.received_at, ev.c.id)
            .limit(limit)
        )
        if conn.dialect.name == "postgresql":
            query = query.with_for_update(skip_locked=True)
        for row in conn.execute(query).all():
            disposition, effect, detail = _apply(
                conn, row.adapter, row.effect_key, row.provider_ref, row.outcome, row, now
            )
            if disposition is not D.UNMATCHED:
                _record(conn, row.id, disposition, effect, detail, now)
                matched += 1
    return matched


def for_effect(conn: Connection, effect_id: int) -> list[dict[str, Any]]:
    """The events matched to one effect, oldest first: the evidence shown with it."""
    ev = schema.webhook_events
    rows = conn.execute(
        sa.select(ev).where(ev.c.effect_id == effect_id).order_by(ev.c.received_at, ev.c.id)
    ).all()
    return [_event_view(r) for r in rows]


def conflicts(
    engine: Engine, *, tenant: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Events that contradict a terminal effect: for a person, newest first."""
    ev = schema.webhook_events
    query = sa.select(ev).where(ev.c.disposition == D.CONFLICT)
    if tenant is not None:
        query = query.where(ev.c.tenant == tenant)
    with db.read(engine) as conn:
        rows = conn.execute(query.order_by(ev.c.received_at.desc(), ev.c.id.desc()).limit(limit))
        return [_event_view(r) for r in rows.all()]


# --- internals ---------------------------------------------------------------------


def _event_view(r: Any) -> dict[str, Any]:
    return {
        "id": r.id,
        "adapter": r.adapter,
        "event_id": r.event_id,
        "event_type": r.event_type,
        "outcome": r.outcome,
        "effect_key": r.effect_key,
        "provider_ref": r.provider_ref,
        "tenant": r.tenant,
        "effect_id": r.effect_id,
        "disposition": r.disposition,
        "detail": r.detail,
        "signed_at": r.signed_at.isoformat() if r.signed_at else None,
        "received_at": r.received_at.isoformat() if r.received_at else None,
        "processed_at": r.processed_at.isoformat() if r.processed_at else None,
    }


def _stored(conn: Connection, adapter: str, event_id: str) -> Any:
    ev = schema.webhook_events
    return conn.execute(
        sa.select(ev).where(ev.c.adapter == adapter, ev.c.event_id == event_id)
    ).first()


def _as_received(row: Any, *, duplicate: bool) -> Received:
    return Received(row.event_id, D(row.disposition), row.effect_id, duplicate, row.detail)


def _record(
    conn: Connection,
    event_row_id: int,
    disposition: states.WebhookDisposition,
    effect: Any,
    detail: str | None,
    now: datetime,
) -> None:
    ev = schema.webhook_events
    conn.execute(
        sa.update(ev)
        .where(ev.c.id == event_row_id)
        .values(
            disposition=disposition,
            effect_id=None if effect is None else effect.id,
            tenant=None if effect is None else effect.tenant,
            detail=detail,
            processed_at=None if disposition is D.UNMATCHED else now,
        )
    )


def _find_effect(
    conn: Connection, adapter: str, effect_key: str | None, provider_ref: str | None
) -> Any:
    out = schema.outbox
    locked = conn.dialect.name == "postgresql"
    candidates: Sequence[Any] = []
    if effect_key:
        query = sa.select(out).where(out.c.effect_key == effect_key, out.c.adapter == adapter)
        candidates = conn.execute(query.with_for_update() if locked else query).all()
    if not candidates and provider_ref:
        query = (
            sa.select(out)
            .where(out.c.adapter == adapter, out.c.provider_ref == provider_ref)
            .limit(2)
        )
        candidates = conn.execute(query.with_for_update() if locked else query).all()
    # Two effects with one provider reference cannot be told apart: match neither.
    return candidates[0] if len(candidates) == 1 else None


def _apply(
    conn: Connection,
    adapter: str,
    effect_key: str | None,
    provider_ref: str | None,
    outcome: str | None,
    event: Any,
    now: datetime,
) -> tuple[states.WebhookDisposition, Any, str | None]:
    effect = _find_effect(conn, adapter, effect_key, provider_ref)
    if effect is None:
        if outcome is None:
            return D.IGNORED, None, f"event type {event.event_type!r} settles nothing"
        return D.UNMATCHED, None, "no effect of ours matches it yet"
    if outcome is None:
        return D.IGNORED, effect, f"event type {event.event_type!r} settles nothing"
    says = S(outcome)
    status = S(effect.status)
    if status in states.TERMINAL:
        if status is not says:
            return (
                D.CONFLICT,
                effect,
                f"the event says {says.value}, the effect is {status.value}: not reopened",
            )
        if provider_ref and effect.provider_ref and provider_ref != effect.provider_ref:
            return (
                D.CONFLICT,
                effect,
                f"the event names {provider_ref!r}, the effect {effect.provider_ref!r}",
            )
        return D.CONFIRMED, effect, None
    succeeded = says is S.SUCCEEDED
    ref = provider_ref or effect.provider_ref
    if succeeded and not ref:
        return D.IGNORED, effect, "the event proves success but names no provider reference"
    written = settle.settle(
        conn,
        settle.Settlement(
            effect_id=effect.id,
            expected_status=status,
            expected_fence=effect.fence,
            to=says,
            # The reasons the provider's own answer would have given.
            reason=states.Reason.DELIVERED if succeeded else states.Reason.PERMANENT,
            source=states.SettleSource.WEBHOOK,
            at=now,
            provider_ref=ref if succeeded else None,
            error=None
            if succeeded
            else f"provider event {event.event_id} ({event.event_type}): failed",
        ),
    )
    if not written:  # pragma: no cover - the row is locked (PostgreSQL) / SQLite serialises
        return D.UNMATCHED, None, "the effect changed while the event was applied"
    return D.SETTLED, effect, f"{status.value} -> {says.value}"
