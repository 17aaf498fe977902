# Longer than 500 lines on purpose: the MCP surface's tool list, schemas, results and
# both transports' authentication are one translation of the service for agent hosts.
"""The tool boundary over the Model Context Protocol: ``outbox mcp`` (stdio) and ``/mcp`` (HTTP).

Built on the official SDK's low-level ``Server``: every tool of the loaded
registry (``box.tools``) is listed with its own input schema (its arguments'
JSON Schema plus a required ``operation_id``), annotations and output schema,
and every call goes through the same service calls as the HTTP API
(``box.execute``, ``box.get_operation``, ``box.get_task``): no own path to the
database, no own validation, no own idea of replay.

The key. MCP's request id and a host's tool-call id change on every retry, so
neither is ever the idempotency key: the agent supplies ``operation_id`` as an
argument, allocated once per intended action and reused unchanged on every
retry. Same id, same arguments: ``replayed`` true and the stored receipt.
Same id, changed arguments: an error with ``retry: never``.

Who is calling. stdio: the agent token in ``OUTBOX_TOKEN``, checked at start
and again on every request (a revoked token stops working at once). HTTP:
``Authorization: Bearer <token>`` on every request; none or a bad one is a
401 before the MCP layer sees the request. Tenant scoping and roles are the
HTTP API's: an operation of another tenant is "not found", and operator
tokens also get the read tools of the ``outbox.mcp_tools`` entry point group
(the review queue's ``list_review_items``).

Answers. A result's ``structuredContent`` is the operation as ``get_operation``
reads it (the receipt, each effect's state, the approval if the tool needs
one) plus ``replayed``. An error is ``isError`` true with the problem
document (``type``, ``title``, ``status``, ``detail``, ``retry``:
``same_key`` | ``never`` | ``after_fix`` | ``reconcile``, ``retry_after``).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import Receive, Scope, Send

from outbox import errors, faults, states, tools
from outbox.api import problems
from outbox.creating import create
from outbox.service import Outbox, Principal

logger = logging.getLogger("outbox.mcp")

READ_TOOLS_GROUP = "outbox.mcp_tools"
PRINCIPAL_SCOPE_KEY = "outbox.principal"
MAX_ID = 2**63 - 1

OPERATION_ID_DESCRIPTION = (
    "The idempotency key of this action (1-255 visible ASCII characters). Allocate it once "
    "per intended action, before the first call; keep it with the action (and with its "
    "approval, if one is asked for); reuse it unchanged on every retry of that action, "
    "including after a timeout, a lost reply or a restart. Never reuse it for a different "
    "action, and never derive it from the tool-call id, which changes on every retry. The "
    "same id with the same arguments returns the first call's receipt (replayed: true) "
    "instead of acting twice; with different arguments it is refused (retry: never)."
)

INSTRUCTIONS = (
    "Outbox performs writes to the outside world exactly as often as you intend them, "
    "however often you retry. Every write tool takes an operation_id: allocate one per "
    "intended action and reuse it unchanged on every retry of that action. On an error, "
    "read structuredContent.retry: same_key (retry with the same operation_id, after "
    "retry_after seconds if given), after_fix (change the arguments first), never (stop; a "
    "new action needs a new operation_id), reconcile (look the outcome up with "
    "get_operation; do not retry under a new id). A receipt with status "
    "awaiting_approval waits for an operator: call get_operation with the same "
    "operation_id later to see whether it was approved or rejected."
)

_OPERATION_ID_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": 255,
    "pattern": "^[!-~]+$",
    "description": OPERATION_ID_DESCRIPTION,
}

_EFFECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "effect", "adapter", "status", "reason", "attempts"],
    "properties": {
        "id": {"type": "integer"},
        "effect": {"type": "string"},
        "adapter": {"type": "string"},
        "status": {
            "type": "string",
            "enum": [s.value for s in states.EffectStatus],
            "description": "held: waits for an approval; pending/in_flight: on its way; "
            "succeeded: the provider confirmed it; failed: it did not and will not happen; "
            "outcome_unknown: a lookup or an operator decides.",
        },
        "reason": {"type": "string"},
        "attempts": {"type": "integer"},
        "provider_ref": {"type": ["string", "null"]},
        "last_error": {"type": ["string", "null"]},
        "awaiting_review": {"type": "boolean"},
        "next_attempt_at": {"type": ["string", "null"]},
        "deadline_at": {"type": "string"},
        "finished_at": {"type": ["string", "null"]},
    },
}

_APPROVAL_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "description": "null unless the tool requires approval.",
    "properties": {
        "status": {"type": "string", "enum": [s.value for s in states.ApprovalStatus]},
        "decision": {
            "type": ["object", "null"],
            "properties": {
                "decision": {"type": "string"},
                "actor": {"type": "string"},
                "at": {"type": "string"},
                "reason": {"type": "string"},
            },
        },
    },
}

OPERATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["operation_id", "tool", "receipt", "effects", "approval", "status_code"],
    "properties": {
        "operation_id": {"type": "string"},
        "tool": {"type": "string"},
        "payload_version": {"type": "integer"},
        "status_code": {"type": "integer"},
        "receipt": {
            "type": "object",
            "description": "What happened to the request, exactly as stored at creation.",
        },
        "task_id": {"type": ["integer", "null"]},
        "created_at": {"type": "string"},
        "expires_at": {"type": "string"},
        "approval": _APPROVAL_SCHEMA,
        "effects": {"type": "array", "items": _EFFECT_SCHEMA},
    },
}

WRITE_RESULT_SCHEMA: dict[str, Any] = copy.deepcopy(OPERATION_SCHEMA)
WRITE_RESULT_SCHEMA["required"] = ["replayed", *OPERATION_SCHEMA["required"]]
WRITE_RESULT_SCHEMA["properties"] = {
    "replayed": {
        "type": "boolean",
        "description": "true: this operation_id was seen before and nothing new was done.",
    },
    **OPERATION_SCHEMA["properties"],
}

TASK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "subject", "status", "operation_id"],
    "properties": {
        "id": {"type": "integer"},
        "subject": {"type": "string"},
        "body": {"type": "string"},
        "priority": {"type": "string"},
        "status": {"type": "string"},
        "operation_id": {"type": "string"},
        "created_at": {"type": "string"},
        "updated_at": {"type": "string"},
    },
}


# --- read tools ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadTool:
    """A read-only MCP tool. Packages above ``outbox`` add theirs by entry point."""

    name: str
    description: str
    arguments: type[BaseModel]
    output_schema: dict[str, Any]
    run: Callable[[Outbox, Principal, Any], dict[str, Any]]  # sync: runs in a worker thread
    roles: frozenset[states.Role] = frozenset(states.Role)


class GetOperationArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    operation_id: str = Field(
        min_length=1,
        max_length=255,
        description="The operation_id the write was called with.",
    )


class GetTaskArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    task_id: int = Field(ge=1, le=MAX_ID, description="The task_id of a receipt.")


def _get_operation(box: Outbox, principal: Principal, args: GetOperationArgs) -> dict[str, Any]:
    create.validate_operation_id(args.operation_id)
    return box.get_operation(principal.tenant, args.operation_id)


def _get_task(box: Outbox, principal: Principal, args: GetTaskArgs) -> dict[str, Any]:
    return box.get_task(principal.tenant, args.task_id)


BUILTIN_READ_TOOLS = (
    ReadTool(
        name="get_operation",
        description="The receipt of an operation and the current state of each of its effects "
        "(and of its approval, if its tool asks for one). Use it to follow an action up, or "
        "to reconcile after an error with retry: reconcile.",
        arguments=GetOperationArgs,
        output_schema=OPERATION_SCHEMA,
        run=_get_operation,
    ),
    ReadTool(
        name="get_task",
        description="A task as it is now.",
        arguments=GetTaskArgs,
        output_schema=TASK_SCHEMA,
        run=_get_task,
    ),
)


def load_read_tools(load_entry_points: bool = True) -> list[ReadTool]:
    found = list(BUILTIN_READ_TOOLS)
    if load_entry_points:
        for entry in importlib.metadata.entry_points(group=READ_TOOLS_GROUP):
            found.extend(entry.load()())
    return found


# --- the surface: listing and calling, whatever the transport ------------------------------


class Surface:
    """The MCP view of one ``Outbox``: tool definitions for a principal, and calls."""

    def __init__(
        self,
        box: Outbox,
        *,
        read_tools: Iterable[ReadTool] | None = None,
        load_entry_points: bool = True,
    ) -> None:
        self.box = box
        self.read_tools = {
            t.name: t
            for t in (read_tools if read_tools is not None else load_read_tools(load_entry_points))
        }
        for tool in box.tools:
            if tool.name in self.read_tools:
                raise errors.ConfigError(
                    f"tool {tool.name!r} has the name of a built-in read tool; rename it"
                )
            if "operation_id" in tool.arguments.model_fields:
                raise errors.ConfigError(
                    f"tool {tool.name!r} has an argument named operation_id, which MCP "
                    "callers use for the idempotency key; rename the argument"
                )

    # --- listing ---

    def definitions(self, principal: Principal) -> list[types.Tool]:
        listed = [write_definition(tool) for tool in self.box.tools]
        listed.extend(
            read_definition(t) for t in self.read_tools.values() if principal.role in t.roles
        )
        return listed

    # --- calling ---

    async def call(
        self, principal: Principal | None, name: str, arguments: Mapping[str, Any] | None
    ) -> types.CallToolResult:
        try:
            if principal is None:
                raise problems.Unauthenticated("the token is unknown or revoked")
            arguments = dict(arguments or {})
            read = self.read_tools.get(name)
            if read is not None:
                if principal.role not in read.roles:
                    raise errors.UnknownTool(name, self._names(principal))
                args = _validate(read.arguments, arguments)
                view = await anyio.to_thread.run_sync(read.run, self.box, principal, args)
                return _result(view)
            if name not in self.box.tools:
                raise errors.UnknownTool(name, self._names(principal))
            operation_id = create.validate_operation_id(arguments.pop("operation_id", None))
            result = await anyio.to_thread.run_sync(
                self.box.execute, principal.tenant, operation_id, name, arguments
            )
            # Committed; the reply is not yet sent. A crash here is a lost reply:
            # the retry with the same operation_id finds the receipt.
            faults.point("mcp.after_execute")
            view = await anyio.to_thread.run_sync(
                self.box.get_operation, principal.tenant, operation_id
            )
            return _result({"replayed": result.replayed, **view})
        except errors.OutboxError as error:
            return problem_result(error)
        except Exception:
            logger.exception("MCP tool call %s failed", name)
            return problem_result(errors.OutboxError())

    def _names(self, principal: Principal) -> list[str]:
        return [t.name for t in self.definitions(principal)]


def write_definition(tool: tools.Tool) -> types.Tool:
    return types.Tool(
        name=tool.name,
        title=tool.name.replace("_", " ").capitalize(),
        description=_write_description(tool),
        input_schema=write_input_schema(tool),
        output_schema=WRITE_RESULT_SCHEMA,
        annotations=types.ToolAnnotations(
            read_only_hint=False,
            destructive_hint=tool.destructive,
            idempotent_hint=True,  # on operation_id: a retry with the same id acts once
            open_world_hint=True,  # its effects reach a provider outside Outbox
        ),
    )


def _write_description(tool: tools.Tool) -> str:
    text = tool.description or f"Call the tool {tool.name}."
    text += (
        " Idempotent on operation_id: allocate one per intended action and reuse it on every retry."
    )
    if tool.requires_approval:
        some = callable(tool.requires_approval)
        which, call = ("Some calls require", "such a call") if some else ("Requires", "the call")
        text += (
            f" {which} an operator's approval: {call} returns status awaiting_approval"
            " and nothing is sent until an operator approves; follow it with get_operation."
        )
    return text


def write_input_schema(tool: tools.Tool) -> dict[str, Any]:
    """The tool's argument schema plus the required ``operation_id``."""
    schema = copy.deepcopy(tool.arguments.model_json_schema())
    schema["type"] = "object"
    schema["properties"] = {"operation_id": _OPERATION_ID_SCHEMA, **schema.get("properties", {})}
    schema["required"] = ["operation_id", *schema.get("required", [])]
    return schema


