"""``/openapi.json`` that says everything the API may answer, and ``/docs`` that shows it.

FastAPI describes what each route declares. What every route may answer
because of the layers around it is added here, once, for the routes of
``outbox`` and for those plugged in through ``outbox.routers`` alike:

- 400 (an invalid ``Content-Length``), 413 (a body over the limit) and 500
  (an unexpected error, logged) on every operation: the body limit and the
  last-resort handler run before and after any route;
- 401 (with ``WWW-Authenticate``) and 503 (with ``Retry-After``: the database
  stayed locked) on every operation that takes a bearer token: authentication
  reads the database before the route runs. ``AUTHENTICATED_STATUSES`` is the
  one list to extend when authentication may answer something new;
- every 4xx and 5xx answer is ``application/problem+json`` with the ``Problem``
  schema (FastAPI would say ``application/json`` and ``HTTPValidationError``
  for its 422, which the problem handler never sends);
- a 429 or a 503 documents ``Retry-After``.

``/docs`` is a plain page rendered from the same document on the server: it
works without network access and runs no third-party script on the origin that
also serves the operator console.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import HTMLResponse

from outbox.api import problems

PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}
EVERY_OPERATION_STATUSES = (400, 413, 500)
AUTHENTICATED_STATUSES = (401, 429, 503)  # 429: the tenant's rate limit (ratelimit.RateLimitGate)
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

_RETRY_AFTER = {
    "description": "Seconds to wait before sending the same request again (same key).",
    "required": True,
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}
_WWW_AUTHENTICATE = {
    "description": "`Bearer`: send `Authorization: Bearer <token>`.",
    "required": True,
    "schema": {"type": "string"},
}
_DESCRIPTIONS = {
    400: "Bad request (for example an invalid `Content-Length`); nothing was stored.",
    413: "The body is larger than the limit; nothing was stored.",
    500: "Unexpected error (logged, no details sent); retrying with the same key is safe.",
    401: "No token, or an unknown or revoked one.",
    503: "The database stayed locked past the busy timeout: retry with the same key.",
}


def complete(schema: dict[str, Any]) -> dict[str, Any]:
    """Add what every route may answer to FastAPI's document (in place, and returned)."""
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {})["Problem"] = problems.SCHEMA
    for methods in schema.get("paths", {}).values():
        for method in METHODS:
            if method in methods:
                _complete_operation(methods[method])
    _drop_unused_schemas(schema)
    return schema


def _complete_operation(operation: dict[str, Any]) -> None:
    answers: dict[str, Any] = operation.setdefault("responses", {})
    statuses = list(EVERY_OPERATION_STATUSES)
    if operation.get("security"):
        statuses += AUTHENTICATED_STATUSES
    for status in statuses:
        answers.setdefault(str(status), {"description": _DESCRIPTIONS.get(status, "Error")})
    for code, answer in answers.items():
        if not code.isdigit() or int(code) < 400:
            continue
        status = int(code)
        if answer.get("description") in (None, "", "Validation Error"):
            answer["description"] = problems.catalogue_title(status)
        answer["content"] = {problems.MEDIA_TYPE: {"schema": PROBLEM_REF}}
        headers = answer.setdefault("headers", {})
        if status == 401:
            headers.setdefault("WWW-Authenticate", _WWW_AUTHENTICATE)
        if status in (429, 503):
            headers.setdefault("Retry-After", _retry_after(operation, status))
        if not headers:
            del answer["headers"]


def _retry_after(operation: dict[str, Any], status: int) -> dict[str, Any]:
    # /readyz's 503 may also be "schema not current" (retry after_fix): no Retry-After then.
    if status == 503 and "health" in operation.get("tags", ()):
        return {**_RETRY_AFTER, "required": False}
    return _RETRY_AFTER


def _drop_unused_schemas(schema: dict[str, Any]) -> None:
    """FastAPI's ``HTTPValidationError`` is never sent (the 422 is a problem): drop it if unused."""
    schemas = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        text = json.dumps({k: v for k, v in schema.items() if k != "components"})
        text += json.dumps({k: v for k, v in schemas.items() if k != name})
        if name in schemas and f"#/components/schemas/{name}" not in text:
            del schemas[name]


def install(app: FastAPI) -> None:
    """Serve the completed document at ``/openapi.json`` and the reference page at ``/docs``."""
    original: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = complete(original())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.include_router(_docs_router())


# --- /docs -----------------------------------------------------------------------------


def _docs_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/docs", response_class=HTMLResponse)
    def docs(request: Request) -> HTMLResponse:
        return HTMLResponse(render_docs(request.app.openapi()))

    return router


def render_docs(schema: dict[str, Any]) -> str:
    """The API reference as one HTML page: each operation, its parameters and its answers."""
    info = schema.get("info", {})
    title = f"{info.get('title', 'API')} {info.get('version', '')}"
    out = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(str(info.get('summary', '')))}</p>",
        (
            '<p>Machine-readable: <a href="/openapi.json">/openapi.json</a> (OpenAPI '
            f"{html.escape(str(schema.get('openapi', '')))}). Errors are "
            "<code>application/problem+json</code>; their <code>type</code> links to "
            '<a href="/problems">/problems</a>. Authenticated routes take '
            "<code>Authorization: Bearer &lt;token&gt;</code>.</p>"
        ),
    ]
    for path, methods in schema.get("paths", {}).items():
        for method in METHODS:
            operation = methods.get(method)
            if operation is None:
                continue
            out.append(
                f"<section><h2><code>{method.upper()} {html.escape(path)}</code></h2>"
                f"<p>{problems.inline_html(str(operation.get('summary', '')))}"
                f"{' (bearer token)' if operation.get('security') else ''}</p>"
            )
            params = operation.get("parameters", [])
            if params:
                out.append("<p>Parameters:</p><ul>")
                out.extend(
                    f"<li><code>{html.escape(str(p.get('name')))}</code> in {p.get('in')}"
                    f"{', required' if p.get('required') else ''}"
                    f"{': ' + problems.inline_html(str(p['description'])) if p.get('description') else ''}"
                    "</li>"
                    for p in params
                )
                out.append("</ul>")
            out.append("<table><tr><th>status</th><th>meaning</th><th>content</th></tr>")
            for code, answer in sorted(operation.get("responses", {}).items()):
                media = ", ".join(answer.get("content", {})) or "-"
                heads = ", ".join(answer.get("headers", {}))
                out.append(
                    f"<tr><td>{html.escape(code)}</td>"
                    f"<td>{problems.inline_html(str(answer.get('description', '')))}"
                    f"{' (headers: ' + html.escape(heads) + ')' if heads else ''}</td>"
                    f"<td><code>{html.escape(media)}</code></td></tr>"
                )
            out.append("</table></section>")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        "<title>API reference</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<style>body{font:16px/1.5 system-ui,sans-serif;max-width:60rem;margin:2rem auto;"
        "padding:0 1rem}code{background:#f3f3f3;padding:0 .2em}td,th{text-align:left;"
        "padding:.1rem .6rem .1rem 0;vertical-align:top}</style></head><body>"
        + "".join(out)
        + "</body></html>"
    )
