"""THE classification table: what an httpx exception or an HTTP status means.

Every delivery attempt ends in exactly one ``Outcome``. The question each row
answers is the one the dispatcher must act on: *could the provider have acted
on this request?* When the answer is "we cannot tell", the row says AMBIGUOUS;
NOT_SENT is used only where the request provably never reached the provider.

Exceptions resolve to the row of the most specific class in their MRO (the way
httpx maps httpcore's exceptions), so a subclass httpx adds later falls back to
its parent's row, and anything outside the table is AMBIGUOUS. Statuses resolve
to an exact code, then the 2xx range, then the fallback row (AMBIGUOUS).

``table_markdown()`` renders both tables; docs/adapter-protocol.md embeds its output and
a test keeps the two identical.
"""

from __future__ import annotations

import email.utils
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from adapters.protocol import DeliveryResult, Outcome

BODY_EXCERPT_CHARS = 200
"""How much of a response body an error text quotes."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table."""

    outcome: Outcome | None  # None: classify the HTTP response the exception carries
    may_have_happened: bool | None  # None: as the response's row says
    why: str


_NOT_SENT = Outcome.NOT_SENT
_AMBIGUOUS = Outcome.AMBIGUOUS

# Every exception class httpx exports has its own row (tests walk httpx's tree to
# prove it). Order follows httpx's tree, for the rendered table.
EXCEPTION_RULES: Mapping[type[BaseException], Rule] = {
    httpx.HTTPError: Rule(_AMBIGUOUS, True, "base class: where the request got to is unknown"),
    httpx.RequestError: Rule(_AMBIGUOUS, True, "base class: where the request got to is unknown"),
    httpx.TransportError: Rule(_AMBIGUOUS, True, "base class: where the request got to is unknown"),
    httpx.TimeoutException: Rule(_AMBIGUOUS, True, "base class of the timeouts below"),
    httpx.ConnectTimeout: Rule(_NOT_SENT, False, "no connection was made, so no byte was sent"),
    httpx.ReadTimeout: Rule(_AMBIGUOUS, True, "the request was sent; the reply never came"),
    httpx.WriteTimeout: Rule(_AMBIGUOUS, True, "part of the request may have been sent"),
    httpx.PoolTimeout: Rule(_NOT_SENT, False, "no connection was free in our pool; nothing sent"),
    httpx.NetworkError: Rule(_AMBIGUOUS, True, "base class of the network errors below"),
    httpx.ConnectError: Rule(
        _NOT_SENT, False, "connecting failed (refused, DNS, TLS); nothing sent"
    ),
    httpx.ReadError: Rule(_AMBIGUOUS, True, "the connection broke while we waited for the reply"),
    httpx.WriteError: Rule(_AMBIGUOUS, True, "the connection broke while the request was written"),
    httpx.CloseError: Rule(_AMBIGUOUS, True, "closing failed after the exchange had started"),
    httpx.ProxyError: Rule(_NOT_SENT, False, "the proxy tunnel was never set up; nothing sent"),
    httpx.UnsupportedProtocol: Rule(_NOT_SENT, False, "URL scheme refused before connecting"),
    httpx.ProtocolError: Rule(_AMBIGUOUS, True, "base class of the protocol errors below"),
    httpx.LocalProtocolError: Rule(
        _AMBIGUOUS, True, "our side broke HTTP; headers may already have been sent"
    ),
    httpx.RemoteProtocolError: Rule(
        _AMBIGUOUS, True, "the provider broke HTTP (e.g. closed without a reply) after the send"
    ),
    httpx.DecodingError: Rule(
        _AMBIGUOUS, True, "a reply arrived (status unknown to us) and was garbled"
    ),
    httpx.TooManyRedirects: Rule(_AMBIGUOUS, True, "the provider answered the first request"),
    httpx.HTTPStatusError: Rule(None, None, "carries a response: classified by its status below"),
    httpx.InvalidURL: Rule(_NOT_SENT, False, "the URL could not be built; nothing sent"),
    httpx.CookieConflict: Rule(_AMBIGUOUS, True, "never raised by a send; unknown, so ambiguous"),
    httpx.StreamError: Rule(_AMBIGUOUS, True, "base class of the stream misuse errors below"),
    httpx.StreamConsumed: Rule(_AMBIGUOUS, True, "a streamed body was already sent once"),
    httpx.StreamClosed: Rule(_AMBIGUOUS, True, "a reply stream was being read"),
    httpx.ResponseNotRead: Rule(_AMBIGUOUS, True, "a reply exists"),
    httpx.RequestNotRead: Rule(_NOT_SENT, False, "the request body was never read, so never sent"),
}