def read_definition(tool: ReadTool) -> types.Tool:
    schema = tool.arguments.model_json_schema()
    schema["type"] = "object"
    return types.Tool(
        name=tool.name,
        title=tool.name.replace("_", " ").capitalize(),
        description=tool.description,
        input_schema=schema,
        output_schema=tool.output_schema,
        annotations=types.ToolAnnotations(
            read_only_hint=True,
            destructive_hint=False,
            idempotent_hint=True,
            open_world_hint=False,
        ),
    )


def _validate(model: type[BaseModel], arguments: Mapping[str, Any]) -> BaseModel:
    try:
        return model.model_validate(dict(arguments))
    except ValidationError as exc:
        raise errors.InvalidArguments(tools.field_errors(exc)) from None


def _result(view: dict[str, Any]) -> types.CallToolResult:
    text = json.dumps(view, sort_keys=True, ensure_ascii=False)
    return types.CallToolResult(
        content=[types.TextContent(text=text)], structured_content=view, is_error=False
    )


def problem_document(error: errors.OutboxError) -> dict[str, Any]:
    """The HTTP API's problem document, plus ``retry_after`` (seconds, or null)."""
    doc = problems.document(error)
    doc["retry_after"] = getattr(error, "retry_after_seconds", None)
    return doc


def problem_result(error: errors.OutboxError) -> types.CallToolResult:
    doc = problem_document(error)
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(doc, sort_keys=True))],
        structured_content=doc,
        is_error=True,
    )


