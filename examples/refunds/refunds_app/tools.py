"""Two tools: ``issue_refund`` (a row in refunds, a refund at the payment provider) and
``notify_customer`` (a message through the chat provider).

A refund cannot be undone (``destructive``), and one over 500.00 waits for an
operator's approval before anything reaches the payment provider
(``outbox approvals approve OPERATION_ID --tenant T``, or the console).

Handlers follow the contract (docs/apps.md): they write only through ``ctx``,
never call a provider themselves (the effects do, later, with their own
idempotency keys), and may run twice for one create (only the run that
commits keeps its rows). The payloads are what the fake provider takes:
``subject``, ``body`` and ``priority``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from outbox.tools import EffectSpec, Tool, ToolContext, ToolOutput
from refunds_app import tables

PAYMENTS = "payments"
CHAT = "chat"
APPROVAL_ABOVE_CENTS = 50_000


class IssueRefundArgs(BaseModel):
    """Refund part of an order."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "order_id": "ord_1042",
                    "amount_cents": 1999,
                    "currency": "EUR",
                    "reason": "parcel arrived damaged",
                }
            ]
        },
    )

    order_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    amount_cents: int = Field(gt=0, le=10_000_000)
    currency: Literal["EUR", "USD", "GBP"]
    reason: str = Field(min_length=1, max_length=500)


def large_refund(args: IssueRefundArgs) -> bool:
    """A refund an operator approves first (``Tool.requires_approval``)."""
    return args.amount_cents > APPROVAL_ABOVE_CENTS


def issue_refund(ctx: ToolContext, args: IssueRefundArgs) -> ToolOutput:
    refund_id = ctx.insert(
        tables.refunds,
        {
            "tenant": ctx.tenant,
            "operation_id": ctx.operation_id,
            "order_id": args.order_id,
            "amount_cents": args.amount_cents,
            "currency": args.currency,
            "reason": args.reason,
            "created_at": ctx.now,
        },
        returning="id",
    )
    refund = EffectSpec(
        effect="refund",
        adapter=PAYMENTS,
        payload={
            "subject": f"refund {args.amount_cents} {args.currency} on {args.order_id}",
            "body": args.reason,
            "priority": "high",
        },
    )
    receipt = {"operation_id": ctx.operation_id, "status": "refund_issued", "refund_id": refund_id}
    return ToolOutput(receipt=receipt, effects=[refund])


class NotifyCustomerArgs(BaseModel):
    """A message to a customer through the chat provider."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        json_schema_extra={
            "examples": [
                {"customer_id": "cus_77", "message": "Your refund of 19.99 EUR is on its way."}
            ]
        },
    )

    customer_id: str = Field(min_length=1, max_length=64)
    message: str = Field(min_length=1, max_length=2000)


def notify_customer(ctx: ToolContext, args: NotifyCustomerArgs) -> ToolOutput:
    message = EffectSpec(
        effect="message",
        adapter=CHAT,
        payload={"subject": f"to {args.customer_id}", "body": args.message, "priority": "low"},
    )
    receipt = {"operation_id": ctx.operation_id, "status": "message_queued"}
    return ToolOutput(receipt=receipt, effects=[message])


ISSUE_REFUND = Tool(
    name="issue_refund",
    payload_version=1,
    arguments=IssueRefundArgs,
    handler=issue_refund,
    description="Record a refund and issue it at the payment provider. "
    f"A refund over {APPROVAL_ABOVE_CENTS // 100} waits for an operator's approval.",
    adapters=(PAYMENTS,),
    destructive=True,
    requires_approval=large_refund,
)

NOTIFY_CUSTOMER = Tool(
    name="notify_customer",
    payload_version=1,
    arguments=NotifyCustomerArgs,
    handler=notify_customer,
    description="Send a customer a message through the chat provider.",
    adapters=(CHAT,),
)
