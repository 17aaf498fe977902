"""Every error as ``application/problem+json`` (RFC 9457), with what the caller may do next.

A problem document has ``type``, ``title``, ``status``, ``detail`` and ``retry``.
``type`` is a URI reference, ``/problems/<slug>``: resolved against the URL of the
request that got the answer, it is a page this same server serves (``GET
/problems/<slug>``), so it works on any host, offline, and never trusts the
``Host`` header. The catalogue (``catalogue()``) is built from the error classes
and is the one source of those pages and of ``docs/problems.md``
(``problems.markdown()``, checked by a test). ``retry`` says what the
caller may do next:

- ``same_key``: nothing is known to have gone wrong for good; send the same
  request again with the same ``Idempotency-Key`` (503 comes with ``Retry-After``);
- ``never``: this exact request will never succeed (the key was used for other
  arguments, the record is not yours, the route does not exist);
- ``after_fix``: change the request first; nothing was stored;
- ``reconcile``: the key's record expired; look the outcome up instead of
  retrying under a fresh key.

``InvalidArguments`` and request validation errors add an ``errors`` list with
one ``{field, message, type}`` per bad field.

One function, ``render``, turns any exception into a response; ``install``
registers it for ``OutboxError``, Starlette's ``HTTPException``, FastAPI's
``RequestValidationError`` and, as the last resort, ``Exception``. Details of
unexpected errors never reach the caller (no stack trace, no SQL, no other
tenant's data): they go to the log.
"""

from __future__ import annotations

import html
import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, Response

from outbox import errors

MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "/problems/"
INTERNAL_DETAIL = "an unexpected error occurred; it was logged. Retrying with the same key is safe"

log = logging.getLogger("outbox.api")

# The JSON Schema of a problem document, for the OpenAPI description.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail", "retry"],
    "properties": {
        "type": {
            "type": "string",
            "format": "uri-reference",
            "description": "`/problems/<slug>`: a page of this server that explains the problem.",
        },
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "retry": {"type": "string", "enum": ["same_key", "never", "after_fix", "reconcile"]},
        "known_tools": {
            "type": "array",
            "items": {"type": "string"},
            "description": "With unknown-tool: the tools this service has.",
        },
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "field": {"type": "string"},
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                },
            },
        },
    },
}