UNKNOWN_EXCEPTION_RULE = Rule(
    _AMBIGUOUS, True, "not an httpx exception: raised during the send, so it may have happened"
)

SUCCESS_RULE = Rule(Outcome.DELIVERED, True, "the provider did it; the reference is in the body")
SUCCESS_WITHOUT_REFERENCE_RULE = Rule(
    _AMBIGUOUS,
    True,
    "it happened but cannot be named (reference missing, body unreadable or cut short): "
    "a resend with the same key replays it, or a lookup finds it",
)

STATUS_RULES: Mapping[int, Rule] = {
    400: Rule(Outcome.PERMANENT, False, "bad request: nothing happened; fix the payload"),
    404: Rule(Outcome.PERMANENT, False, "no such resource: nothing happened"),
    409: Rule(
        Outcome.RETRYABLE,
        True,
        "in progress: an earlier request with this key is being processed; ask again later",
    ),
    422: Rule(Outcome.PERMANENT, False, "unprocessable: nothing happened; fix the payload"),
    429: Rule(
        Outcome.RETRYABLE, False, "rate limited: this request did nothing; honour Retry-After"
    ),
    500: Rule(_AMBIGUOUS, True, "the provider failed part-way; it may have acted"),
    502: Rule(_AMBIGUOUS, True, "a gateway lost the reply; the provider may have acted"),
    503: Rule(
        Outcome.RETRYABLE, False, "unavailable: this request did nothing; honour Retry-After"
    ),
    504: Rule(_AMBIGUOUS, True, "a gateway timed out; the provider may have acted"),
}

FALLBACK_STATUS_RULE = Rule(_AMBIGUOUS, True, "any other status (1xx, 3xx, other 4xx/5xx): unknown")


def exception_rule(exc_type: type[BaseException]) -> Rule:
    """The row for the most specific class of ``exc_type`` that the table names."""
    for klass in exc_type.__mro__:
        rule = EXCEPTION_RULES.get(klass)
        if rule is not None:
            return rule
    return UNKNOWN_EXCEPTION_RULE


def status_rule(status_code: int) -> Rule:
    """The row for one HTTP status code."""
    rule = STATUS_RULES.get(status_code)
    if rule is not None:
        return rule
    if 200 <= status_code <= 299:
        return SUCCESS_RULE
    return FALLBACK_STATUS_RULE


