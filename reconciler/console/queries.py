"""The reads behind the console pages. All of them are scoped to one tenant.

The queue is the same set of rows as ``review.list_items`` (every
``outcome_unknown`` effect), read here with an age filter and ordered oldest
first, because the console's question is "what has waited longest?". The age
of an item is the age of its effect: how long the caller has been waiting.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import db, schema, states
from outbox.service import Principal
from reconciler import review

S = states.EffectStatus
QUEUE_LIMIT = 200
OVERVIEW_WINDOW = timedelta(hours=1)


def principal_for(
    engine: Engine, token_sha256: str, now: datetime | None = None
) -> Principal | None:
    """The operator behind a session, read again on every request: a revoked
    token ends its sessions at once. ``Outbox.authenticate`` takes the token
    itself, which the session deliberately does not keep."""
    t = schema.api_tokens
    with db.read(engine) as conn:
        row = conn.execute(
            sa.select(
                t.c.id,
                t.c.token_sha256,
                t.c.tenant,
                t.c.role,
                t.c.label,
                t.c.revoked_at,
                t.c.expires_at,
            ).where(t.c.token_sha256 == token_sha256)
        ).first()
    if row is None or not hmac.compare_digest(row.token_sha256, token_sha256):
        return None
    if row.revoked_at is not None:
        return None
    if row.expires_at is not None and row.expires_at <= (now or schema.utcnow()):
        return None  # an expired token ends its sessions too
    return Principal(
        tenant=row.tenant, role=states.Role(row.role), token_id=row.id, label=row.label or ""
    )


def revoked_at(engine: Engine, token_sha256: str) -> datetime | None:
    """When the token with this hash was revoked; None if it is unknown or still valid."""
    t = schema.api_tokens
    with db.read(engine) as conn:
        value: datetime | None = conn.execute(
            sa.select(t.c.revoked_at).where(t.c.token_sha256 == token_sha256)
        ).scalar()
    return value


# --- search -------------------------------------------------------------------

SEARCH_MAX = 500  # the longest provider reference the schema keeps
SEARCH_LIMIT = 50  # per kind of match


@dataclass(frozen=True, slots=True)
class Hit:
    """One thing the search text names exactly, in the operator's tenant."""

    kind: str  # "operation" or "effect"
    matched: str  # what it matched: "operation id", "effect key", "provider reference"
    operation_id: str
    effect_id: int | None = None
    effect: str | None = None
    adapter: str | None = None
    status: str | None = None
    detail: str = ""  # where the reference was seen, when not on the effect itself


def search(engine: Engine, tenant: str, text: str) -> list[Hit]:
    """Operations and effects whose operation id, effect key or provider reference is
    exactly ``text``, in ``tenant`` only: another tenant's key finds nothing.

    Operation ids and effect keys are indexed. Provider references are not (a
    lookup by reference is an operator's rare question, not a hot path): that
    part reads the tenant's effects, their attempts and lookups.
    """
    ops, tomb, out = schema.operations, schema.tombstones, schema.outbox
    att, lk = schema.attempts, schema.lookups
    effect_cols = (out.c.id, out.c.operation_id, out.c.effect, out.c.adapter, out.c.status)
    hits: list[Hit] = []
    seen: set[int] = set()

    def effects(rows: Any, matched: str, detail: Any = None) -> None:
        for r in rows:
            if r.id in seen:
                continue
            seen.add(r.id)
            where = detail(r) if detail else ""
            hits.append(
                Hit("effect", matched, r.operation_id, r.id, r.effect, r.adapter, r.status, where)
            )

    with db.read(engine) as conn:
        op = conn.execute(
            sa.select(ops.c.operation_id, ops.c.tool, ops.c.status_code).where(
                ops.c.tenant == tenant, ops.c.operation_id == text
            )
        ).first()
        if op is not None:
            hits.append(Hit("operation", "operation id", op.operation_id, detail=op.tool))
        elif conn.execute(
            sa.select(tomb.c.operation_id).where(
                tomb.c.tenant == tenant, tomb.c.operation_id == text
            )
        ).first():
            hits.append(Hit("operation", "operation id", text, status="expired"))
        mine = out.c.tenant == tenant
        effects(
            conn.execute(sa.select(*effect_cols).where(mine, out.c.effect_key == text)),
            "effect key",
        )
        effects(
            conn.execute(
                sa.select(*effect_cols)
                .where(mine, out.c.provider_ref == text)
                .order_by(out.c.id)
                .limit(SEARCH_LIMIT)
            ),
            "provider reference",
        )
        effects(
            conn.execute(
                sa.select(*effect_cols, att.c.attempt_no)
                .select_from(att.join(out, att.c.effect_id == out.c.id))
                .where(mine, att.c.provider_ref == text)
                .order_by(out.c.id, att.c.attempt_no)
                .limit(SEARCH_LIMIT)
            ),
            "provider reference",
            lambda r: f"reported by attempt {r.attempt_no}",
        )
        effects(
            conn.execute(
                sa.select(*effect_cols)
                .select_from(lk.join(out, lk.c.effect_id == out.c.id))
                .where(mine, lk.c.provider_ref == text)
                .order_by(out.c.id)
                .limit(SEARCH_LIMIT)
            ),
            "provider reference",
            lambda r: "found by a lookup",
        )
    return hits


