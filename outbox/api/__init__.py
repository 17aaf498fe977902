"""The HTTP API: ``create_app(box)`` and the ``outbox serve`` command.

    from outbox import Outbox
    from outbox.api import create_app
    app = create_app(Outbox())          # any ASGI server; `outbox serve` runs uvicorn

Besides the tool routes and reads it serves ``/v1/approvals`` (operators'
decisions on approval-required calls) and, unless ``mcp=False``, the MCP
streamable HTTP endpoint at ``/mcp`` (``outbox.mcp_server``).

Routes of packages above ``outbox`` (the review queue) are mounted from the
``outbox.routers`` entry point group, so ``outbox`` never imports them. Their
errors render like ours: raise an ``OutboxError`` and ``problems`` answers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import signal
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

import anyio
import uvicorn
from fastapi import APIRouter, FastAPI
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import adapters
from outbox import logs, metrics
from outbox.api import (
    approvals,
    connections,
    limits,
    openapi,
    problems,
    ratelimit,
    routes,
    webhooks,
)
from outbox.service import Outbox

ROUTERS_GROUP = "outbox.routers"

__all__ = ["ROUTERS_GROUP", "cli_options", "cli_serve", "create_app"]


def create_app(
    box: Outbox,
    *,
    routers: Iterable[APIRouter] = (),
    load_entry_points: bool = True,
    max_body_bytes: int = limits.MAX_BODY_BYTES,
    mcp: bool = True,
    webhook_configs: Mapping[str, adapters.WebhookConfig] | None = None,
) -> FastAPI:
    """An app serving ``box``. The caller owns ``box`` (and closes it).

    ``webhook_configs``: the adapters' webhook settings by name; None reads them
    from the adapters file on the first event.
    """
    app = FastAPI(
        title="Outbox",
        summary="Writes to the outside world that are safe to retry.",
        version=importlib.metadata.version("outbox-service"),
        openapi_url="/openapi.json",
        docs_url=None,
        redoc_url=None,
    )
    app.state.outbox = box
    # /metrics: this process's counters, and the backlog of this app's own database.
    app.state.metrics_registry = metrics.backlog_registry(box.engine)
    problems.install(app)
    app.add_middleware(limits.BodyLimit, limit=max_body_bytes)
    # Outermost: a flooding tenant's request is refused before anything else runs.
    app.state.rate_limiter = ratelimit.Limiter(box.settings.rate_limit)
    app.add_middleware(ratelimit.RateLimitGate, limiter=app.state.rate_limiter)
    # Each tool of the app is its own operation, generated here from its registry.
    tool_router, components = routes.tool_routers(box.tools)
    app.include_router(tool_router)
    if routes.SUPPORT_TASK_TOOL in box.tools:
        # The demo's shortcut, POST /v1/tasks, only where the demo's tool is served.
        app.include_router(routes.tasks_router)
    app.include_router(routes.router)
    app.include_router(approvals.router)
    if mcp:
        # MCP over streamable HTTP: the same tokens, tenants and service calls.
        endpoint = _LazyMcp(box, load_entry_points=load_entry_points)
        app.router.routes.append(
            Route("/mcp", endpoint=endpoint, methods=["GET", "POST", "DELETE"])
        )
    if components:
        _add_components(app, components)
    app.include_router(webhooks.router)
    if webhook_configs is not None:
        app.state.webhook_configs = dict(webhook_configs)
    app.include_router(problems.router)
    openapi.install(app)
    for router in routers:
        app.include_router(router)
    if load_entry_points:
        for entry in importlib.metadata.entry_points(group=ROUTERS_GROUP):
            for router in entry.load()():
                app.include_router(router)
    return app


def _add_components(app: FastAPI, components: dict[str, Any]) -> None:
    """Put the tools' nested argument models where their ``$ref`` points."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in components.items():
                schemas.setdefault(name, schema)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class _LazyMcp:
    """``/mcp``, with the MCP SDK imported at the first request, not at start-up.

    The SDK is a large import: ``outbox serve`` (and every test app) starts as
    fast as without it, and a deployment that never uses MCP never pays for it.
    """

    def __init__(self, box: Outbox, *, load_entry_points: bool) -> None:
        self._box = box
        self._load_entry_points = load_entry_points
        self._endpoint: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._endpoint is None:
            # Off the event loop; two first requests at once may both build one (harmless).
            module = await anyio.to_thread.run_sync(importlib.import_module, "outbox.mcp.server")
            self._endpoint = module.HttpEndpoint(
                self._box, load_entry_points=self._load_entry_points
            )
        await self._endpoint(scope, receive, send)


# --- outbox serve ------------------------------------------------------------------


def cli_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default=None, help="address to listen on (default: OUTBOX_API_HOST or 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=int, default=None, help="port (default: OUTBOX_API_PORT or 8000)"
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="log lines as text or one JSON object each (default: OUTBOX_LOG_FORMAT or text)",
    )


def cli_serve(args: argparse.Namespace) -> int:
    from outbox import settings

    overrides = {"log_format": args.log_format} if args.log_format else {}
    config = settings.load(**overrides)
    logs.configure(config.log_format, config.log_level)
    host = args.host or config.api_host
    port = config.api_port if args.port is None else args.port
    from outbox import app as apps

    box = Outbox(getattr(args, "database_url", None), config=config, app=apps.from_args(args))
    try:
        server = Server(
            uvicorn.Config(
                create_app(box),
                host=host,
                port=port,
                log_level=config.log_level.lower(),
                # uvicorn's own loggers propagate to the root handler logs.configure set up,
                # so its lines come out in the same format as ours.
                log_config=None,
                proxy_headers=False,
                server_header=False,
                # Slow and half-open clients: a deadline per request head, a connection cap.
                **connections.server_options(
                    config.header_timeout.total_seconds(), config.max_connections
                ),
            )
        )
        server.run()
    finally:
        box.close()
    return 0


class Server(uvicorn.Server):
    """uvicorn's server, minus its re-raise of the stop signal after a graceful shutdown.

    uvicorn finishes in-flight requests on SIGTERM/SIGINT and then raises the
    signal again, which kills the process (status 143) before the engine is
    disposed: a clean stop would look like a crash to a supervisor.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for open requests
        else:
            self.should_exit = True
