"""Bulk operator actions: one filtered decision over many review items.

After a provider outage an operator may face hundreds of unknown outcomes with
one explanation. ``run`` selects the ``outcome_unknown`` effects of a tenant by
filter (adapter, problem type = the item's ``reason``, age) and applies one
action to each:

- ``resolve``: the operator's answer for all of them, ``happened`` (succeeded,
  through the shared settle step; the item's own provider reference, or a
  marker naming the bulk action) or ``requeue`` (not happened: pending again,
  same key);
- ``retry-lookup``: back to the lookup sweep with a fresh lookup budget (for
  when the provider's lookup works again);
- ``abandon``: failed, through the shared settle step.

Guarantees:

- **dry run**: ``dry_run=True`` counts what the filter selects and writes nothing;
- **compare-and-set per item**: each item is changed in its own transaction,
  only if it is still ``outcome_unknown`` under the fence it had; one that
  moved on is recorded as ``skipped`` and left alone;
- **audited per item**: one ``bulk_action_items`` row for every item, applied
  or skipped (and, for resolve and abandon, the usual ``review_actions`` row,
  action id ``<bulk_id>:<effect_id>``, so the item's page shows it);
- **idempotent on the bulk id**: the selection is frozen with the bulk id
  when first run. The same bulk id again resumes an interrupted run or, once
  finished, answers the recorded result and changes nothing; with another
  filter or action it is a conflict.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection, Engine

from outbox import db, errors, schema, settings, states
from reconciler import review

logger = logging.getLogger("reconciler.bulk")

S = states.EffectStatus
SELECT_MAX = 10_000
"""At most this many items per bulk action; narrow the filter for more."""
BULK_ID_MAX = 80  # leaves room for ":<effect id>" in a 100-character action id
SAMPLE = 20


class Action(StrEnum):
    RESOLVE = "resolve"
    RETRY_LOOKUP = "retry-lookup"
    ABANDON = "abandon"


class Resolution(StrEnum):
    """What ``resolve`` says about every selected item."""

    HAPPENED = "happened"
    REQUEUE = "requeue"


@dataclass(frozen=True, slots=True)
class Filter:
    tenant: str
    adapter: str | None = None
    problem: str | None = None  # the item's reason, e.g. review_no_lookup
    older_than: timedelta | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "adapter": self.adapter,
            "problem": self.problem,
            "older_than_seconds": None
            if self.older_than is None
            else self.older_than.total_seconds(),
        }


@dataclass(frozen=True, slots=True)
class Result:
    bulk_id: str | None
    action: str
    dry_run: bool
    selected: int
    applied: int = 0
    skipped: int = 0
    replayed: bool = False
    sample: list[int] = field(default_factory=list)  # the first selected effect ids

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(
    action: Action,
    resolution: Resolution | None,
    reason: str,
    actor: str,
    bulk_id: str | None,
    where: Filter,
) -> None:
    problems: list[dict[str, Any]] = []
    texts = {
        "reason": reason,
        "actor": actor,
        "bulk_id": bulk_id,
        "tenant": where.tenant,
        "adapter": where.adapter,
        "problem": where.problem,
    }
    for name, text in texts.items():
        # PostgreSQL text refuses NUL: a 422 here instead of a 500 from the driver.
        if text and "\x00" in text:
            problems.append({"field": name, "message": "must not contain NUL characters"})
    if where.older_than is not None and where.older_than < timedelta(0):
        problems.append({"field": "older_than", "message": "must not be negative"})
    if action is Action.RESOLVE and resolution is None:
        problems.append(
            {"field": "resolution", "message": "resolve needs happened or requeue for all items"}
        )
    if action is not Action.RESOLVE and resolution is not None:
        problems.append({"field": "resolution", "message": "only with the resolve action"})
    if not reason.strip():
        problems.append({"field": "reason", "message": "say why: the reason is kept in the audit"})
    if not actor.strip():
        problems.append({"field": "actor", "message": "who is acting"})
    if bulk_id is not None and (
        not bulk_id or len(bulk_id) > BULK_ID_MAX or not bulk_id.isprintable()
    ):
        problems.append({"field": "bulk_id", "message": f"1-{BULK_ID_MAX} printable characters"})
    if problems:
        raise errors.InvalidArguments(problems, "invalid bulk action; nothing changed")


def select(
    conn: Connection, where: Filter, now: datetime, limit: int = SELECT_MAX + 1
) -> list[int]:
    """The ids of the ``outcome_unknown`` effects the filter selects, oldest first."""
    out = schema.outbox
    since = sa.func.coalesce(out.c.review_since, out.c.updated_at)
    query = sa.select(out.c.id).where(
        out.c.status == S.OUTCOME_UNKNOWN, out.c.tenant == where.tenant
    )
    if where.adapter is not None:
        query = query.where(out.c.adapter == where.adapter)
    if where.problem is not None:
        query = query.where(out.c.reason == where.problem)
    if where.older_than is not None:
        query = query.where(since <= now - where.older_than)
    return list(conn.execute(query.order_by(since, out.c.id).limit(limit)).scalars())


def run(
    engine: Engine,
    where: Filter,
    *,
    action: Action | str,
    reason: str,
    actor: str,
    bulk_id: str | None = None,
    resolution: Resolution | str | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
    effect_deadline: timedelta = settings.EFFECT_DEADLINE_DEFAULT,
) -> Result:
    """Apply ``action`` to every item ``where`` selects (see the module docstring)."""
    action = Action(action)
    resolution = None if resolution is None else Resolution(resolution)
    reason = (reason or "").strip()
    _check(action, resolution, reason, actor, None if dry_run else bulk_id, where)
    if where.problem is not None and where.problem not in {r.value for r in states.Reason}:
        raise errors.InvalidArguments(
            [{"field": "problem", "message": f"not a problem type: {where.problem!r}"}]
        )
    at = now or schema.utcnow()
    if dry_run:
        with db.read(engine) as conn:
            ids = select(conn, where, at)
        return Result(None, action.value, True, len(ids[:SELECT_MAX]), sample=ids[:SAMPLE])
    if bulk_id is None:
        raise errors.InvalidArguments(
            [{"field": "bulk_id", "message": "required: repeat it to retry the action safely"}]
        )
    frozen = {
        "action": action.value,
        "resolution": None if resolution is None else resolution.value,
        "filter": where.to_json(),
        "reason": reason,
    }
    ids, finished = _freeze(engine, bulk_id, where, frozen, actor, at)
    if finished is not None:
        return finished
    for effect_id in ids:
        _apply_one(
            engine,
            bulk_id,
            effect_id,
            where.tenant,
            action,
            resolution,
            reason,
            actor,
            at,
            effect_deadline,
        )
    applied, skipped = _finish(engine, bulk_id, at)
    logger.info(
        "bulk %s (%s): %s applied, %s skipped of %s",
        bulk_id,
        action.value,
        applied,
        skipped,
        len(ids),
    )
    return Result(bulk_id, action.value, False, len(ids), applied, skipped, sample=ids[:SAMPLE])


def _freeze(
    engine: Engine,
    bulk_id: str,
    where: Filter,
    frozen: dict[str, Any],
    actor: str,
    at: datetime,
) -> tuple[list[int], Result | None]:
    """The selection of this bulk id: chosen now, or as it was first chosen."""
    ba = schema.bulk_actions
    text = json.dumps(frozen, sort_keys=True)
    for _ in range(2):
        try:
            with db.write(engine) as conn:
                row = conn.execute(sa.select(ba).where(ba.c.bulk_id == bulk_id)).first()
                if row is None:
                    ids = select(conn, where, at)
                    if len(ids) > SELECT_MAX:
                        raise errors.InvalidArguments(
                            [
                                {
                                    "field": "filter",
                                    "message": f"selects more than {SELECT_MAX} items; narrow it",
                                }
                            ]
                        )
                    conn.execute(
                        sa.insert(ba).values(
                            bulk_id=bulk_id,
                            tenant=where.tenant,
                            action=frozen["action"],
                            filter=text,
                            effect_ids=json.dumps(ids),
                            actor=actor,
                            reason=frozen["reason"],
                            at=at,
                        )
                    )
                    return ids, None
                if row.tenant != where.tenant or row.filter != text:
                    raise errors.ReviewConflict(
                        0,
                        expected="a new bulk id",
                        actual=f"bulk action {bulk_id!r} already recorded",
                        detail=(
                            f"bulk id {bulk_id!r} was already used for a different action or "
                            "filter; use a new bulk id for a new action; nothing changed"
                        ),
                    )
                ids = list(json.loads(row.effect_ids))
                if row.finished_at is not None:
                    return ids, Result(
                        bulk_id,
                        row.action,
                        False,
                        len(ids),
                        row.applied,
                        row.skipped,
                        replayed=True,
                        sample=ids[:SAMPLE],
                    )
                return ids, None  # an interrupted run: resume it
        except exc.IntegrityError:
            continue  # the same bulk id inserted concurrently: read what it froze
    raise errors.Busy()


def _apply_one(
    engine: Engine,
    bulk_id: str,
    effect_id: int,
    tenant: str,
    action: Action,
    resolution: Resolution | None,
    reason: str,
    actor: str,
    at: datetime,
    effect_deadline: timedelta,
) -> None:
    items = schema.bulk_action_items
    try:
        with db.write(engine) as conn:
            done = conn.execute(
                sa.select(items.c.id).where(
                    items.c.bulk_id == bulk_id, items.c.effect_id == effect_id
                )
            ).first()
            if done is not None:
                return  # applied (or skipped) by an earlier run of this bulk id
            out = schema.outbox
            query = sa.select(out).where(out.c.id == effect_id, out.c.tenant == tenant)
            if conn.dialect.name == "postgresql":
                query = query.with_for_update()
            row = conn.execute(query).first()
            if row is None:
                return  # pruned since: nothing to do, nothing to record against
            after, detail = _change(
                conn, row, action, resolution, bulk_id, reason, actor, at, effect_deadline
            )
            conn.execute(
                sa.insert(items).values(
                    bulk_id=bulk_id,
                    effect_id=effect_id,
                    action=action.value,
                    outcome="skipped" if after is None else "applied",
                    status_before=row.status,
                    status_after=row.status if after is None else after.value,
                    detail=detail,
                    actor=actor,
                    at=at,
                )
            )
    except exc.IntegrityError:
        return  # a concurrent run of this bulk id recorded the item first; ours rolled back


def _change(
    conn: Connection,
    row: Any,
    action: Action,
    resolution: Resolution | None,
    bulk_id: str,
    reason: str,
    actor: str,
    at: datetime,
    effect_deadline: timedelta,
) -> tuple[states.EffectStatus | None, str | None]:
    """Change one item as it was read (compare-and-set); the state after, or None."""
    if row.status != S.OUTCOME_UNKNOWN:
        return None, f"no longer outcome_unknown ({row.status}); left alone"
    out = schema.outbox
    if action is Action.RETRY_LOOKUP:
        result = conn.execute(
            sa.update(out)
            .where(out.c.id == row.id, out.c.status == S.OUTCOME_UNKNOWN, out.c.fence == row.fence)
            .values(
                needs_review=False,
                review_since=None,
                lookup_attempts=0,
                next_lookup_at=at,
                updated_at=at,
            )
        )
        return (S.OUTCOME_UNKNOWN if result.rowcount == 1 else None), "back to the lookup sweep"
    if action is Action.ABANDON:
        choice = states.ReviewChoice.NOT_HAPPENED_ABANDON
        provider_ref = None
    elif resolution is Resolution.HAPPENED:
        choice = states.ReviewChoice.HAPPENED
        provider_ref = row.provider_ref or f"operator-bulk:{bulk_id}"
    else:
        choice = states.ReviewChoice.NOT_HAPPENED_REQUEUE
        provider_ref = None
    after = review.apply_choice(conn, row, choice, provider_ref, at, effect_deadline)
    if after is None:  # pragma: no cover - the row is locked (PostgreSQL) / SQLite serialises
        return None, "changed while applied; left alone"
    conn.execute(
        sa.insert(schema.review_actions),
        {
            "action_id": f"{bulk_id}:{row.id}",
            "effect_id": row.id,
            "actor": actor,
            "at": at,
            "choice": choice,
            "reason": f"bulk {bulk_id}: {reason}",
            "provider_ref": provider_ref,
            "status_before": row.status,
            "status_after": after.value,
        },
    )
    return after, None


def _finish(engine: Engine, bulk_id: str, at: datetime) -> tuple[int, int]:
    items, ba = schema.bulk_action_items, schema.bulk_actions
    with db.write(engine) as conn:
        counts: dict[str, int] = {
            str(outcome): int(n)
            for outcome, n in conn.execute(
                sa.select(items.c.outcome, sa.func.count())
                .where(items.c.bulk_id == bulk_id)
                .group_by(items.c.outcome)
            ).all()
        }
        applied, skipped = int(counts.get("applied", 0)), int(counts.get("skipped", 0))
        conn.execute(
            sa.update(ba)
            .where(ba.c.bulk_id == bulk_id, ba.c.finished_at.is_(None))
            .values(finished_at=at, applied=applied, skipped=skipped)
        )
    return applied, skipped


def items(engine: Engine, bulk_id: str) -> list[dict[str, Any]]:
    """The per-item audit of one bulk action."""
    t = schema.bulk_action_items
    with db.read(engine) as conn:
        rows = conn.execute(sa.select(t).where(t.c.bulk_id == bulk_id).order_by(t.c.id)).all()
    return [
        {
            "effect_id": r.effect_id,
            "action": r.action,
            "outcome": r.outcome,
            "status_before": r.status_before,
            "status_after": r.status_after,
            "detail": r.detail,
            "actor": r.actor,
            "at": r.at.isoformat(),
        }
        for r in rows
    ]