@dataclass(frozen=True, slots=True)
class Filters:
    tenant: str
    adapter: str | None = None
    group: review.Group | None = None
    min_age: timedelta | None = None


@dataclass(frozen=True, slots=True)
class GroupSummary:
    group: review.Group
    count: int
    oldest_age: timedelta | None


@dataclass(frozen=True, slots=True)
class Queue:
    items: list[dict[str, Any]]
    summaries: list[GroupSummary]
    adapters: list[str]  # every adapter with an item in the queue, for the filter
    truncated: bool
    now: datetime


def _unknown(filters: Filters, now: datetime) -> list[sa.ColumnElement[bool]]:
    out = schema.outbox
    where = [out.c.status == S.OUTCOME_UNKNOWN, out.c.tenant == filters.tenant]
    if filters.adapter:
        where.append(out.c.adapter == filters.adapter)
    if filters.min_age is not None:
        where.append(out.c.created_at <= now - filters.min_age)
    return where


def queue(engine: Engine, filters: Filters, now: datetime) -> Queue:
    out = schema.outbox
    where = _unknown(filters, now)
    listed = list(where)
    if filters.group is not None:
        listed.append(out.c.needs_review.is_(filters.group is review.Group.AWAITING_REVIEW))
    with db.read(engine) as conn:
        rows = conn.execute(
            sa.select(out)
            .where(*listed)
            .order_by(out.c.created_at, out.c.id)
            .limit(QUEUE_LIMIT + 1)
        ).all()
        counts = conn.execute(
            sa.select(out.c.needs_review, sa.func.count(), sa.func.min(out.c.created_at))
            .where(*where)
            .group_by(out.c.needs_review)
        ).all()
        names = conn.execute(
            sa.select(out.c.adapter)
            .where(out.c.status == S.OUTCOME_UNKNOWN, out.c.tenant == filters.tenant)
            .distinct()
            .order_by(out.c.adapter)
        ).scalars()
        adapter_names = list(names)
    by_group = {review.Group.AWAITING_REVIEW: (0, None), review.Group.AWAITING_LOOKUP: (0, None)}
    for needs_review, count, oldest in counts:
        group = review.Group.AWAITING_REVIEW if needs_review else review.Group.AWAITING_LOOKUP
        by_group[group] = (count, oldest)
    summaries = [
        GroupSummary(group, count, None if oldest is None else now - oldest)
        for group, (count, oldest) in by_group.items()
    ]
    items = [_queue_item(r, now) for r in rows[:QUEUE_LIMIT]]
    return Queue(items, summaries, adapter_names, len(rows) > QUEUE_LIMIT, now)


def _queue_item(row: Any, now: datetime) -> dict[str, Any]:
    return {
        "id": row.id,
        "group": review.Group.AWAITING_REVIEW if row.needs_review else review.Group.AWAITING_LOOKUP,
        "tenant": row.tenant,
        "operation_id": row.operation_id,
        "effect": row.effect,
        "adapter": row.adapter,
        "attempts": row.attempts,
        "reason": row.reason,
        "last_error": row.last_error,
        "created_at": row.created_at,
        "age": now - row.created_at,
        "review_since": row.review_since,
        "next_lookup_at": row.next_lookup_at,
    }


# --- the overview -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Overview:
    pending: int
    in_flight: int
    unknown: int
    awaiting_review: int
    oldest_pending_age: timedelta | None
    outcomes: list[tuple[str, int]]  # every attempt outcome, in a fixed order
    window: timedelta
    now: datetime


def overview(engine: Engine, tenant: str, now: datetime) -> Overview:
    out, att = schema.outbox, schema.attempts
    live = [S.PENDING, S.IN_FLIGHT, S.OUTCOME_UNKNOWN]
    with db.read(engine) as conn:
        rows = conn.execute(
            sa.select(out.c.status, out.c.needs_review, sa.func.count())
            .where(out.c.tenant == tenant, out.c.status.in_(live))
            .group_by(out.c.status, out.c.needs_review)
        ).all()
        oldest = conn.execute(
            sa.select(sa.func.min(out.c.created_at)).where(
                out.c.tenant == tenant, out.c.status == S.PENDING
            )
        ).scalar()
        outcomes = conn.execute(
            sa.select(att.c.outcome, sa.func.count())
            .select_from(att.join(out, att.c.effect_id == out.c.id))
            .where(
                out.c.tenant == tenant,
                att.c.finished_at.is_not(None),
                att.c.finished_at > now - OVERVIEW_WINDOW,
                att.c.finished_at <= now,
            )
            .group_by(att.c.outcome)
        ).all()
    counts = {S.PENDING: 0, S.IN_FLIGHT: 0, S.OUTCOME_UNKNOWN: 0}
    awaiting_review = 0
    for status, needs_review, count in rows:
        counts[S(status)] += count
        if needs_review:
            awaiting_review += count
    by_outcome = {str(outcome): count for outcome, count in outcomes}
    return Overview(
        pending=counts[S.PENDING],
        in_flight=counts[S.IN_FLIGHT],
        unknown=counts[S.OUTCOME_UNKNOWN],
        awaiting_review=awaiting_review,
        oldest_pending_age=None if oldest is None else now - oldest,
        outcomes=[(o.value, by_outcome.get(o.value, 0)) for o in states.AttemptOutcome],
        window=OVERVIEW_WINDOW,
        now=now,
    )