# ``Idempotent-Replayed`` on every answer of a keyed write, for the OpenAPI description.
REPLAYED_HEADER: dict[str, Any] = {
    "Idempotent-Replayed": {
        "description": "`true` when this answer is the recorded result of an earlier request "
        "with the same key (nothing was done again), else `false`.",
        "required": True,
        "schema": {"type": "string", "enum": ["true", "false"]},
    }
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the given error statuses (``openapi.complete`` adds
    the problem+json content and the headers)."""
    return {
        status: {
            "description": catalogue_title(status),
            "content": {MEDIA_TYPE: {"schema": SCHEMA}},
        }
        for status in statuses
    }


def catalogue_title(status: int) -> str:
    """A short description of an error status, for the OpenAPI document."""
    return _HTTP_PROBLEMS.get(status, ("error", "Error", ""))[1]


# --- errors raised by the HTTP layer itself ---------------------------------------


class Unauthenticated(errors.OutboxError):
    """Send `Authorization: Bearer <token>` with a valid, unrevoked token."""

    problem_type = "unauthenticated"
    title = "Unauthenticated"
    status = 401
    retry = "after_fix"


class Forbidden(errors.OutboxError):
    """This route is for operator tokens; an agent token may not use it."""

    problem_type = "forbidden"
    title = "Forbidden"
    status = 403
    retry = "never"


class MalformedRequest(errors.RequestError):
    """The body is not a JSON document in UTF-8; nothing was stored."""

    problem_type = "malformed-request"
    title = "Malformed request body"
    status = 400


class UnsupportedMediaType(errors.RequestError):
    """Send the arguments as `Content-Type: application/json`."""

    problem_type = "unsupported-media-type"
    title = "Unsupported media type"
    status = 415


class NotReady(errors.OutboxError):
    """The database does not answer; retry with the same key."""

    problem_type = "not-ready"
    title = "Not ready"
    status = 503
    retry = "same_key"


# Status codes Starlette / FastAPI raise as ``HTTPException`` -> (type, title, retry).
_HTTP_PROBLEMS: dict[int, tuple[str, str, str]] = {
    400: ("bad-request", "Bad request", "after_fix"),
    401: ("unauthenticated", "Unauthenticated", "after_fix"),
    403: ("forbidden", "Forbidden", "never"),
    404: ("not-found", "Not found", "never"),
    405: ("method-not-allowed", "Method not allowed", "never"),
    406: ("not-acceptable", "Not acceptable", "after_fix"),
    409: ("conflict", "Conflict", "never"),
    410: ("operation-expired", "Operation record expired", "reconcile"),
    413: ("payload-too-large", "Payload too large", "after_fix"),
    415: ("unsupported-media-type", "Unsupported media type", "after_fix"),
    422: ("invalid-request", "Invalid request", "after_fix"),
    429: ("too-many-requests", "Too many requests", "same_key"),
    503: ("busy", "Busy", "same_key"),
}
_HTTP_FALLBACK = "http-error"

# What the problems that no error class stands for mean (the classes' docstrings do the rest).
_HTTP_DESCRIPTIONS: dict[str, str] = {
    "bad-request": "The request itself is malformed (for example an invalid `Content-Length` "
    "header); nothing was stored.",
    "method-not-allowed": "The route exists but not with this method.",
    "not-acceptable": "The server cannot answer in a media type the request accepts.",
    "payload-too-large": "The body is larger than the limit (64 KiB by default); nothing was "
    "stored. Send less.",
    "invalid-request": "A path, query or body parameter is invalid; `errors` names each field. "
    "Nothing was stored.",
    "too-many-requests": "Too many requests for now; wait for `Retry-After`, then send the "
    "same request with the same `Idempotency-Key`.",
    _HTTP_FALLBACK: "An HTTP error without a more specific type; `status` and `detail` say "
    "which. Its `retry` is `same_key` for a 5xx status and `after_fix` otherwise.",
}

# What each ``retry`` value lets the caller do, for the problem pages.
RETRY_ADVICE: dict[str, str] = {
    "same_key": "Send the same request again with the same `Idempotency-Key`, after "
    "`Retry-After` when the answer has one. Nothing is known to have gone wrong for good.",
    "never": "Do not repeat this request: it will never succeed as it is.",
    "after_fix": "Change the request first (see `detail` and `errors`); nothing was stored.",
    "reconcile": "The key's record expired: look the outcome up (read the task, or ask an "
    "operator) instead of retrying under a fresh key.",
}


def type_uri(slug: str) -> str:
    """The ``type`` member for a problem slug: a URI reference to this server's page about it."""
    return TYPE_PREFIX + slug


@dataclass(frozen=True, slots=True)
class ProblemType:
    slug: str
    title: str
    status: int
    retry: str
    description: str

    @property
    def uri(self) -> str:
        return type_uri(self.slug)


def _error_classes(root: type[errors.OutboxError]) -> list[type[errors.OutboxError]]:
    out, stack = [], [root]
    while stack:
        cls = stack.pop(0)
        out.append(cls)
        stack.extend(cls.__subclasses__())
    return out


def catalogue() -> dict[str, ProblemType]:
    """Every problem type the API can answer with, by slug, sorted.

    Built from the ``OutboxError`` classes (the first class that names a slug gives
    its title, status, retry and description) and from the statuses Starlette
    raises itself, so a new error class gets a page without another list to edit.
    """
    found: dict[str, ProblemType] = {}
    for cls in _error_classes(errors.OutboxError):
        if "problem_type" not in cls.__dict__ or cls.problem_type in found:
            continue
        found[cls.problem_type] = ProblemType(
            cls.problem_type,
            cls.title,
            cls.status,
            cls.retry,
            " ".join((cls.__doc__ or cls.title).split()),
        )
    http = [(status, *entry) for status, entry in _HTTP_PROBLEMS.items()]
    http.append((400, _HTTP_FALLBACK, "Error", "after_fix"))
    for status, slug, title, retry in http:
        if slug not in found:
            found[slug] = ProblemType(slug, title, status, retry, _HTTP_DESCRIPTIONS[slug])
    return dict(sorted(found.items()))


def markdown() -> str:
    """``docs/problems.md``: one section per problem type, anchored by its slug."""
    lines = [
        "# Problem types",
        "",
        "Every error of the HTTP API is an `application/problem+json` document (RFC 9457).",
        "Its `type` is `/problems/<slug>`, a URI reference: resolved against the URL of the",
        "request, it is a page the same server answers with the text below. Match on `type`",
        "(or on its slug), never on `title` or `detail`. See [HTTP conventions](http.md).",
        "",
        "`retry` says what may help:",
        "",
        *(f"- `{value}`: {advice}" for value, advice in RETRY_ADVICE.items()),
        "",
        "This page is generated from the error classes (a test keeps it current):",
        (
            "`python -c 'from outbox.api import problems; print(problems.markdown(), end=\"\")' "
            "> docs/problems.md`."
        ),
    ]
    for problem in catalogue().values():
        lines += [
            "",
            f"## {problem.slug}",
            "",
            (
                f"**{problem.title}**: status {problem.status}, `retry: {problem.retry}`, "
                f"type `{problem.uri}`."
            ),
            "",
            problem.description,
            "",
            f"What to do: {RETRY_ADVICE[problem.retry]}",
        ]
    return "\n".join(lines) + "\n"


def document(error: errors.OutboxError) -> dict[str, Any]:
    """The problem document of a domain error."""
    detail = error.detail
    if error.status >= 500 and error.problem_type == "internal":
        # An unclassified OutboxError may carry driver text (constraint names, SQL).
        detail = INTERNAL_DETAIL
    doc: dict[str, Any] = {
        "type": type_uri(error.problem_type),
        "title": error.title,
        "status": error.status,
        "detail": detail,
        "retry": error.retry,
    }
    if isinstance(error, errors.InvalidArguments):
        doc["errors"] = error.errors
    if isinstance(error, errors.UnknownTool):
        doc["known_tools"] = error.known
    return doc


def response(doc: dict[str, Any], *, headers: dict[str, str] | None = None) -> Response:
    """A problem+json response; 503 ``same_key`` answers always say when to come back."""
    out = dict(headers or {})
    if doc["status"] == 503 and doc["retry"] == "same_key":
        out.setdefault("Retry-After", str(errors.Busy.retry_after_seconds))
    if doc["status"] == 401:
        out.setdefault("WWW-Authenticate", "Bearer")
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii")
    return Response(content=body, status_code=doc["status"], headers=out, media_type=MEDIA_TYPE)


def render(exc: BaseException) -> Response:
    """Any exception as a problem response. Unknown exceptions become an opaque 500."""
    if isinstance(exc, errors.OutboxError):
        headers = {}
        retry_after = getattr(exc, "retry_after_seconds", None)
        if exc.status in (429, 503) and retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        headers.update(getattr(exc, "response_headers", None) or {})
        return response(document(exc), headers=headers)
    if isinstance(exc, RequestValidationError):
        return response(
            {
                "type": type_uri("invalid-request"),
                "title": "Invalid request",
                "status": 422,
                "detail": "the request's parameters are invalid; nothing was stored",
                "retry": "after_fix",
                "errors": validation_errors(exc),
            }
        )
    if isinstance(exc, HTTPException):
        fallback = (_HTTP_FALLBACK, "Error", "same_key" if exc.status_code >= 500 else "after_fix")
        kind, title, retry = _HTTP_PROBLEMS.get(exc.status_code, fallback)
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail else title
        return response(
            {
                "type": type_uri(kind),
                "title": title,
                "status": exc.status_code,
                "detail": detail,
                "retry": retry,
            },
            headers=dict(exc.headers or {}),
        )
    return response(
        {
            "type": type_uri(errors.OutboxError.problem_type),
            "title": "Internal error",
            "status": 500,
            "detail": INTERNAL_DETAIL,
            "retry": "same_key",
        }
    )


def validation_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """FastAPI's error list in the shape of ``InvalidArguments.errors`` (no input echoed)."""
    out = []
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ())]
        out.append(
            {
                "field": ".".join(loc),
                "message": str(err.get("msg", "invalid")),
                "type": str(err.get("type", "value_error")),
            }
        )
    return out


