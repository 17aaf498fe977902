"""Operator approval of operations whose tool requires it.

A call to such a tool commits like any other (task, receipt, outbox rows, in
one transaction), except that its receipt says ``awaiting_approval``, the
operation's ``approval`` column is ``awaiting_approval`` and its effects are
``held``: the dispatcher's claim takes pending rows only, so nothing reaches a
provider. An operator then decides, once:

- approve: ``operations.approval`` -> ``approved``; every held effect ->
  ``pending`` (reason ``approved``, the same effect key), due now, with its
  deadline counted from the approval (the wait for a person is not the
  provider's time);
- reject (a reason is required): -> ``rejected``; every held effect ->
  ``failed`` (reason ``rejected``), never sent.

The decision is a compare-and-set on ``operations.approval``: the update
expects ``awaiting_approval``, so of two operators acting at once exactly one
decides. Repeating the decision that was made changes nothing and answers the
recorded one (``changed`` false): it is safe to retry after a lost reply. The
opposite decision is an ``ApprovalConflict`` (409) naming who decided and when.
Each decision writes one ``approval_actions`` row (who, when, why, state
before and after) in the same transaction; a unique key allows only one.

Surfaces (HTTP, CLI, console) call ``decide`` and the reads here; none has
its own path to these tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outbox import db, errors, schema, states

LIST_LIMIT_DEFAULT = 100
REASON_MAX = 2000
ACTOR_MAX = 200

A = states.ApprovalStatus
S = states.EffectStatus

_TARGET = {
    states.ApprovalDecision.APPROVE: A.APPROVED,
    states.ApprovalDecision.REJECT: A.REJECTED,
}


@dataclass(frozen=True, slots=True)
class Decided:
    """What ``decide`` did: ``changed`` is false when the decision was already made."""

    changed: bool
    approval: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, **self.approval}


def decide(
    engine: Engine,
    *,
    tenant: str,
    operation_id: str,
    decision: states.ApprovalDecision | str,
    actor: str,
    reason: str = "",
    now: datetime,
) -> Decided:
    """Approve or reject ``(tenant, operation_id)``: compare-and-set, audited, idempotent."""
    decision = states.ApprovalDecision(decision)
    reason = reason.strip()
    if decision is states.ApprovalDecision.REJECT and not reason:
        raise errors.InvalidArguments(
            [{"field": "reason", "message": "a rejection needs a reason", "type": "missing"}]
        )
    if len(reason) > REASON_MAX:
        raise errors.InvalidArguments(
            [{"field": "reason", "message": f"at most {REASON_MAX} characters", "type": "too_long"}]
        )
    if not actor:
        raise errors.InvalidArguments([{"field": "actor", "message": "who is deciding?"}])
    target = _TARGET[decision]
    ops = schema.operations
    with db.write(engine) as conn:
        current = _approval_of(conn, tenant, operation_id)
        if current == A.AWAITING_APPROVAL:
            # The compare-and-set: on PostgreSQL a concurrent decider holds the
            # row; once it commits, ours matches nothing and we answer below.
            done = conn.execute(
                sa.update(ops)
                .where(
                    ops.c.tenant == tenant,
                    ops.c.operation_id == operation_id,
                    ops.c.approval == A.AWAITING_APPROVAL,
                )
                .values(approval=target)
            )
            if done.rowcount == 1:
                _release_or_fail(conn, tenant, operation_id, target, actor, reason, now)
                conn.execute(
                    sa.insert(schema.approval_actions),
                    {
                        "tenant": tenant,
                        "operation_id": operation_id,
                        "decision": decision,
                        "actor": actor[:ACTOR_MAX],
                        "at": now,
                        "reason": reason,
                        "status_before": A.AWAITING_APPROVAL.value,
                        "status_after": target.value,
                    },
                )
                if engine.dialect.name == "postgresql" and target is A.APPROVED:
                    # Wake the dispatchers, as a create's insert does.
                    conn.exec_driver_sql(f"SELECT pg_notify('{schema.NOTIFY_CHANNEL}', '')")
                return Decided(True, _view(conn, tenant, operation_id))
            current = _approval_of(conn, tenant, operation_id)
        view = _view(conn, tenant, operation_id)
    if current == target:
        return Decided(False, view)
    decided = view.get("decision") or {}
    raise errors.ApprovalConflict(
        tenant,
        operation_id,
        current,
        f"operation {operation_id!r} was already {current} by {decided.get('actor')} "
        f"at {decided.get('at')}; nothing changed",
    )


def _approval_of(conn: Connection, tenant: str, operation_id: str) -> str:
    ops = schema.operations
    row = conn.execute(
        sa.select(ops.c.approval).where(ops.c.tenant == tenant, ops.c.operation_id == operation_id)
    ).first()
    if row is None:
        raise errors.OperationNotFound(tenant, operation_id)
    if row.approval is None:
        raise errors.ApprovalConflict(
            tenant,
            operation_id,
            None,
            f"operation {operation_id!r} does not need approval (its tool does not ask for it)",
        )
    return str(row.approval)


def _release_or_fail(
    conn: Connection,
    tenant: str,
    operation_id: str,
    target: states.ApprovalStatus,
    actor: str,
    reason: str,
    now: datetime,
) -> None:
    out = schema.outbox
    held = conn.execute(
        sa.select(out.c.id, out.c.created_at, out.c.deadline_at).where(
            out.c.tenant == tenant, out.c.operation_id == operation_id, out.c.status == S.HELD
        )
    ).all()
    for row in held:
        if target is A.APPROVED:
            states.check_transition(S.HELD, S.PENDING)
            values: dict[str, Any] = {
                "status": S.PENDING,
                "reason": states.Reason.APPROVED,
                "next_attempt_at": now,
                # The deadline is the provider's time: it starts when a person lets it go.
                "deadline_at": now + (row.deadline_at - row.created_at),
                "updated_at": now,
            }
        else:
            states.check_transition(S.HELD, S.FAILED)
            values = {
                "status": S.FAILED,
                "reason": states.Reason.REJECTED,
                "last_error": f"rejected by {actor}: {reason}",
                "finished_at": now,
                "updated_at": now,
            }
        done = conn.execute(
            sa.update(out).where(out.c.id == row.id, out.c.status == S.HELD).values(**values)
        )
        if done.rowcount != 1:  # pragma: no cover - the operation's row lock serialises us
            raise errors.StaleTransition(row.id, S.HELD.value)


# --- reads ---------------------------------------------------------------------------


def list_approvals(
    engine: Engine,
    *,
    tenant: str,
    status: states.ApprovalStatus | str | None = A.AWAITING_APPROVAL,
    limit: int = LIST_LIMIT_DEFAULT,
) -> list[dict[str, Any]]:
    """The tenant's approval-required operations, oldest first (awaiting ones by default)."""
    ops = schema.operations
    query = sa.select(ops.c.operation_id).where(ops.c.tenant == tenant)
    if status is None:
        query = query.where(ops.c.approval.is_not(None))
    else:
        query = query.where(ops.c.approval == states.ApprovalStatus(status))
    query = query.order_by(ops.c.created_at, ops.c.operation_id).limit(limit)
    with db.read(engine) as conn:
        ids = conn.execute(query).scalars().all()
        return [_view(conn, tenant, operation_id) for operation_id in ids]


