"""The tool boundary over HTTP: ``POST /v1/tools/{tool}``, ``POST /v1/tasks`` and the reads.

Order of checks on a write, each before the next is looked at:
authentication (the tenant comes from the token) -> ``Idempotency-Key`` ->
tool name -> content type -> body (at most 64 KiB, UTF-8 JSON) -> the create
path. A replay goes through every one of them too, so a key never works as a
credential, and a malformed retry is refused before any lookup.

A created or replayed answer is the stored receipt, byte for byte, with the
status of the first reply; ``Idempotent-Replayed`` says which it is.
"""

from __future__ import annotations

import json
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from outbox import app as apps
from outbox import db, errors, metrics, tools
from outbox.api import auth, keys, problems
from outbox.creating import create
from outbox.creating.create import ExecuteResult
from outbox.service import Outbox, Principal

SUPPORT_TASK_TOOL = tools.SUPPORT_TASK.name
MAX_TASK_ID = 2**63 - 1  # BIGINT: a larger id cannot exist, and PostgreSQL would refuse it

router = APIRouter()
tasks_router = APIRouter()  # POST /v1/tasks: only with the demo's tool (``create_app``)

Box = Annotated[Outbox, Depends(auth.get_box)]
Caller = Annotated[Principal, Depends(auth.require_principal)]

RECEIPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "The tool's receipt, exactly as stored at creation.",
    "additionalProperties": True,
}
_WRITE_RESPONSES: dict[int | str, dict[str, Any]] = {
    201: {
        "description": "Created; or a replay of it (header `Idempotent-Replayed: true`).",
        "content": {"application/json": {"schema": RECEIPT_SCHEMA}},
        "headers": {
            **problems.REPLAYED_HEADER,
            "Location": {
                "description": "The operation's current state: `GET /v1/operations/{id}`.",
                "required": True,
                "schema": {"type": "string"},
            },
        },
    },
    **problems.responses(400, 401, 404, 410, 413, 415, 422, 503),
}


# A tool that requires approval answers 202: recorded, its effects held for an operator.
_TOOL_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_WRITE_RESPONSES,
    202: {
        "description": "Recorded and awaiting an operator's approval (the tool requires "
        "one); nothing is sent until it is approved. A replay answers 202 again.",
        "content": {"application/json": {"schema": RECEIPT_SCHEMA}},
    },
}


def _write_openapi(arguments_schema: dict[str, Any]) -> dict[str, Any]:
    # The body is read by hand (bounded, exact error answers), so describe it here.
    return {
        "parameters": [keys.parameter(required=True)],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": arguments_schema}},
        },
    }


# --- the write path -------------------------------------------------------------------


@router.post(
    "/v1/tools/{tool}",
    status_code=201,
    summary="Call a tool by name, idempotently on Idempotency-Key",
    description="Any tool of the app. Each one is also described by its own operation, "
    "`POST /v1/tools/<name>`, with its arguments' schema and an example.",
    responses=_TOOL_RESPONSES,
    openapi_extra=_write_openapi({"type": "object", "description": "The tool's arguments."}),
)
async def call_tool(tool: str, request: Request, principal: Caller, box: Box) -> Response:
    return await _execute(request, principal, box, tool)


# The per-tool operations refer to nested argument models here; ``create_app``
# adds them to the document's components.
COMPONENT_REF = "#/components/schemas/{model}"


def tool_routers(registry: tools.Registry) -> tuple[APIRouter, dict[str, Any]]:
    """One operation ``POST /v1/tools/<name>`` per tool, and the schemas they refer to.

    Documentation of the same path as ``call_tool``: it answers exactly as the
    generic route would, with the tool's schema and example in the document.
    """
    tool_router = APIRouter()
    components: dict[str, Any] = {}
    for name in registry.names():
        tool = registry.get(name)
        arguments = apps.tool_schema(tool, ref_template=COMPONENT_REF)
        components.update(arguments.pop("$defs", {}))
        content: dict[str, Any] = {"schema": arguments}
        example = apps.tool_example(tool)
        if example is not None:
            content["example"] = example
        extra = _write_openapi(arguments)
        extra["requestBody"]["content"]["application/json"] = content
        tool_router.add_api_route(
            "/v1/tools/" + quote(name, safe=""),
            _tool_endpoint(name),
            methods=["POST"],
            status_code=201,
            summary=tool.description or f"Call {name}, idempotently on Idempotency-Key",
            description=f"The tool `{name}`, payload version {tool.payload_version}. "
            "Same key and arguments: the stored receipt again, byte for byte.",
            operation_id=f"call_tool_{name}",
            tags=["tools"],
            responses=_TOOL_RESPONSES if tool.requires_approval else _WRITE_RESPONSES,
            openapi_extra=extra,
        )
    return tool_router, components


def _tool_endpoint(name: str) -> Any:
    async def call_named_tool(request: Request, principal: Caller, box: Box) -> Response:
        return await _execute(request, principal, box, name)

    return call_named_tool