# --- the SDK server ------------------------------------------------------------------------

Authenticate = Callable[[ServerRequestContext[Any, Any]], Awaitable[Principal | None]]


def build_server(surface: Surface, authenticate: Authenticate) -> Server[Any]:
    async def on_list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        principal = await authenticate(ctx)
        if principal is None:
            # No tools for an unknown or revoked token; a call says why.
            return types.ListToolsResult(tools=[])
        return types.ListToolsResult(tools=surface.definitions(principal))

    async def on_call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        principal = await authenticate(ctx)
        return await surface.call(principal, params.name, params.arguments)

    return Server(
        "outbox",
        version=importlib.metadata.version("outbox-service"),
        title="Outbox",
        instructions=INSTRUCTIONS,
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
    )


# --- stdio: `outbox mcp` ----------------------------------------------------------------


async def serve_stdio(box: Outbox, token: str) -> None:
    from mcp.server.stdio import stdio_server

    async def authenticate(_ctx: ServerRequestContext[Any, Any]) -> Principal | None:
        # Every request, not once: a token revoked mid-session stops working at once.
        return await anyio.to_thread.run_sync(box.authenticate, token)

    server = build_server(Surface(box), authenticate)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


# --- streamable HTTP: mounted by `outbox serve` at /mcp -----------------------------------