def show(engine: Engine, *, tenant: str, operation_id: str) -> dict[str, Any]:
    """One approval-required operation: its state, decision and what its effects would send."""
    with db.read(engine) as conn:
        _approval_of(conn, tenant, operation_id)
        return _view(conn, tenant, operation_id)


def approval_view(conn: Connection, tenant: str, operation_id: str) -> dict[str, Any] | None:
    """The approval block of an operation's read (None when its tool needs none)."""
    ops, acts = schema.operations, schema.approval_actions
    row = conn.execute(
        sa.select(ops.c.approval).where(ops.c.tenant == tenant, ops.c.operation_id == operation_id)
    ).first()
    if row is None or row.approval is None:
        return None
    action = conn.execute(
        sa.select(acts).where(acts.c.tenant == tenant, acts.c.operation_id == operation_id)
    ).first()
    return {"status": row.approval, "decision": _action_view(action)}


def _action_view(action: Any) -> dict[str, Any] | None:
    if action is None:
        return None
    return {
        "decision": action.decision,
        "actor": action.actor,
        "at": action.at.isoformat(),
        "reason": action.reason,
        "status_before": action.status_before,
        "status_after": action.status_after,
    }


def _view(conn: Connection, tenant: str, operation_id: str) -> dict[str, Any]:
    ops, out = schema.operations, schema.outbox
    op = conn.execute(
        sa.select(ops).where(ops.c.tenant == tenant, ops.c.operation_id == operation_id)
    ).one()
    action = conn.execute(
        sa.select(schema.approval_actions).where(
            schema.approval_actions.c.tenant == tenant,
            schema.approval_actions.c.operation_id == operation_id,
        )
    ).first()
    effects = conn.execute(
        sa.select(out)
        .where(out.c.tenant == tenant, out.c.operation_id == operation_id)
        .order_by(out.c.id)
    ).all()
    return {
        "tenant": tenant,
        "operation_id": operation_id,
        "tool": op.tool,
        "status": op.approval,
        "created_at": op.created_at.isoformat(),
        "receipt": json.loads(op.receipt),
        "decision": _action_view(action),
        # What each effect would send (or sent): the operator approves this, not the intent.
        "effects": [
            {
                "id": e.id,
                "effect": e.effect,
                "adapter": e.adapter,
                "status": e.status,
                "reason": e.reason,
                "payload": json.loads(e.payload),
            }
            for e in effects
        ],
    }