def describe_exception(exc: BaseException) -> str:
    """``"ReadTimeout: timed out"``: class name and message, for an ``error`` field."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _utcnow() -> datetime:
    return datetime.now(UTC)


def classify_exception(
    exc: BaseException,
    *,
    reference_field: str | None = "id",
    now: Callable[[], datetime] = _utcnow,
) -> DeliveryResult:
    """Classify an exception raised while sending one request (see the table)."""
    rule = exception_rule(type(exc))
    if rule.outcome is None and isinstance(exc, httpx.HTTPStatusError):
        return classify_response(exc.response, reference_field=reference_field, now=now)
    error = describe_exception(exc)
    if rule.outcome is Outcome.NOT_SENT:
        return DeliveryResult.not_sent(error)
    return DeliveryResult.ambiguous(error)


def classify_response(
    response: httpx.Response,
    *,
    reference_field: str | None = "id",
    now: Callable[[], datetime] = _utcnow,
) -> DeliveryResult:
    """Classify a provider's reply by its status code (see the table).

    ``reference_field`` names the body field holding the provider's reference
    for a 2xx (a dotted path reaches into nested objects); None when the
    provider returns none.
    """
    body = response.read()
    return classify_status(
        response.status_code, response.headers, body, reference_field=reference_field, now=now
    )


def classify_status(
    status_code: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    reference_field: str | None = "id",
    now: Callable[[], datetime] = _utcnow,
) -> DeliveryResult:
    """``classify_response`` on the parts of a reply, for callers that read it themselves."""
    rule = status_rule(status_code)
    if rule.outcome is Outcome.DELIVERED:
        if reference_field is None:
            return DeliveryResult.delivered(None, status_code=status_code)
        ref = extract_reference(body, reference_field)
        if ref is None:
            # It happened, but we cannot name it. AMBIGUOUS (not DELIVERED without a
            # reference) sends it down the path that recovers the reference: a
            # resend with the same key replays it, or a lookup finds it.
            return DeliveryResult.ambiguous(
                f"HTTP {status_code} without a readable {reference_field!r} in the body: "
                f"{body_excerpt(body)}",
                status_code=status_code,
            )
        return DeliveryResult.delivered(ref, status_code=status_code)
    error = f"HTTP {status_code}: {body_excerpt(body)}".rstrip(": ")
    if rule.outcome is Outcome.RETRYABLE:
        raw = headers.get("retry-after")
        retry_after = parse_retry_after(raw, now())
        if raw is not None and retry_after is None:
            error = f"{error} (Retry-After {raw[:40]!r} not understood)"
        return DeliveryResult.retryable(retry_after, status_code=status_code, error=error)
    if rule.outcome is Outcome.PERMANENT:
        return DeliveryResult.permanent(error, status_code=status_code)
    return DeliveryResult.ambiguous(error, status_code=status_code)


_SECONDS = re.compile(r"\d{1,12}(\.\d{1,6})?")


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds or an HTTP date.

    A date in the past gives 0.0. Anything malformed gives None (the caller's
    own backoff applies); this never raises.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if _SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000" means UTC with no claim about local time
        when = when.replace(tzinfo=UTC)
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    try:
        return max(0.0, (when - now).total_seconds())
    except OverflowError:  # pragma: no cover - datetime arithmetic stays in range
        return None


def body_excerpt(body: bytes, limit: int = BODY_EXCERPT_CHARS) -> str:
    """The start of a body as one line of text, for error fields."""
    text = " ".join(body[: limit * 4].decode("utf-8", errors="replace").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def extract_reference(body: bytes, field: str) -> str | None:
    """The provider's reference at ``field`` (dotted path) of a JSON object body."""
    try:
        document: Any = json.loads(body)
    except ValueError:
        return None
    return reference_in(document, field)


def reference_in(document: Any, field: str) -> str | None:
    """``document[field]`` (dotted path) as a non-empty string, or None."""
    value = document
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = str(value)
    return text or None


def table_markdown() -> str:
    """Both tables as Markdown, exactly as docs/adapter-protocol.md shows them."""

    def cell(rule: Rule) -> tuple[str, str]:
        outcome = "by status" if rule.outcome is None else f"`{rule.outcome}`"
        happened = {True: "yes", False: "no", None: "by status"}[rule.may_have_happened]
        return outcome, happened

    lines = [
        "| httpx exception | outcome | may have happened | why |",
        "| --- | --- | --- | --- |",
    ]
    for klass, rule in EXCEPTION_RULES.items():
        outcome, happened = cell(rule)
        lines.append(f"| `{klass.__name__}` | {outcome} | {happened} | {rule.why} |")
    outcome, happened = cell(UNKNOWN_EXCEPTION_RULE)
    lines.append(f"| anything else | {outcome} | {happened} | {UNKNOWN_EXCEPTION_RULE.why} |")
    lines += [
        "",
        "| HTTP status | outcome | may have happened | why |",
        "| --- | --- | --- | --- |",
    ]
    rows: list[tuple[str, Rule]] = [
        ("2xx", SUCCESS_RULE),
        ("2xx, no readable reference", SUCCESS_WITHOUT_REFERENCE_RULE),
    ]
    rows += [(str(code), rule) for code, rule in sorted(STATUS_RULES.items())]
    rows.append(("anything else", FALLBACK_STATUS_RULE))
    for label, rule in rows:
        outcome, happened = cell(rule)
        lines.append(f"| {label} | {outcome} | {happened} | {rule.why} |")
    return "\n".join(lines) + "\n"


