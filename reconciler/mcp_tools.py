"""The review queue's read tool for MCP hosts, plugged in through ``outbox.mcp_tools``.

``list_review_items`` is listed for operator tokens only, and reads only the
token's tenant, as ``GET /v1/review`` does (the same ``review.list_items``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from outbox import states
from outbox.mcp.server import ReadTool
from outbox.service import Outbox, Principal
from reconciler import review


class ListReviewArgs(BaseModel):
    # Not strict: the group arrives as JSON text and becomes the enum.
    model_config = ConfigDict(extra="forbid")

    adapter: str | None = Field(default=None, max_length=100, description="Only this adapter.")
    group: review.Group | None = Field(
        default=None,
        description="awaiting_review (a person decides) or awaiting_lookup (a lookup is due).",
    )
    limit: int = Field(default=review.LIST_LIMIT_DEFAULT, ge=1, le=1000)


ITEMS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["items"],
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "group", "operation_id", "effect", "adapter", "status"],
            },
        }
    },
}


def _list(box: Outbox, principal: Principal, args: ListReviewArgs) -> dict[str, Any]:
    items = review.list_items(
        box.engine,
        tenant=principal.tenant,
        adapter=args.adapter,
        group=args.group,
        limit=args.limit,
    )
    return {"items": items}


def tools() -> list[ReadTool]:
    return [
        ReadTool(
            name="list_review_items",
            description="Effects whose outcome is unknown (a send may have happened): those "
            "a person must decide first, then those waiting for a lookup. Read-only.",
            arguments=ListReviewArgs,
            output_schema=ITEMS_SCHEMA,
            run=_list,
            roles=frozenset({states.Role.OPERATOR}),
        )
    ]
