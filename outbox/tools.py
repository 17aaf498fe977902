"""The tool registry, and the bundled tool ``create_support_task``.

A tool is a name, a payload version, a pydantic model of its arguments, and a
handler. The handler's writes are part of the creating transaction: it writes
the local rows through its context (``ctx.insert``, or ``ctx.conn`` for
anything else) and returns the receipt and the effects to enqueue. It must not
talk to the outside world (that is what the effects are for), and it may be
run twice for one create (after a lost connection, or when it reaches for
``ctx.conn`` on the one-statement path): only its database writes count, and
only the run that commits keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy.engine import Connection

from outbox import errors, schema


@dataclass(frozen=True, slots=True)
class EffectSpec:
    """One external effect to enqueue: delivered later by the named adapter."""

    effect: str
    adapter: str
    payload: Mapping[str, Any]
    deadline: timedelta | None = None  # None: the adapter's / the settings' default
    # Effects sharing (tenant, adapter, ordering_key) are delivered one at a time, in
    # creation order (an SQS FIFO message group). None: no order, full throughput.
    ordering_key: str | None = None


class RowWriter(Protocol):
    """How a handler's rows reach the creating transaction (``outbox.create`` picks one)."""

    def connection(self) -> Connection: ...

    def insert(self, table: sa.Table, values: Mapping[str, Any], returning: str | None) -> Any: ...


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a handler gets: where its rows go, and who and when."""

    writer: RowWriter
    tenant: str
    operation_id: str
    now: datetime

    @property
    def conn(self) -> Connection:
        """The creating transaction's connection, for writes ``insert`` cannot express.

        A handler that takes it runs in an ordinary transaction (several round
        trips on PostgreSQL); one that only calls ``insert`` has its rows sent
        with the receipt and the outbox rows in one statement.
        """
        return self.writer.connection()

    def insert(
        self, table: sa.Table, values: Mapping[str, Any], *, returning: str | None = None
    ) -> Any:
        """Insert one row in the creating transaction; return ``returning``'s value.

        The fast path for a handler's business row. Values must be plain (str,
        int, float, bool, None, an enum, a timezone-aware datetime); anything
        else goes through ``conn``. ``returning`` may name the table's
        auto-incremented primary key (on PostgreSQL it is drawn from the
        table's sequence before the row is written, so the row can travel in
        the create's one statement) or any other column (which costs the
        one-statement path: the handler then runs in an ordinary transaction).
        """
        return self.writer.insert(table, values, returning)


@dataclass(frozen=True, slots=True)
class ToolOutput:
    receipt: Mapping[str, Any]
    effects: list[EffectSpec] = field(default_factory=list)
    task_id: int | None = None


Handler = Callable[[ToolContext, Any], ToolOutput]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    payload_version: int
    arguments: type[BaseModel]
    handler: Handler
    description: str = ""
    # The adapters this tool's effects may name; checked against the app's adapters at
    # start-up, so a typo fails there instead of at the first delivery.
    adapters: tuple[str, ...] = ()
    # The tool's effects cannot be undone (a refund, a payment): surfaces say so
    # (MCP's destructiveHint), so an agent host asks before it calls.
    destructive: bool = False
    # Each call waits for an operator: the receipt commits as awaiting_approval
    # with its effects held, and nothing reaches a provider until approval.
    # A function of the validated arguments asks only for some calls ("refunds
    # over 500 EUR"); it must depend on the arguments alone, so that a retry of
    # the same call is held, or not, as the first one was.
    requires_approval: bool | Callable[[Any], bool] = False

    def needs_approval(self, arguments: BaseModel) -> bool:
        """Whether this call, with these validated arguments, waits for an operator."""
        rule = self.requires_approval
        return bool(rule(arguments)) if callable(rule) else bool(rule)

    def validate(self, arguments: Any) -> BaseModel:
        """Validate and normalise; raise ``InvalidArguments`` naming every bad field."""
        if not isinstance(arguments, Mapping):
            raise errors.InvalidArguments(
                [{"field": "", "message": "the arguments must be a JSON object"}]
            )
        try:
            return self.arguments.model_validate(dict(arguments))
        except ValidationError as exc:
            raise errors.InvalidArguments(field_errors(exc)) from None


def field_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """A pydantic error as ``InvalidArguments.errors``: one ``{field, message, type}`` each."""
    out = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = ".".join(str(part) for part in err["loc"])
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field; remove it"
        out.append({"field": loc, "message": message, "type": err["type"]})
    return out


class Registry:
    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}
        # Tools whose handler has taken ``ctx.conn``: the create path starts their
        # calls in a transaction from then on (``outbox.creating.create``).
        self.needs_transaction: set[str] = set()

    def register(self, tool: Tool) -> Tool:
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise errors.UnknownTool(name, list(self._tools)) from None

    def names(self) -> list[str]:
        return sorted(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        """Every registered tool, by name."""
        return iter([self._tools[name] for name in sorted(self._tools)])

    def __contains__(self, name: object) -> bool:
        return name in self._tools


# --- create_support_task, version 1 -----------------------------------------


class SupportTaskArgs(BaseModel):
    """Arguments of ``create_support_task`` v1. Unknown fields are refused, types are strict."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "subject": "Parcel 7731 has not arrived",
                    "body": "Ordered on the 2nd, tracking has not moved since.",
                    "priority": "high",
                }
            ]
        },
    )

    subject: str = Field(min_length=1, max_length=200)
    body: str = Field(default="", max_length=10_000)
    priority: Literal["low", "normal", "high"] = "normal"
    helpdesk: bool = True

    @field_validator("subject", mode="before")
    @classmethod
    def _strip(cls, value: Any) -> Any:
        return value.strip() if isinstance(value, str) else value

    @field_validator("subject", "body")
    @classmethod
    def _storable(cls, value: str) -> str:
        # PostgreSQL cannot store NUL in text, and lone surrogates are not UTF-8:
        # refuse them here, as a field error, rather than fail in the driver.
        if "\x00" in value:
            raise ValueError("must not contain the NUL character")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (no lone surrogates)") from None
        return value


HELPDESK_ADAPTER = "helpdesk"
OPEN_TICKET_EFFECT = "open_ticket"


def create_support_task(ctx: ToolContext, args: SupportTaskArgs) -> ToolOutput:
    task_id = ctx.insert(
        schema.tasks,
        {
            "tenant": ctx.tenant,
            "subject": args.subject,
            "body": args.body,
            "priority": args.priority,
            "status": "open",
            "operation_id": ctx.operation_id,
            "created_at": ctx.now,
            "updated_at": ctx.now,
        },
        returning="id",
    )
    effects = []
    if args.helpdesk:
        effects.append(
            EffectSpec(
                effect=OPEN_TICKET_EFFECT,
                adapter=HELPDESK_ADAPTER,
                payload={"subject": args.subject, "body": args.body, "priority": args.priority},
            )
        )
    receipt = {"operation_id": ctx.operation_id, "status": "created", "task_id": task_id}
    return ToolOutput(receipt=receipt, effects=effects, task_id=task_id)


SUPPORT_TASK = Tool(
    name="create_support_task",
    payload_version=1,
    arguments=SupportTaskArgs,
    handler=create_support_task,
    description="Create a local support task and open a ticket at the helpdesk.",
    adapters=(HELPDESK_ADAPTER,),
)


def default_registry() -> Registry:
    registry = Registry()
    registry.register(SUPPORT_TASK)
    return registry
