"""The operator review queue: effects whose outcome is unknown, their evidence,
and the three audited actions a person may take on them.

Two groups are shown. *Awaiting review*: no lookup can settle it (the adapter
cannot look up, or lookups stayed inconclusive), so a person must.
*Awaiting lookup*: still ``outcome_unknown``, with lookups to come; an operator
who already knows the answer may resolve it now.

Every action (``resolve``):

- names the state it expects (``expected_status``, and optionally the attempt
  count the operator saw); if the row is no longer there, it raises
  ``ReviewConflict`` and writes nothing, so two operators cannot both resolve
  one item, and a lookup that settled it first wins;
- is recorded in ``review_actions`` (actor, time, reason, state before and
  after) in the same transaction as the change;
- is safe to repeat: the caller picks an ``action_id``; the same id with the
  same parameters returns the recorded result unchanged, with different
  parameters it is a conflict;
- never touches ``effect_key``: a requeued effect goes out under its original key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection, Engine

from outbox import db, errors, schema, settings, states
from outbox.settling import settle, webhooks

S = states.EffectStatus
Choice = states.ReviewChoice

LIST_LIMIT_DEFAULT = 100
ACTION_ID_MAX = 100
REASON_MAX = 2000


class Group(StrEnum):
    AWAITING_REVIEW = "awaiting_review"  # needs_review: only a person can settle it
    AWAITING_LOOKUP = "awaiting_lookup"  # lookups still to come; a person may act first


@dataclass(frozen=True, slots=True)
class ActionResult:
    """One recorded operator action. ``replayed``: this call found it already recorded."""

    action_id: str
    effect_id: int
    effect_key: str
    choice: states.ReviewChoice
    actor: str
    at: datetime
    reason: str
    provider_ref: str | None
    status_before: str
    status_after: str
    replayed: bool = False
    # The token that acted (None from the command line), and what the caller said
    # about who they are: a note, never the actor.
    actor_token_id: int | None = None
    actor_note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        value = asdict(self)
        value["choice"] = self.choice.value
        value["at"] = self.at.isoformat()
        return value


# --- reads ------------------------------------------------------------------------


def _group(needs_review: bool) -> Group:
    return Group.AWAITING_REVIEW if needs_review else Group.AWAITING_LOOKUP


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def list_items(
    engine: Engine,
    *,
    tenant: str | None = None,
    adapter: str | None = None,
    group: Group | str | None = None,
    limit: int = LIST_LIMIT_DEFAULT,
) -> list[dict[str, Any]]:
    """Every ``outcome_unknown`` effect: awaiting review first (oldest first), then
    awaiting lookup (next lookup first)."""
    out = schema.outbox
    query = sa.select(out).where(out.c.status == S.OUTCOME_UNKNOWN)
    if tenant is not None:
        query = query.where(out.c.tenant == tenant)
    if adapter is not None:
        query = query.where(out.c.adapter == adapter)
    if group is not None:
        query = query.where(out.c.needs_review.is_(Group(group) is Group.AWAITING_REVIEW))
    query = query.order_by(
        out.c.needs_review.desc(),
        out.c.review_since.nulls_last(),
        out.c.next_lookup_at.nulls_first(),
        out.c.id,
    ).limit(limit)
    with db.read(engine) as conn:
        rows = conn.execute(query).all()
    return [_item(r) for r in rows]


def _item(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "group": _group(bool(row.needs_review)).value,
        "tenant": row.tenant,
        "operation_id": row.operation_id,
        "effect": row.effect,
        "adapter": row.adapter,
        "effect_key": row.effect_key,
        "status": row.status,
        "reason": row.reason,
        "attempts": row.attempts,
        "maybe_sent": bool(row.maybe_sent),
        "lookup_attempts": row.lookup_attempts,
        "next_lookup_at": _iso(row.next_lookup_at),
        "review_since": _iso(row.review_since),
        "last_error": row.last_error,
        "provider_ref": row.provider_ref,
        "deadline_at": _iso(row.deadline_at),
        "created_at": _iso(row.created_at),
        "updated_at": _iso(row.updated_at),
    }


def show(engine: Engine, effect_id: int, *, tenant: str | None = None) -> dict[str, Any]:
    """One effect with all its evidence: the operation and task it belongs to, the
    payload, the key, every attempt, every lookup and every operator action.

    Works for an effect in any state, so the audit trail stays readable after
    it was resolved. ``tenant`` scopes it: another tenant's effect is not found.
    """
    a, lk, ra = schema.attempts, schema.lookups, schema.review_actions
    ops, tasks = schema.operations, schema.tasks
    with db.read(engine) as conn:
        row = _effect(conn, effect_id, tenant)
        op = conn.execute(
            sa.select(ops).where(ops.c.tenant == row.tenant, ops.c.operation_id == row.operation_id)
        ).first()
        task = None
        if op is not None and op.task_id is not None:
            task = conn.execute(
                sa.select(tasks).where(tasks.c.tenant == row.tenant, tasks.c.id == op.task_id)
            ).first()
        attempt_rows = conn.execute(
            sa.select(a).where(a.c.effect_id == effect_id).order_by(a.c.attempt_no)
        ).all()
        lookup_rows = conn.execute(
            sa.select(lk).where(lk.c.effect_id == effect_id).order_by(lk.c.at, lk.c.id)
        ).all()
        action_rows = conn.execute(
            sa.select(ra).where(ra.c.effect_id == effect_id).order_by(ra.c.at, ra.c.id)
        ).all()
        webhook_events = webhooks.for_effect(conn, effect_id)
    item = _item(row)
    if row.status != S.OUTCOME_UNKNOWN:
        item["group"] = None
    item.update(
        {
            "payload": json.loads(row.payload),
            "finished_at": _iso(row.finished_at),
            "settled_by": row.settled_by,
            "ordering_key": row.ordering_key,
            "webhooks": webhook_events,
            "operation": None
            if op is None
            else {
                "operation_id": op.operation_id,
                "tool": op.tool,
                "payload_version": op.payload_version,
                "status_code": op.status_code,
                "receipt": json.loads(op.receipt),
                "created_at": _iso(op.created_at),
            },
            "task": None
            if task is None
            else {
                "id": task.id,
                "subject": task.subject,
                "body": task.body,
                "priority": task.priority,
                "status": task.status,
                "created_at": _iso(task.created_at),
            },
            "attempts_detail": [
                {
                    "attempt_no": r.attempt_no,
                    "worker": r.worker,
                    "effect_key": r.effect_key,
                    "started_at": _iso(r.started_at),
                    "finished_at": _iso(r.finished_at),
                    "outcome": r.outcome,
                    "status_code": r.status_code,
                    "error": r.error,
                    "provider_ref": r.provider_ref,
                    "late": bool(r.late),
                }
                for r in attempt_rows
            ],
            "lookups": [
                {
                    "at": _iso(r.at),
                    "worker": r.worker,
                    "outcome": r.outcome,
                    "provider_ref": r.provider_ref,
                    "error": r.error,
                }
                for r in lookup_rows
            ],
            "audit": [
                _action(r, replayed=False, effect_key=row.effect_key).to_dict() for r in action_rows
            ],
        }
    )
    return item


def _effect(conn: Connection, effect_id: int, tenant: str | None, *, lock: bool = False) -> Any:
    out = schema.outbox
    query = sa.select(out).where(out.c.id == effect_id)
    if tenant is not None:
        query = query.where(out.c.tenant == tenant)
    if lock and conn.dialect.name == "postgresql":
        # Wait for a concurrent action on this row, then see what it did.
        query = query.with_for_update()
    row = conn.execute(query).first()
    if row is None:
        raise errors.EffectNotFound(effect_id)
    return row


# --- the action -------------------------------------------------------------------


def resolve(
    engine: Engine,
    effect_id: int,
    *,
    choice: states.ReviewChoice | str,
    reason: str,
    actor: str,
    action_id: str,
    actor_token_id: int | None = None,
    actor_note: str | None = None,
    expected_status: states.EffectStatus | str = S.OUTCOME_UNKNOWN,
    expected_attempts: int | None = None,
    provider_ref: str | None = None,
    tenant: str | None = None,
    now: datetime | None = None,
    effect_deadline: timedelta = settings.EFFECT_DEADLINE_DEFAULT,
) -> ActionResult:
    """Record an operator's answer for an effect whose outcome is unknown.

    - ``happened``: succeeded, with ``provider_ref`` (required): the provider's
      reference the operator found;
    - ``not_happened_requeue``: pending again with the same key, a fresh
      deadline (``now + effect_deadline``) and the may-have-been-sent evidence
      cleared, so the dispatcher delivers it;
    - ``not_happened_abandon``: failed; it must not happen any more.

    ``actor`` is the authenticated principal (``Principal.actor``: the token and
    its label; on the command line, the OS account), ``actor_token_id`` its
    token; ``actor_note`` is whatever the caller said about who they are, kept
    beside it and never in its place.

    Raises ``ReviewConflict`` (nothing written) if the effect is not in
    ``expected_status`` (or has another attempt count than ``expected_attempts``),
    or if ``action_id`` was used for a different action. Repeating the same
    action id with the same parameters returns the recorded result.
    """
    choice = states.ReviewChoice(choice)
    expected = _expected_status(expected_status)
    reason = _check_arguments(choice, reason, actor, action_id, provider_ref, actor_note)
    at = now or schema.utcnow()
    try:
        with db.write(engine) as conn:
            row = _effect(conn, effect_id, tenant, lock=True)
            recorded = _recorded(conn, action_id)
            if recorded is not None:
                return _replay(
                    recorded, row.effect_key, effect_id, choice, reason, actor, provider_ref
                )
            if row.status != expected or (
                expected_attempts is not None and row.attempts != expected_attempts
            ):
                raise _conflict(row, expected, expected_attempts)
            status_after = apply_choice(
                conn, row, choice, provider_ref, at, effect_deadline, expected_attempts
            )
            if status_after is None:  # pragma: no cover - the row is locked / SQLite serialises
                raise _conflict(_effect(conn, effect_id, tenant), expected, expected_attempts)
            conn.execute(
                sa.insert(schema.review_actions),
                {
                    "action_id": action_id,
                    "effect_id": effect_id,
                    "actor": actor,
                    "actor_token_id": actor_token_id,
                    "actor_note": actor_note,
                    "at": at,
                    "choice": choice,
                    "reason": reason,
                    "provider_ref": provider_ref,
                    "status_before": row.status,
                    "status_after": status_after.value,
                },
            )
            return ActionResult(
                action_id=action_id,
                effect_id=effect_id,
                effect_key=row.effect_key,
                choice=choice,
                actor=actor,
                at=at,
                reason=reason,
                provider_ref=provider_ref,
                status_before=row.status,
                status_after=status_after.value,
                actor_token_id=actor_token_id,
                actor_note=actor_note,
            )
    except exc.IntegrityError:
        # PostgreSQL: the same action id committed by a concurrent call (perhaps
        # for another effect) between our check and our insert. Our transaction
        # rolled back; answer from what the other one recorded.
        with db.read(engine) as conn:
            recorded = _recorded(conn, action_id)
            if recorded is None:
                raise
            key = conn.execute(
                sa.select(schema.outbox.c.effect_key).where(
                    schema.outbox.c.id == recorded.effect_id
                )
            ).scalar_one()
        return _replay(recorded, key, effect_id, choice, reason, actor, provider_ref)


def _expected_status(value: states.EffectStatus | str) -> states.EffectStatus:
    try:
        expected = S(value)
    except ValueError:
        raise errors.InvalidArguments(
            [{"field": "expected_status", "message": f"not a state: {value!r}"}]
        ) from None
    if expected is not S.OUTCOME_UNKNOWN:
        raise errors.InvalidArguments(
            [
                {
                    "field": "expected_status",
                    "message": "review actions apply only to outcome_unknown effects",
                }
            ]
        )
    return expected


def _check_arguments(
    choice: states.ReviewChoice,
    reason: str,
    actor: str,
    action_id: str,
    provider_ref: str | None,
    actor_note: str | None = None,
) -> str:
    problems: list[dict[str, Any]] = []
    reason = (reason or "").strip()
    if not reason:
        problems.append({"field": "reason", "message": "say why: the reason is kept in the audit"})
    elif len(reason) > REASON_MAX:
        problems.append({"field": "reason", "message": f"at most {REASON_MAX} characters"})
    if actor_note is not None and len(actor_note) > 200:
        problems.append({"field": "actor", "message": "at most 200 characters"})
    for field, text in (
        ("reason", reason),
        ("actor", actor),
        ("actor", actor_note),
        ("provider_ref", provider_ref),
    ):
        # PostgreSQL text refuses NUL: a 422 here instead of a 500 from the driver.
        if text and "\x00" in text:
            problems.append({"field": field, "message": "must not contain NUL characters"})
    if not actor or not actor.strip() or len(actor) > 200:
        problems.append({"field": "actor", "message": "1-200 characters: who is acting"})
    if not action_id or len(action_id) > ACTION_ID_MAX or not action_id.isprintable():
        problems.append(
            {"field": "action_id", "message": f"1-{ACTION_ID_MAX} printable characters"}
        )
    if choice is Choice.HAPPENED:
        if not provider_ref or not provider_ref.strip() or len(provider_ref) > 500:
            problems.append(
                {
                    "field": "provider_ref",
                    "message": "required for 'happened': the provider's reference for the effect",
                }
            )
    elif provider_ref is not None:
        problems.append(
            {"field": "provider_ref", "message": "only for 'happened': it did not happen"}
        )
    if problems:
        raise errors.InvalidArguments(problems, "invalid review action; nothing changed")
    return reason


def apply_choice(
    conn: Connection,
    row: Any,
    choice: states.ReviewChoice,
    provider_ref: str | None,
    now: datetime,
    effect_deadline: timedelta,
    expected_attempts: int | None = None,
) -> states.EffectStatus | None:
    """Write the operator's answer to ``row`` as read (compare-and-set); the state after,
    or None if the row moved on. Happened and abandon are the shared settle step."""
    out = schema.outbox
    guard = [] if expected_attempts is None else [out.c.attempts == expected_attempts]
    before = S(row.status)
    if choice is not Choice.NOT_HAPPENED_REQUEUE:
        happened = choice is Choice.HAPPENED
        written = settle.settle(
            conn,
            settle.Settlement(
                effect_id=row.id,
                expected_status=before,
                expected_fence=row.fence,
                to=S.SUCCEEDED if happened else S.FAILED,
                reason=states.Reason.OPERATOR_HAPPENED
                if happened
                else states.Reason.OPERATOR_ABANDON,
                source=states.SettleSource.OPERATOR,
                at=now,
                provider_ref=provider_ref if happened else None,
                maybe_sent=None if happened else False,
            ),
            guard=guard,
        )
        return (S.SUCCEEDED if happened else S.FAILED) if written else None
    values = _values(choice, provider_ref, now, effect_deadline)
    states.check_transition(before, values["status"])
    result = conn.execute(
        sa.update(out)
        .where(out.c.id == row.id, out.c.status == before, out.c.fence == row.fence, *guard)
        .values(**values)
    )
    return S(values["status"]) if result.rowcount == 1 else None


def _values(
    choice: states.ReviewChoice,
    provider_ref: str | None,
    now: datetime,
    effect_deadline: timedelta,
) -> dict[str, Any]:
    common: dict[str, Any] = {
        "needs_review": False,
        "review_since": None,
        "next_lookup_at": None,
        "lease_owner": None,
        "lease_expires_at": None,
        "updated_at": now,
    }
    if choice is Choice.HAPPENED:
        return common | {
            "status": S.SUCCEEDED,
            "reason": states.Reason.OPERATOR_HAPPENED,
            "provider_ref": provider_ref,
            "finished_at": now,
            "last_error": None,
        }
    if choice is Choice.NOT_HAPPENED_REQUEUE:
        # A person said it did not happen: the evidence of a possible send is
        # cleared so the dispatcher may deliver it, with the key it always had.
        return common | {
            "status": S.PENDING,
            "reason": states.Reason.OPERATOR_REQUEUE,
            "maybe_sent": False,
            "next_attempt_at": now,
            "deadline_at": now + effect_deadline,
            "lookup_attempts": 0,
        }
    return common | {
        "status": S.FAILED,
        "reason": states.Reason.OPERATOR_ABANDON,
        "maybe_sent": False,
        "finished_at": now,
    }


def _recorded(conn: Connection, action_id: str) -> Any:
    ra = schema.review_actions
    return conn.execute(sa.select(ra).where(ra.c.action_id == action_id)).first()


def _action(row: Any, *, replayed: bool, effect_key: str) -> ActionResult:
    return ActionResult(
        action_id=row.action_id,
        effect_id=row.effect_id,
        effect_key=effect_key,
        choice=states.ReviewChoice(row.choice),
        actor=row.actor,
        at=row.at,
        reason=row.reason,
        provider_ref=row.provider_ref,
        status_before=row.status_before,
        status_after=row.status_after,
        replayed=replayed,
        actor_token_id=row.actor_token_id,
        actor_note=row.actor_note,
    )


def _replay(
    recorded: Any,
    effect_key: str,
    effect_id: int,
    choice: states.ReviewChoice,
    reason: str,
    actor: str,
    provider_ref: str | None,
) -> ActionResult:
    same = (
        recorded.effect_id == effect_id
        and recorded.choice == choice
        and recorded.reason == reason
        and recorded.actor == actor
        and recorded.provider_ref == provider_ref
    )
    if not same:
        raise errors.ReviewConflict(
            effect_id,
            expected="a new action id",
            actual=f"action {recorded.action_id!r} already recorded",
            # Do not name the other action's effect: it may be another tenant's.
            detail=(
                f"action id {recorded.action_id!r} was already used for a different action; "
                "use a new action id for a new action; nothing changed"
            ),
        )
    return _action(recorded, replayed=True, effect_key=effect_key)


def _conflict(
    row: Any, expected: states.EffectStatus, expected_attempts: int | None
) -> errors.ReviewConflict:
    actual = str(row.status)
    if row.status == S.OUTCOME_UNKNOWN and expected_attempts is not None:
        return errors.ReviewConflict(
            row.id,
            expected=f"{expected.value} after {expected_attempts} attempts",
            actual=f"{actual} after {row.attempts} attempts",
        )
    return errors.ReviewConflict(row.id, expected=expected.value, actual=actual)