class HttpEndpoint:
    """The ASGI app at ``/mcp``: bearer authentication, then the SDK's streamable HTTP.

    Stateless and JSON: each POST is one exchange with its own short-lived
    session manager, so there is no server-side session to lose on a restart
    and nothing to start with the application.
    """

    def __init__(self, box: Outbox, *, load_entry_points: bool = True) -> None:
        self.box = box
        self.server = build_server(
            Surface(box, load_entry_points=load_entry_points), self._principal
        )

    @staticmethod
    async def _principal(ctx: ServerRequestContext[Any, Any]) -> Principal | None:
        request = ctx.request
        if request is None:  # pragma: no cover - the HTTP transport always attaches it
            return None
        principal: Principal | None = request.scope.get(PRINCIPAL_SCOPE_KEY)
        return principal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _bearer(scope)
        principal = None
        if token is not None:
            principal = await anyio.to_thread.run_sync(self.box.authenticate, token)
        if principal is None:
            detail = (
                "send Authorization: Bearer <token>"
                if token is None
                else "the token is unknown or revoked"
            )
            response = problems.response(problems.document(problems.Unauthenticated(detail)))
            await response(scope, receive, send)
            return
        scope = {**scope, PRINCIPAL_SCOPE_KEY: principal}
        manager = StreamableHTTPSessionManager(app=self.server, json_response=True, stateless=True)
        async with manager.run():
            await manager.handle_request(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            text: str = bytes(value).decode("latin-1")
            scheme, _, credentials = text.partition(" ")
            if scheme.lower() == "bearer" and credentials.strip():
                return credentials.strip()
    return None