async def _handle(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, errors.OutboxError | HTTPException | RequestValidationError):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    elif isinstance(exc, errors.OutboxError) and exc.status >= 500:
        log.warning("%s on %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
    return render(exc)


def install(app: FastAPI) -> None:
    """Register ``render`` for every exception a route (ours or a plugged-in one) may raise."""
    for kind in (errors.OutboxError, HTTPException, RequestValidationError, Exception):
        app.add_exception_handler(kind, _handle)


# --- the pages the type URIs resolve to -------------------------------------------------

HTML_CONTENT: dict[str, Any] = {"text/html": {"schema": {"type": "string"}}}

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:16px/1.5 system-ui,sans-serif;max-width:46rem;margin:2rem auto;padding:0 1rem}}
code{{background:#f3f3f3;padding:0 .2em}}dt{{font-weight:600}}</style></head>
<body>{body}</body></html>
"""


def inline_html(text: str) -> str:
    """Escape, then turn `code` spans into <code> (the only markup the texts use)."""
    parts = html.escape(text, quote=False).split("`")
    return "".join(f"<code>{part}</code>" if i % 2 else part for i, part in enumerate(parts))


def _page(title: str, body: str) -> HTMLResponse:
    return HTMLResponse(_PAGE.format(title=html.escape(title), body=body))


router = APIRouter(tags=["conventions"])


@router.get(
    "/problems",
    summary="Every problem type, with what a caller may do next",
    response_class=HTMLResponse,
    responses={200: {"content": HTML_CONTENT, "description": "An HTML page."}},
)
def problem_index() -> HTMLResponse:
    items = "".join(
        f'<li><a href="{html.escape(p.uri)}"><code>{html.escape(p.slug)}</code></a>: '
        f"{html.escape(p.title)} ({p.status}, retry <code>{p.retry}</code>)</li>"
        for p in catalogue().values()
    )
    advice = "".join(
        f"<dt><code>{value}</code></dt><dd>{inline_html(text)}</dd>"
        for value, text in RETRY_ADVICE.items()
    )
    return _page(
        "Problem types",
        "<h1>Problem types</h1><p>Errors are <code>application/problem+json</code>; "
        "their <code>type</code> links here. <code>retry</code> says what may help:</p>"
        f'<dl>{advice}</dl><ul>{items}</ul><p><a href="/docs">API reference</a></p>',
    )


@router.get(
    "/problems/{slug}",
    summary="What one problem type means and what to do about it",
    response_class=HTMLResponse,
    responses={
        200: {"content": HTML_CONTENT, "description": "An HTML page."},
        **responses(404),
    },
)
def problem_page(slug: str) -> HTMLResponse:
    problem = catalogue().get(slug)
    if problem is None:
        raise HTTPException(404, f"no problem type {slug!r}; see /problems")
    return _page(
        problem.title,
        f"<h1>{html.escape(problem.title)}</h1>"
        f"<p><code>type: {html.escape(problem.uri)}</code> · status {problem.status} · "
        f"<code>retry: {problem.retry}</code></p>"
        f"<p>{inline_html(problem.description)}</p>"
        f"<p><strong>What to do:</strong> {inline_html(RETRY_ADVICE[problem.retry])}</p>"
        '<p><a href="/problems">Every problem type</a> · <a href="/docs">API reference</a></p>',
    )
