"""HTTP routes of approvals: operator tokens only, scoped to the token's tenant.

- ``GET /v1/approvals``: operations awaiting approval (``?status=``, ``?limit=``);
- ``GET /v1/approvals/{operation_id}``: one, with its decision and what its
  effects would send;
- ``POST /v1/approvals/{operation_id}/approve`` and ``.../reject``: the decision,
  a compare-and-set on ``awaiting_approval``, audited with the authenticated
  token (and the name the operator gives, if any). Repeating the decision that
  was made answers 200 with ``changed: false`` and ``Idempotent-Replayed:
  true``; the opposite decision is a 409 and changes nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from outbox import states
from outbox.api import auth, problems
from outbox.creating import approvals, create
from outbox.service import Outbox, Principal

router = APIRouter(prefix="/v1/approvals", tags=["approvals"])

Box = Annotated[Outbox, Depends(auth.get_box)]
Operator = Annotated[Principal, Depends(auth.require_operator)]


class DecisionBody(BaseModel):
    """An operator's decision on one operation."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="", max_length=approvals.REASON_MAX)
    # Who is acting, as the operator names themselves; the token is always recorded too.
    actor: str | None = Field(default=None, min_length=1, max_length=100)
    # The state the operator saw; the only one a decision can leave.
    expected_status: Literal["awaiting_approval"] = "awaiting_approval"


def actor_of(principal: Principal, named: str | None) -> str:
    """The audit's actor is the authenticated token; a caller's name is only a note on it."""
    return f"{principal.actor}; note: {named}" if named else principal.actor


@router.get(
    "",
    summary="Operations of approval-required tools (awaiting approval by default)",
    responses=problems.responses(401, 403, 422),
)
def list_approvals(
    principal: Operator,
    box: Box,
    status: states.ApprovalStatus | Literal["all"] = states.ApprovalStatus.AWAITING_APPROVAL,
    limit: Annotated[int, Query(ge=1, le=1000)] = approvals.LIST_LIMIT_DEFAULT,
) -> dict[str, Any]:
    chosen = None if status == "all" else status
    return {"items": box.list_approvals(principal.tenant, status=chosen, limit=limit)}


@router.post(
    "/{operation_id:path}/approve",
    summary="Approve: release the held effects to the dispatcher (once; safe to repeat)",
    responses=problems.responses(400, 401, 403, 404, 409, 422),
)
async def approve(
    operation_id: str, principal: Operator, box: Box, body: DecisionBody | None = None
) -> JSONResponse:
    return await _decide(operation_id, principal, box, body, states.ApprovalDecision.APPROVE)


@router.post(
    "/{operation_id:path}/reject",
    summary="Reject: the held effects fail and are never sent (final; safe to repeat)",
    responses=problems.responses(400, 401, 403, 404, 409, 422),
)
async def reject(
    operation_id: str, principal: Operator, box: Box, body: DecisionBody | None = None
) -> JSONResponse:
    return await _decide(operation_id, principal, box, body, states.ApprovalDecision.REJECT)


@router.get(
    "/{operation_id:path}",
    summary="One operation: approval state, decision (who, when, why), effects' payloads",
    responses=problems.responses(400, 401, 403, 404, 409),
)
def show_approval(operation_id: str, principal: Operator, box: Box) -> dict[str, Any]:
    create.validate_operation_id(operation_id)
    return box.show_approval(principal.tenant, operation_id)


async def _decide(
    operation_id: str,
    principal: Principal,
    box: Outbox,
    body: DecisionBody | None,
    decision: states.ApprovalDecision,
) -> JSONResponse:
    create.validate_operation_id(operation_id)
    body = body or DecisionBody()
    result = await run_in_threadpool(
        box.decide_approval,
        principal.tenant,
        operation_id,
        decision,
        actor=actor_of(principal, body.actor),
        reason=body.reason,
    )
    return JSONResponse(
        result.to_dict(),
        headers={"Idempotent-Replayed": "false" if result.changed else "true"},
    )