@tasks_router.post(
    "/v1/tasks",
    status_code=201,
    summary="Create a support task (the tool create_support_task)",
    responses=_WRITE_RESPONSES,
    openapi_extra=_write_openapi(tools.SupportTaskArgs.model_json_schema()),
)
async def create_task(request: Request, principal: Caller, box: Box) -> Response:
    return await _execute(request, principal, box, SUPPORT_TASK_TOOL)


async def _execute(request: Request, principal: Principal, box: Outbox, tool: str) -> Response:
    try:
        operation_id = keys.from_request(request)
        box.tools.get(tool)  # UnknownTool (404) before the body is read
        require_json(request)
        arguments = parse_json(await request.body())
    except errors.OutboxError as error:
        # Refused before the create path: counted here, since box.execute never sees it.
        label = tool if tool in box.tools else "unknown"
        metrics.OPERATIONS.labels(label, metrics.create_result(error)).inc()
        raise
    # The create path is synchronous database work: keep it off the event loop.
    result = await run_in_threadpool(box.execute, principal.tenant, operation_id, tool, arguments)
    return receipt_response(result)


def require_json(request: Request) -> None:
    media, _, params = request.headers.get("content-type", "").partition(";")
    if media.strip().lower() != "application/json":
        raise problems.UnsupportedMediaType()
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            raise problems.UnsupportedMediaType("JSON bodies must be UTF-8 (charset=utf-8)")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes) -> Any:
    """Strict UTF-8 JSON; every way it can fail is a 400 (never a 500)."""
    try:
        text = body.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise problems.MalformedRequest(
            f"the body is not valid UTF-8 (byte {exc.start}); nothing was stored"
        ) from None
    except json.JSONDecodeError as exc:
        raise problems.MalformedRequest(
            f"the body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "nothing was stored"
        ) from None
    except RecursionError:
        raise problems.MalformedRequest(
            "the JSON is nested too deeply; nothing was stored"
        ) from None
    except ValueError as exc:  # NaN/Infinity, integers past Python's digit limit
        raise problems.MalformedRequest(f"the body is not valid JSON ({exc})") from None
    bad = _unstorable_text(value)
    if bad:
        raise errors.InvalidArguments(bad)
    return value


def _unstorable_text(value: Any, path: str = "") -> list[dict[str, Any]]:
    """Fields no database stores faithfully: NUL (PostgreSQL text refuses it) and lone surrogates
    (not encodable as UTF-8). Caught here, they are a 422; caught by the driver, a 500."""
    out: list[dict[str, Any]] = []
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack and len(out) < 20:
        where, item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item or any("\ud800" <= ch <= "\udfff" for ch in item):
                out.append(
                    {
                        "field": where,
                        "message": "text must not contain NUL characters or unpaired surrogates",
                        "type": "string_unstorable",
                    }
                )
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((f"{where}.{key}" if where else str(key), key))
                stack.append((f"{where}.{key}" if where else str(key), child))
        elif isinstance(item, list):
            stack.extend(
                (f"{where}.{i}" if where else str(i), child) for i, child in enumerate(item)
            )
    return out


def receipt_response(result: ExecuteResult) -> Response:
    # The stored text itself, never a re-serialised dict: a replay must be byte-identical.
    return Response(
        content=result.receipt_json.encode("utf-8"),
        status_code=result.status_code,
        media_type="application/json",
        headers={
            "Idempotent-Replayed": "true" if result.replayed else "false",
            "Location": "/v1/operations/" + quote(result.operation_id, safe=""),
        },
    )


# --- reads ----------------------------------------------------------------------------


@router.get(
    "/v1/operations/{operation_id:path}",
    summary="The receipt, creation time and each effect's current state",
    responses=problems.responses(400, 401, 404, 410),
)
def get_operation(operation_id: str, principal: Caller, box: Box) -> JSONResponse:
    create.validate_operation_id(operation_id)
    return JSONResponse(box.get_operation(principal.tenant, operation_id))


@router.get(
    "/v1/tasks/{task_id}",
    summary="A task as it is now",
    responses=problems.responses(401, 404, 422),
)
def get_task(
    task_id: Annotated[int, Path(ge=1, le=MAX_TASK_ID)], principal: Caller, box: Box
) -> JSONResponse:
    return JSONResponse(box.get_task(principal.tenant, task_id))


# --- health -----------------------------------------------------------------------------


@router.get("/metrics", include_in_schema=False)
def prometheus_metrics(request: Request) -> Response:
    """Prometheus text format: counters of this process, backlog gauges of its database."""
    return Response(
        metrics.render(request.app.state.metrics_registry),
        media_type=metrics.CONTENT_TYPE,
    )


@router.get("/healthz", summary="The process is up", tags=["health"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="The database answers and its schema is current",
    tags=["health"],
    responses=problems.responses(503),
)
def readyz(box: Box) -> dict[str, str]:
    try:
        db.check_schema(box.engine)
    except errors.OutboxError:
        raise
    except (sa_exc.SQLAlchemyError, OSError) as error:
        # Driver errors carry host names and SQL: log them, answer with a plain 503.
        problems.log.warning("readiness check failed: %s", error)
        raise problems.NotReady() from None
    return {"status": "ready", "schema": db.head_revision()}
