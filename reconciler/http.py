"""HTTP routes of the review queue, mounted into the API through ``outbox.routers``.

Operator tokens only (agents get 403), and an operator sees only the effects of
the tenant its token belongs to: another tenant's effect is "not found".

- ``GET /v1/review``: the queue (``?group=awaiting_review|awaiting_lookup``,
  ``?adapter=``, ``?limit=``);
- ``GET /v1/review/{id}``: one effect with all its evidence;
- ``POST /v1/review/{id}/resolve``: an audited action. The action id comes from
  the body (``action_id``) or the ``Idempotency-Key`` header; repeating it
  answers the recorded result with ``Idempotent-Replayed: true``. A stale
  action (the effect is no longer in ``expected_status``) is a 409 and changes
  nothing. The audit names the authenticated token as the actor; an ``actor``
  in the body is kept only as a note.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from outbox import errors, states
from outbox import settings as outbox_settings
from outbox.api import auth, keys, problems
from outbox.service import Outbox, Principal
from reconciler import bulk, review

MAX_EFFECT_ID = 2**63 - 1

Box = Annotated[Outbox, Depends(auth.get_box)]
Operator = Annotated[Principal, Depends(auth.require_operator)]
EffectId = Annotated[int, Path(ge=1, le=MAX_EFFECT_ID)]


class ResolveBody(BaseModel):
    """An operator's answer for one effect whose outcome is unknown."""

    model_config = ConfigDict(extra="forbid")

    choice: states.ReviewChoice
    reason: str = Field(min_length=1, max_length=review.REASON_MAX)
    provider_ref: str | None = Field(default=None, max_length=500)
    action_id: str | None = Field(default=None, min_length=1, max_length=review.ACTION_ID_MAX)
    expected_status: Literal["outcome_unknown"] = "outcome_unknown"
    expected_attempts: int | None = Field(default=None, ge=0)
    # Who is acting, as the caller names themselves: kept as a note in the audit. The
    # actor recorded is always the authenticated token (its id and label).
    actor: str | None = Field(default=None, min_length=1, max_length=100)


def _action_id(request: Request, body: ResolveBody) -> str:
    header = keys.optional(request)
    if body.action_id and header and body.action_id != header:
        raise errors.InvalidArguments(
            [{"field": "action_id", "message": "differs from the Idempotency-Key header"}]
        )
    # Without an id the action is still guarded by its expected state: a blind
    # repeat gets 409 and changes nothing. With one, a repeat gets the result.
    return body.action_id or header or f"act_{uuid.uuid4().hex}"


class BulkBody(BaseModel):
    """One action for every review item of the caller's tenant that the filter selects."""

    model_config = ConfigDict(extra="forbid")

    action: bulk.Action
    resolution: bulk.Resolution | None = None  # with resolve: happened or requeue
    adapter: str | None = Field(default=None, max_length=100)
    problem: str | None = Field(default=None, max_length=40)
    older_than: str | None = Field(default=None, max_length=20, description="e.g. 15m, 2h, 1d")
    reason: str | None = Field(default=None, min_length=1, max_length=review.REASON_MAX)
    dry_run: bool = False
    bulk_id: str | None = Field(default=None, min_length=1, max_length=bulk.BULK_ID_MAX)
    actor: str | None = Field(default=None, min_length=1, max_length=100)


def routers() -> list[APIRouter]:
    router = APIRouter(prefix="/v1/review", tags=["review"])

    @router.post(
        "/bulk",
        summary="Resolve, retry the lookup of, or abandon every item a filter selects",
        responses=problems.responses(401, 403, 409, 422),
    )
    async def bulk_review(
        body: BulkBody, request: Request, principal: Operator, box: Box
    ) -> JSONResponse:
        older_than = None
        if body.older_than is not None:
            parsed = outbox_settings.parse_duration(body.older_than)
            if not isinstance(parsed, timedelta):
                raise errors.InvalidArguments(
                    [{"field": "older_than", "message": "a duration like 90s, 15m, 2h or 1d"}]
                )
            older_than = parsed
        if not body.dry_run and not body.reason:
            raise errors.InvalidArguments(
                [{"field": "reason", "message": "say why: it is kept in every item's audit"}]
            )
        bulk_id = body.bulk_id or request.headers.get("idempotency-key")
        where = bulk.Filter(
            principal.tenant, adapter=body.adapter, problem=body.problem, older_than=older_than
        )
        result = await run_in_threadpool(
            lambda: bulk.run(
                box.engine,
                where,
                action=body.action,
                resolution=body.resolution,
                reason=body.reason or "dry run",
                actor=principal.actor,
                bulk_id=bulk_id or f"bulk_{uuid.uuid4().hex[:16]}",
                dry_run=body.dry_run,
                now=box.clock(),
                effect_deadline=box.settings.effect_deadline,
            )
        )
        return JSONResponse(
            result.to_dict(),
            headers={"Idempotent-Replayed": "true" if result.replayed else "false"},
        )

    @router.get(
        "",
        summary="The review queue: effects whose outcome is unknown",
        responses=problems.responses(401, 403, 422),
    )
    def list_review(
        principal: Operator,
        box: Box,
        adapter: str | None = None,
        group: review.Group | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = review.LIST_LIMIT_DEFAULT,
    ) -> dict[str, Any]:
        items = review.list_items(
            box.engine, tenant=principal.tenant, adapter=adapter, group=group, limit=limit
        )
        return {"items": items}

    @router.get(
        "/{effect_id}",
        summary="One effect with its evidence: attempts, lookups, audit trail",
        responses=problems.responses(401, 403, 404),
    )
    def show_review(effect_id: EffectId, principal: Operator, box: Box) -> dict[str, Any]:
        return review.show(box.engine, effect_id, tenant=principal.tenant)

    @router.post(
        "/{effect_id}/resolve",
        summary="Resolve an unknown outcome: happened, or not (requeue or abandon)",
        responses={
            200: {"description": "The action's result.", "headers": problems.REPLAYED_HEADER},
            **problems.responses(401, 403, 404, 409, 422),
        },
        openapi_extra={"parameters": [keys.parameter(required=False)]},
    )
    async def resolve_review(
        effect_id: EffectId,
        body: ResolveBody,
        request: Request,
        principal: Operator,
        box: Box,
    ) -> JSONResponse:
        action_id = _action_id(request, body)
        result = await run_in_threadpool(
            lambda: review.resolve(
                box.engine,
                effect_id,
                choice=body.choice,
                reason=body.reason,
                actor=principal.actor,
                actor_token_id=principal.token_id,
                actor_note=body.actor,
                action_id=action_id,
                expected_status=body.expected_status,
                expected_attempts=body.expected_attempts,
                provider_ref=body.provider_ref,
                tenant=principal.tenant,
                now=box.clock(),
                effect_deadline=box.settings.effect_deadline,
            )
        )
        return JSONResponse(
            result.to_dict(),
            headers={"Idempotent-Replayed": "true" if result.replayed else "false"},
        )

    return [router]