# --- a provider's own exceptions to the table ------------------------------------

OVERRIDE_OUTCOMES = {
    "delivered": Outcome.DELIVERED,
    "retryable": Outcome.RETRYABLE,
    "permanent": Outcome.PERMANENT,
    "ambiguous": Outcome.AMBIGUOUS,
}
"""What an override may say. Never NOT_SENT: a reply came, so the request arrived."""


@dataclass(frozen=True, slots=True)
class Override:
    """One ``[[adapters.NAME.classify]]`` rule: when a reply matches, its outcome.

    A rule matches when every condition given holds: the status is one of
    ``status`` (empty: any), each dotted ``match`` path of the JSON body equals
    its value, each ``headers`` entry equals the reply's header (names are
    case-insensitive), and the body contains ``body_contains``. Rules are tried
    in the order written, the first match wins, and a reply no rule matches
    goes to the table above.
    """

    outcome: Outcome
    status: frozenset[int] = frozenset()
    match: Mapping[str, Any] | None = None
    headers: Mapping[str, str] | None = None
    body_contains: str | None = None
    why: str = ""

    def applies(self, status_code: int, headers: Mapping[str, str], body: bytes) -> bool:
        if self.status and status_code not in self.status:
            return False
        for name, expected in (self.headers or {}).items():
            if headers.get(name) != expected:
                return False
        if self.body_contains is not None and self.body_contains.encode() not in body:
            return False
        if self.match:
            try:
                document: Any = json.loads(body)
            except ValueError:
                return False
            for path, expected in self.match.items():
                if _at_path(document, path) != expected:
                    return False
        return True

    def describe(self) -> str:
        parts = []
        if self.status:
            parts.append("status " + "/".join(str(s) for s in sorted(self.status)))
        parts += [f"{path} = {json.dumps(value)}" for path, value in (self.match or {}).items()]
        parts += [f"header {name}: {value}" for name, value in (self.headers or {}).items()]
        if self.body_contains is not None:
            parts.append(f"body contains {self.body_contains!r}")
        return f"{' and '.join(parts) or 'any reply'} -> {self.outcome.value}"


_MISSING = object()


def _at_path(document: Any, path: str) -> Any:
    value = document
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def classify_overrides(
    rules: tuple[Override, ...] | list[Override],
    status_code: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    reference_field: str | None = "id",
    now: Callable[[], datetime] = _utcnow,
) -> DeliveryResult | None:
    """The result the first matching rule gives, or None when no rule matches."""
    for rule in rules:
        if not rule.applies(status_code, headers, body):
            continue
        why = f" ({rule.why})" if rule.why else ""
        error = f"HTTP {status_code}: {body_excerpt(body)}".rstrip(": ") + why
        if rule.outcome is Outcome.DELIVERED:
            if reference_field is None:
                return DeliveryResult.delivered(None, status_code=status_code)
            ref = extract_reference(body, reference_field)
            if ref is None:
                return DeliveryResult.ambiguous(
                    f"HTTP {status_code} without a readable {reference_field!r} in the body: "
                    f"{body_excerpt(body)}",
                    status_code=status_code,
                )
            return DeliveryResult.delivered(ref, status_code=status_code)
        if rule.outcome is Outcome.RETRYABLE:
            raw = headers.get("retry-after")
            return DeliveryResult.retryable(
                parse_retry_after(raw, now()), status_code=status_code, error=error
            )
        if rule.outcome is Outcome.PERMANENT:
            return DeliveryResult.permanent(error, status_code=status_code)
        return DeliveryResult.ambiguous(error, status_code=status_code)
    return None
