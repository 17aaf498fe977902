"""Ordering groups: which groups are held back, and by which effect.

Effects sharing (tenant, adapter, ordering_key) are delivered one at a time,
in creation order; the rule itself is in the claim statement
(``outbox.store``). This module only reads: for every group with effects
waiting behind an open one, the effect at its head and what it waits for.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox import db, schema, states

S = states.EffectStatus
LIMIT_DEFAULT = 100


class BlockedBy(StrEnum):
    """What the effect at the head of a group is waiting for."""

    REVIEW = "review"  # outcome unknown, and only a person can settle it
    OUTCOME_UNKNOWN = "outcome_unknown"  # outcome unknown, a lookup or webhook may settle it
    RETRY = "retry"  # pending after a failed attempt, until next_attempt_at
    IN_FLIGHT = "in_flight"  # being delivered now
    QUEUED = "queued"  # pending, first attempt: the group is moving, not stuck


def _blocked_by(head: Any) -> BlockedBy:
    if head.status == S.OUTCOME_UNKNOWN:
        return BlockedBy.REVIEW if head.needs_review else BlockedBy.OUTCOME_UNKNOWN
    if head.status == S.IN_FLIGHT:
        return BlockedBy.IN_FLIGHT
    return BlockedBy.RETRY if head.attempts > 0 else BlockedBy.QUEUED


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def blocked_groups(
    engine: Engine,
    *,
    tenant: str | None = None,
    adapter: str | None = None,
    include_queued: bool = False,
    limit: int = LIMIT_DEFAULT,
) -> list[dict[str, Any]]:
    """Groups with effects waiting behind an open one, most waiting first.

    Each: the group, how many effects wait, and its head (the open effect
    everything behind waits for) with ``blocked_by``. A group whose head is
    simply queued for its first attempt is left out unless ``include_queued``.
    """
    out = schema.outbox
    open_rows = sa.and_(out.c.ordering_key.is_not(None), out.c.status.not_in(states.TERMINAL))
    groups = (
        sa.select(
            out.c.tenant,
            out.c.adapter,
            out.c.ordering_key,
            sa.func.count().label("open"),
            sa.func.min(out.c.id).label("head_id"),
        )
        .where(open_rows)
        .group_by(out.c.tenant, out.c.adapter, out.c.ordering_key)
        .having(sa.func.count() > 1)
    )
    if tenant is not None:
        groups = groups.where(out.c.tenant == tenant)
    if adapter is not None:
        groups = groups.where(out.c.adapter == adapter)
    with db.read(engine) as conn:
        found = conn.execute(groups).all()
        heads = {}
        if found:
            ids = [g.head_id for g in found]
            heads = {r.id: r for r in conn.execute(sa.select(out).where(out.c.id.in_(ids))).all()}
    result = []
    for g in found:
        head = heads[g.head_id]
        blocked_by = _blocked_by(head)
        if blocked_by is BlockedBy.QUEUED and not include_queued:
            continue
        result.append(
            {
                "tenant": g.tenant,
                "adapter": g.adapter,
                "ordering_key": g.ordering_key,
                "waiting": int(g.open) - 1,
                "blocked_by": blocked_by.value,
                "head": {
                    "id": head.id,
                    "operation_id": head.operation_id,
                    "effect": head.effect,
                    "status": head.status,
                    "reason": head.reason,
                    "attempts": head.attempts,
                    "next_attempt_at": _iso(head.next_attempt_at)
                    if head.status == S.PENDING
                    else None,
                    "needs_review": bool(head.needs_review),
                    "last_error": head.last_error,
                    "created_at": _iso(head.created_at),
                },
            }
        )
    result.sort(key=lambda g: (-g["waiting"], g["head"]["id"]))
    return result[:limit]
