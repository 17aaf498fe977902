"""Every error as ``application/problem+json`` (RFC 9457), with what the caller may do next.

A problem document has ``type``, ``title``, ``status``, ``detail`` and ``retry``:

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

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from outbox import errors

MEDIA_TYPE = "application/problem+json"
INTERNAL_DETAIL = "an unexpected error occurred; it was logged. Retrying with the same key is safe"

log = logging.getLogger("outbox.api")

# The JSON Schema of a problem document, for the OpenAPI description.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail", "retry"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "retry": {"type": "string", "enum": ["same_key", "never", "after_fix", "reconcile"]},
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


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the given error statuses."""
    return {
        status: {
            "description": _HTTP_PROBLEMS.get(status, ("error", "Error", ""))[1],
            "content": {MEDIA_TYPE: {"schema": SCHEMA}},
        }
        for status in statuses
    }


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


def document(error: errors.OutboxError) -> dict[str, Any]:
    """The problem document of a domain error."""
    detail = error.detail
    if error.status >= 500 and error.problem_type == "internal":
        # An unclassified OutboxError may carry driver text (constraint names, SQL).
        detail = INTERNAL_DETAIL
    doc: dict[str, Any] = {
        "type": error.problem_type,
        "title": error.title,
        "status": error.status,
        "detail": detail,
        "retry": error.retry,
    }
    if isinstance(error, errors.InvalidArguments):
        doc["errors"] = error.errors
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
                "type": "invalid-request",
                "title": "Invalid request",
                "status": 422,
                "detail": "the request's parameters are invalid; nothing was stored",
                "retry": "after_fix",
                "errors": validation_errors(exc),
            }
        )
    if isinstance(exc, HTTPException):
        fallback = ("http-error", "Error", "same_key" if exc.status_code >= 500 else "after_fix")
        kind, title, retry = _HTTP_PROBLEMS.get(exc.status_code, fallback)
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail else title
        return response(
            {
                "type": kind,
                "title": title,
                "status": exc.status_code,
                "detail": detail,
                "retry": retry,
            },
            headers=dict(exc.headers or {}),
        )
    return response(
        {
            "type": "internal",
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
