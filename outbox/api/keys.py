"""The ``Idempotency-Key`` request header: one field value to one operation id.

The IETF draft (draft-ietf-httpapi-idempotency-key-header) makes the field a
Structured Field Item (RFC 8941) whose value is a String: ``Idempotency-Key:
"order-4711"``. Callers written before it send the bare value:
``Idempotency-Key: order-4711``. Both name the same operation:

- a value that starts with a double quote is parsed as a structured-field
  string by ``http_sfv`` (escapes undone, parameters ignored, as RFC 8941 asks
  of a recipient); anything it cannot parse is a 400, never a different key;
- any other value is the operation id verbatim, as before, so a key that was
  never an sf-token (``550e8400-e29b-...`` starts with a digit, ``a;b`` has a
  semicolon) keeps naming the record it always named.

The result is checked like every operation id (1-255 visible ASCII
characters), so ``"a b"`` is refused, not stored under a key with a space.
"""

from __future__ import annotations

from http_sfv.item import Item
from starlette.requests import Request

from outbox import errors
from outbox.creating import create

HEADER = "Idempotency-Key"

# The OpenAPI description of the header, shared by every route that reads it.
DESCRIPTION = (
    "The operation id, chosen by the caller and sent unchanged with every retry of one "
    'intent. A structured-field string (`"order-4711"`, RFC 8941) or the bare value '
    "(`order-4711`): both name the same operation. The id itself is 1-255 visible ASCII "
    "characters."
)
# An id has no spaces, so neither has a valid field value; quoting and escapes may double it.
SCHEMA = {"type": "string", "minLength": 1, "maxLength": 512, "pattern": "^[!-~]+$"}


def parameter(*, required: bool) -> dict[str, object]:
    """The OpenAPI header parameter."""
    return {
        "name": HEADER,
        "in": "header",
        "required": required,
        "description": DESCRIPTION,
        "schema": SCHEMA,
    }


def parse(value: str) -> str:
    """The operation id one ``Idempotency-Key`` field value names; ``InvalidOperationId`` if none."""
    text = value.strip(" \t")
    if text.startswith('"'):
        item = Item()
        try:
            item.parse(text.encode("ascii"))
        except ValueError:  # UnicodeEncodeError included: sf-strings are ASCII
            raise errors.InvalidOperationId(
                "the Idempotency-Key is not a valid structured-field string "
                '(send "<id>" with \\" and \\\\ escaped, or the bare id)'
            ) from None
        text = str(item.value)
    return create.validate_operation_id(text)


def from_request(request: Request) -> str:
    """The request's operation id: exactly one ``Idempotency-Key`` header, parsed by ``parse``."""
    operation_id = optional(request)
    if operation_id is None:
        raise errors.InvalidOperationId(
            "the Idempotency-Key header is required: choose an operation id for this intent "
            "and send the same one with every retry"
        )
    return operation_id


def optional(request: Request) -> str | None:
    """Like ``from_request``, for routes where the key may be left out (``None``)."""
    values = request.headers.getlist(HEADER)
    if not values:
        return None
    if len(values) > 1:
        raise errors.InvalidOperationId("send exactly one Idempotency-Key header")
    return parse(values[0])
